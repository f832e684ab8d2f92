"""`speculative_config`: vLLM's speculative decoding options, checked once.

    {"method": "ngram", "num_speculative_tokens": k,
     "prompt_lookup_max": 4, "prompt_lookup_min": 2, "disable_by_batch_size": 8}
    {"method": "draft_model", "model": DIR, "num_speculative_tokens": k}

"ngram" is prompt lookup: the last n tokens (n from prompt_lookup_max down to
prompt_lookup_min) are looked up earlier in the request's own tokens, and the k tokens
that followed them there are proposed (enginecore/spec_decode.py). As in vLLM,
prompt_lookup_min and prompt_lookup_max default to each other, and both to 5.
"draft_model" runs a smaller model of the same vocabulary, with its own paged KV cache,
k steps ahead greedily after each step (executor/worker/draft_model.py); as in vLLM, a
config with a "model" and no "method" means it. Either way one forward pass of the
target then verifies the proposals (executor/worker/model_runner.py).
`disable_by_batch_size`: no proposals in a step with more running requests than this
(where a step is already bound by compute, verifying rejected tokens only costs
throughput); None: on CUDA always (vLLM's default), on the CPU a measured default
(enginecore/spec_decode.py).
"""

from __future__ import annotations

from typing import Any

import msgspec

from pagellm.protocol.validation import check_int

METHODS = ("ngram", "draft_model")
# Methods vLLM has that need trained heads or other machinery: refused by name.
NOT_YET = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "suffix")
MAX_SPECULATIVE_TOKENS = 32  # each is a position verified every step; more never pays
MAX_LOOKUP = 1024  # a longer n-gram would almost never match, and costs a search each step
DEFAULT_LOOKUP = 5
_COMMON = ("method", "num_speculative_tokens", "disable_by_batch_size")
_KEYS = {"ngram": (*_COMMON, "prompt_lookup_max", "prompt_lookup_min"),
         "draft_model": (*_COMMON, "model")}


class SpeculativeConfig(msgspec.Struct, frozen=True, kw_only=True):
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = DEFAULT_LOOKUP
    prompt_lookup_min: int = DEFAULT_LOOKUP
    disable_by_batch_size: int | None = None
    model: str | None = None  # the draft model's directory ("draft_model")


def parse_speculative_config(config: Any) -> SpeculativeConfig | None:
    """The checked config (None: no speculation); ValueError or TypeError naming the
    key and value that cannot be served."""
    if config is None:
        return None
    if not isinstance(config, dict):
        raise TypeError(f"speculative_config must be a dict, got {str(config)[:200]}")
    method = config.get("method")
    if method is None and "model" in config:  # as vLLM: a draft model by default
        method = "draft_model"
    if isinstance(method, str) and method in NOT_YET:
        raise ValueError(f"speculative_config.method={method!r} is not supported yet "
                         f"(supported: {', '.join(METHODS)})")
    if method not in METHODS:
        raise ValueError(f"speculative_config.method must be one of {', '.join(METHODS)}, "
                         f"got {str(method)[:80]!r}")
    keys = _KEYS[method]
    unknown = sorted(str(k)[:80] for k in config if k not in keys)
    if unknown:
        raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)} for "
                         f"method {method!r} (known: {', '.join(keys)})")
    k = config.get("num_speculative_tokens")
    check_int("speculative_config.num_speculative_tokens", k, minimum=1,
              maximum=MAX_SPECULATIVE_TOKENS)
    assert isinstance(k, int)
    given: dict[str, int | None] = {}
    for name in ("prompt_lookup_max", "prompt_lookup_min"):
        given[name] = config.get(name)
        check_int(f"speculative_config.{name}", given[name], minimum=1, maximum=MAX_LOOKUP,
                  allow_none=True)
    # Each defaults to the other, both to DEFAULT_LOOKUP.
    high = given["prompt_lookup_max"] or given["prompt_lookup_min"] or DEFAULT_LOOKUP
    low = given["prompt_lookup_min"] or given["prompt_lookup_max"] or DEFAULT_LOOKUP
    if low > high:
        raise ValueError(f"speculative_config: prompt_lookup_min={low} exceeds "
                         f"prompt_lookup_max={high}")
    disable = config.get("disable_by_batch_size")
    check_int("speculative_config.disable_by_batch_size", disable, minimum=1,
              maximum=2**31 - 1, allow_none=True)
    model = config.get("model")
    if method == "draft_model" and not (isinstance(model, str) and model.strip()):
        raise ValueError("speculative_config.model: method 'draft_model' needs the draft "
                         f"model's directory, got {str(model)[:200]!r}")
    return SpeculativeConfig(method=method, num_speculative_tokens=k, prompt_lookup_max=high,
                             prompt_lookup_min=low, disable_by_batch_size=disable,
                             model=model)
