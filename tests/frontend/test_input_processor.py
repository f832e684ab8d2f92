"""frontend/input_processor.py: what a request becomes before it reaches the engine
core (issue 12): n bounded by max_num_seqs, each completion's seed (seed + i, wrapped
within 64 bits), a priority bounded and refused where the policy would ignore it,
request ids bounded (and checked again by the engine core for foreign clients) and
scoped, so that a user's id never collides with the children of another request
(output_processor.py refuses an id in use), and a prompt too long for the model
refused before it is tokenized. References: the refusals' messages, the engine's own
reproducible tokens, and the ids AsyncLLM hands back."""

from __future__ import annotations

import asyncio

import pytest
from helpers import KV, request

from pagellm import AsyncLLM, SamplingParams
from pagellm.protocol.messages import FinishReason
from pagellm.protocol.validation import INT64_MAX

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def test_n_is_bounded_by_max_num_seqs(model_dirs, make_llm):
    """Finding 4: n=20000 stalled the server while it fanned out."""
    llm = make_llm(model_dirs["llama"], max_num_seqs=4)
    with pytest.raises(ValueError, match=r"n=5 is more than .*max_num_seqs=4"):
        llm.generate("hi", SamplingParams(n=5), use_tqdm=False)
    assert len(llm.generate("hi", SamplingParams(n=4), use_tqdm=False)[0].outputs) == 4


def test_seeds_of_completions_wrap_within_64_bits(model_dirs, make_llm):
    llm = make_llm(model_dirs["llama"])
    params = SamplingParams(n=3, seed=INT64_MAX - 1, temperature=1.0, max_tokens=6)
    first = [c.token_ids for c in llm.generate("x", params, use_tqdm=False)[0].outputs]
    again = [c.token_ids for c in llm.generate("x", params, use_tqdm=False)[0].outputs]
    assert first == again and len({tuple(t) for t in first}) == 3


def test_priority_is_bounded_to_64_bits(model_dirs, make_llm):
    llm = make_llm(model_dirs["llama"])
    with pytest.raises(ValueError, match="priority"):
        llm.generate(["a"], GREEDY, use_tqdm=False, priority=[2**63])
    # Under fcfs a priority would be silently ignored: refused, as vLLM does, naming
    # what would honour it; the engine serves the next request as usual.
    with pytest.raises(ValueError, match=r"priority=5 needs .*scheduling_policy='priority'.*"
                                         r"'fcfs'"):
        llm.generate(["a"], GREEDY, use_tqdm=False, priority=[5])
    assert llm.generate(["a"], GREEDY, use_tqdm=False, priority=[0])[0].outputs[0].token_ids


def test_request_ids_are_bounded(model_dirs, make_llm):
    """A request id travels in every output of its request (a 10 MB one was taken)."""
    from pagellm.protocol.messages import MAX_REQUEST_ID_CHARS

    llm = make_llm(model_dirs["llama"])
    for request_id in ("x" * 961, "x" * 10**7, ""):
        with pytest.raises(ValueError, match="request_id must be a non-empty string of at "
                                             "most 960 characters"):
            llm.input_processor.process_inputs(request_id, "hi", GREEDY)
    assert llm.input_processor.process_inputs("x" * 960, "hi", GREEDY).engine_requests
    # A foreign client's id is checked by the engine itself.
    core = llm.engine_core.core
    core.add_request(request("y" * (MAX_REQUEST_ID_CHARS + 1), [1, 2]))
    (failed,) = core.step()[0].outputs
    assert failed.finish_reason == FinishReason.ERROR
    assert f"longer than {MAX_REQUEST_ID_CHARS} characters" in failed.error
    assert llm.generate(["a"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_a_prompt_too_long_for_the_model_is_refused_before_it_is_tokenized(
        model_dirs, make_llm, monkeypatch):
    llm = make_llm(model_dirs["llama"])
    calls = []
    monkeypatch.setattr(llm.tokenizer, "encode", lambda *a, **k: calls.append(a) or [1])
    too_long = "a" * (llm.input_processor.max_prompt_chars + 1)
    with pytest.raises(ValueError, match=r"characters: more than max_model_len"):
        llm.generate(too_long, GREEDY, use_tqdm=False)
    assert calls == []


def test_user_ids_never_collide_with_the_children_of_another_request(model_dirs):
    """Finding 8: in AsyncLLM a user id "0_r1" collided with the first child of an n=2
    request "r1", which then never finished; the error leaked the scoped id "0:0_r1"."""
    engine = AsyncLLM(str(model_dirs["llama"]), kv_cache_memory_bytes=int(KV))

    async def collect(prompt, params, request_id):
        return [o async for o in engine.generate(prompt, params, request_id)][-1]

    async def run():
        two = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=8)
        return await asyncio.wait_for(asyncio.gather(
            collect("x", two, "r1"), collect("y", GREEDY, "0_r1"),
            collect("z", GREEDY, "1_r1"), collect("w", GREEDY, "r1-0")), 60)

    async def duplicate():
        long = SamplingParams(max_tokens=1500, ignore_eos=True)  # running at the second
        first = engine.generate("x", long, "dup")
        await first.__anext__()
        with pytest.raises(ValueError) as info:
            await engine.generate("y", long, "dup").__anext__()
        await first.aclose()
        return str(info.value)

    try:
        results = asyncio.run(run())
        message = asyncio.run(duplicate())
    finally:
        engine.shutdown()
    assert [r.request_id for r in results] == ["r1", "0_r1", "1_r1", "r1-0"]
    assert len(results[0].outputs) == 2 and all(r.finished for r in results)
    assert message == "request id 'dup' is already in use"
