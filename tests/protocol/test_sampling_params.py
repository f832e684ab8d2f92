"""protocol/sampling_params.py: every value a client sends is bounded where it enters
(issue 12). Each integer by what it lands in (int32 or int64), each float finite and
within float32, token-id lists, stop strings, bad words and logit_bias by their length
and their ids; what depends on the model (the vocabulary) is checked when a request is
processed, and an in-range top_k beyond the vocabulary means all of it (the worker's
input batch clamps it). References: the bounds of protocol/validation.py, msgpack round
trips, and the engine's own seeded tokens."""

from __future__ import annotations

import msgspec
import pytest

from pagellm import SamplingParams
from pagellm.protocol.validation import FLOAT32_MAX, INT32_MAX, INT64_MAX, INT64_MIN

INT_FIELDS = {  # field: (smallest allowed, largest allowed)
    "n": (1, INT32_MAX), "top_k": (-1, INT32_MAX), "seed": (INT64_MIN, INT64_MAX),
    "max_tokens": (1, INT32_MAX), "min_tokens": (0, INT32_MAX), "logprobs": (-1, INT32_MAX),
    "prompt_logprobs": (-1, INT32_MAX), "truncate_prompt_tokens": (1, INT32_MAX),
}


@pytest.mark.parametrize("name", sorted(INT_FIELDS))
def test_every_sampling_integer_is_bounded_by_its_destination(name):
    low, high = INT_FIELDS[name]
    extra = {"max_tokens": None} if name == "min_tokens" else {}
    for value in (low, high):
        params = SamplingParams(**{name: value, **extra})  # the bounds themselves pass...
        decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
        assert getattr(decoded, name) == value  # ...and survive the wire
    for value in (low - 1, high + 1, 2**64, -(2**70)):
        if name == "truncate_prompt_tokens" and value == low - 1:
            continue  # 0 is refused, -1 means "as many as the model takes"
        with pytest.raises(ValueError, match=rf"{name} must be .*allowed: \[{low}, {high}\]"):
            SamplingParams(**{name: value, **extra})


@pytest.mark.parametrize("name, value", [
    ("temperature", 10**400), ("temperature", 1e39), ("top_p", 2**80), ("min_p", -(10**400)),
    ("presence_penalty", 10**30), ("repetition_penalty", float("nan")),
])
def test_every_sampling_float_is_finite_and_bounded(name, value):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})
    assert SamplingParams(temperature=FLOAT32_MAX).temperature == FLOAT32_MAX


def test_token_id_lists_and_biases_are_bounded():
    for kwargs in ({"stop_token_ids": [2**40]}, {"allowed_token_ids": [2**31]},
                   {"logit_bias": {2**31: 1.0}}):
        with pytest.raises(ValueError, match="must be <= 2147483647"):
            SamplingParams(**kwargs)


def test_lists_a_client_sends_are_bounded(model_dirs, make_llm):
    """Stop strings are searched and bad words tokenized per request, token-id lists
    gathered every step: their lengths are work a client could otherwise inflate."""
    with pytest.raises(ValueError, match="stop has 1025 entries, more than 1024"):
        SamplingParams(stop=["x"] * 1025)
    with pytest.raises(ValueError, match="bad_words has 1025 entries"):
        SamplingParams(bad_words=["x"] * 1025)
    # Counted before any entry is checked (the server checks them on its event loop).
    too_many = 2**20 + 1
    for kwargs in ({"stop_token_ids": [1] * too_many}, {"allowed_token_ids": [1] * too_many},
                   {"logit_bias": dict.fromkeys(range(too_many), 1.0)}):
        with pytest.raises(ValueError, match=f"has {too_many} entries, more than 1048576"):
            SamplingParams(**kwargs)
    llm = make_llm(model_dirs["llama"])
    vocab = llm.info.vocab_size
    for kwargs, message in (({"allowed_token_ids": [1] * (vocab + 1)}, "allowed_token_ids"),
                            ({"stop_token_ids": [2] * (vocab + 1)}, "stop_token_ids")):
        with pytest.raises(ValueError, match=f"{message} has {vocab + 1} entries"):
            llm.generate("hi", SamplingParams(**kwargs), use_tqdm=False)


def test_top_k_beyond_the_vocabulary_means_all_of_it(model_dirs, make_llm):
    """Finding 1: top_k=2**63 overflowed an int64 array in the engine loop. Now it is
    refused where it enters, and any top_k the int32 bound admits is clamped."""
    llm = make_llm(model_dirs["llama"])
    with pytest.raises(ValueError, match="top_k"):
        llm.generate("hi", SamplingParams(top_k=2**63, temperature=0.5), use_tqdm=False)
    sampled = {}
    for top_k in (0, llm.info.vocab_size, INT32_MAX):
        params = SamplingParams(top_k=top_k, temperature=0.9, seed=11, max_tokens=10)
        sampled[top_k] = llm.generate("hi", params, use_tqdm=False)[0].outputs[0].token_ids
    assert sampled[0] == sampled[llm.info.vocab_size] == sampled[INT32_MAX]
