"""The model's default sampling parameters (vLLM's `generation_config` option): what a
request that leaves a field unset samples with.

Chat models ship their recommended sampling in generation_config.json (Qwen2.5's
temperature 0.7, top_p 0.8, top_k 20, repetition_penalty 1.05); vLLM applies the
fields below as defaults, and so does pagellm: `LLM.generate` without sampling params,
`LLM.get_default_sampling_params()`, and every server request for each field it does
not set. `max_new_tokens` caps max_tokens. `generation_config="vllm"` turns it off.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pagellm.protocol.sampling_params import SamplingParams

# generation_config.json's name -> SamplingParams' (vLLM's list).
FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
MAX_FILE_BYTES = 1 << 20  # Hugging Face's are under 1 KB


def default_sampling_fields(model_dir: str, setting: str) -> dict[str, Any]:
    """SamplingParams field -> default value, from `setting`: "auto" (the model
    directory's generation_config.json, if it has one), "vllm" (none) or a directory
    that must hold one. A value SamplingParams refuses is a ValueError naming the file."""
    if setting == "vllm":
        return {}
    path = Path(model_dir if setting == "auto" else setting) / "generation_config.json"
    if not path.is_file():
        if setting == "auto":
            return {}
        raise ValueError(f"generation_config={setting!r}: no generation_config.json there")
    if path.stat().st_size > MAX_FILE_BYTES:
        raise ValueError(f"{path} is larger than {MAX_FILE_BYTES} bytes")
    try:
        config = json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object")
    fields = {ours: config[theirs] for theirs, ours in FIELDS.items()
              if config.get(theirs) is not None}
    try:
        SamplingParams(**fields)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from None
    return fields
