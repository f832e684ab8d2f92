"""protocol/speculative.py: `speculative_config` as vLLM spells it, its defaults, and
what it refuses (naming the key)."""

from __future__ import annotations

import argparse
import json

import pytest

from pagellm.protocol.engine_args import EngineArgs
from pagellm.protocol.speculative import SpeculativeConfig, parse_speculative_config


def test_the_cli_flag_and_the_defaults():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    config = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
              "prompt_lookup_min": 2}
    args = EngineArgs.from_cli_args(parser.parse_args(
        ["--model", "m", "--speculative-config", json.dumps(config)]))
    assert args.speculative == SpeculativeConfig(method="ngram", num_speculative_tokens=4,
                                                 prompt_lookup_max=4, prompt_lookup_min=2)
    assert EngineArgs.from_cli_args(parser.parse_args(args.to_cli_args())) == args
    # vLLM's defaults: each bound the other's, both 5 when neither is given.
    for given, bounds in (({}, (5, 5)), ({"prompt_lookup_max": 3}, (3, 3)),
                          ({"prompt_lookup_min": 2}, (2, 2))):
        parsed = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2,
                                           **given})
        assert parsed is not None
        assert (parsed.prompt_lookup_max, parsed.prompt_lookup_min) == bounds
    assert EngineArgs(model="m").speculative is None


def test_a_draft_model_config_and_vllms_method_inferred_from_model():
    for config in ({"method": "draft_model", "model": "small", "num_speculative_tokens": 3},
                   {"model": "small", "num_speculative_tokens": 3}):
        assert parse_speculative_config(config) == SpeculativeConfig(
            method="draft_model", num_speculative_tokens=3, model="small")


@pytest.mark.parametrize(("config", "error"), [
    ("ngram", "must be a dict"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1},
     "unknown key"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs the draft model's"),
    ({"method": "draft_model", "model": 7, "num_speculative_tokens": 2}, "needs the draft"),
    ({"method": "draft_model", "model": "d", "num_speculative_tokens": 2,
      "prompt_lookup_max": 3}, "unknown key.*prompt_lookup_max.*'draft_model'"),
    ({"method": "ngram", "model": "d", "num_speculative_tokens": 2}, "unknown key.*model"),
    ({"method": ["ngram"], "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "eagle3", "num_speculative_tokens": 2}, "'eagle3' is not supported yet"),
    ({"method": "telepathy", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "ngram"}, "num_speculative_tokens must be an integer"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 10**9}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 10**9},
     "prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "exceeds"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0},
     "disable_by_batch_size"),
])
def test_what_cannot_be_served_is_refused_by_name(config, error):
    with pytest.raises((ValueError, TypeError), match=error):
        EngineArgs(model="m", speculative_config=config)
