"""protocol/validation.py: a model's config.json is checked field by field before
anything is built from it (issue 12, finding 9: num_attention_heads=0 gave a bare
ZeroDivisionError). The reference is the refusal, which names the field. (The checks
on config dictionaries themselves are tests/protocol/test_protocol.py's.)"""

from __future__ import annotations

import pytest
from helpers import KV

from pagellm import LLM


def test_model_config_values_are_checked_with_their_names(model_dirs, tmp_path):
    """Finding 9: num_attention_heads=0 gave a bare ZeroDivisionError."""
    import json
    import shutil

    for field, value in (("num_attention_heads", 0), ("hidden_size", -64),
                         ("vocab_size", 0), ("num_hidden_layers", 0),
                         ("num_key_value_heads", 3), ("max_position_embeddings", 0)):
        broken = tmp_path / field
        shutil.copytree(model_dirs["llama"], broken)
        config = json.loads((broken / "config.json").read_text())
        config[field] = value
        (broken / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=field):
            LLM(str(broken), multiprocess=False, kv_cache_memory_bytes=int(KV))
