"""Chunked prefill, prefix caching, priorities and parallel sampling, end to end: the
tokens equal transformers' and the engine's own without chunking or caching."""

from __future__ import annotations

import asyncio

import pytest

from pagellm import AsyncLLM, RequestOutputKind, SamplingParams
from pagellm.protocol import EngineCoreRequest

# The floors leg skips these (.ci/run): our scheduler end to end.
pytestmark = pytest.mark.own_code


SYSTEM = ("You are a careful assistant. Answer briefly, cite nothing, and never make up "
          "facts about schedulers, caches or blocks. ") * 2
QUESTIONS = ["What is a block?", "Why chunk prompts?", "Who preempts whom?",
             "How big is a cache?", "When do requests finish?", "Where do tokens go?"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20)


def ids(llm, texts):
    return [llm.tokenizer.encode(t) for t in texts]


def test_shared_system_prompt_chunked_and_cached_equals_reference(model_dirs, hf_reference,
                                                                  make_llm):
    prompts = [SYSTEM + q for q in QUESTIONS]
    cached = make_llm(model_dirs["qwen3"], max_num_batched_tokens=32)
    plain = make_llm(model_dirs["qwen3"], enable_prefix_caching=False,
                     max_num_batched_tokens=2048)
    got = [o.outputs[0].token_ids for o in cached.generate(prompts, GREEDY, use_tqdm=False)]
    base = [o.outputs[0].token_ids for o in plain.generate(prompts, GREEDY, use_tqdm=False)]
    expected = [hf_reference("qwen3", p, 20) for p in ids(cached, prompts)]
    assert got == base == expected
    stats = cached.get_stats()
    assert stats.prefix_cache_hits > 0 and plain.get_stats().prefix_cache_hits == 0
    assert max(len(p) for p in ids(cached, prompts)) > 32  # prompts longer than a step


def test_the_same_prompt_twice_hits_exactly_its_full_blocks(model_dirs, hf_reference,
                                                            make_llm):
    llm = make_llm(model_dirs["llama"])
    prompt = SYSTEM + QUESTIONS[0]
    n = len(llm.tokenizer.encode(prompt))
    first = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    stats = llm.get_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (n, 0)
    second = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    stats = llm.get_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (2 * n, (n - 1) // 16 * 16)
    assert first == second == hf_reference("llama", llm.tokenizer.encode(prompt), 20)
    assert stats.kv_cache_usage == 0.0  # cached blocks are free blocks


def test_preemption_while_holding_cached_blocks_equals_reference(model_dirs, hf_reference,
                                                                 make_llm):
    probe = make_llm(model_dirs["qwen2"])
    per_block = probe.engine_core.core.executor.runner.kv_cache_bytes_per_block()
    llm = make_llm(model_dirs["qwen2"], kv_cache_memory_bytes=16 * per_block,
                   max_model_len=192)
    prompts = [SYSTEM + q for q in QUESTIONS]
    params = SamplingParams(temperature=0.0, max_tokens=40)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    stats = llm.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert got == [hf_reference("qwen2", p, 40) for p in ids(llm, prompts)]


def test_n_greedy_completions_are_identical_and_share_the_prompt(model_dirs, hf_reference,
                                                                 make_llm):
    llm = make_llm(model_dirs["llama"])
    prompt = SYSTEM + QUESTIONS[1]
    n = len(llm.tokenizer.encode(prompt))
    out = llm.generate(prompt, SamplingParams(n=3, temperature=0.0, max_tokens=20),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    expected = hf_reference("llama", llm.tokenizer.encode(prompt), 20)
    assert all(c.token_ids == expected for c in out.outputs)
    # Admitted in one step: the 2nd and 3rd children hit the 1st child's blocks.
    assert llm.get_stats().prefix_cache_hits == 2 * ((n - 1) // 16 * 16)


def test_n_seeded_completions_are_distinct_and_reproducible(model_dirs, make_llm):
    llm = make_llm(model_dirs["qwen2"])
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=16)
    first = llm.generate("tell me", params, use_tqdm=False)[0]
    again = llm.generate("tell me", params, use_tqdm=False)[0]
    streams = [c.token_ids for c in first.outputs]
    assert streams == [c.token_ids for c in again.outputs]
    assert len({tuple(s) for s in streams}) == 4
    # Completion i is exactly the n=1 request with seed + i.
    third = llm.generate("tell me", SamplingParams(temperature=1.0, seed=13, max_tokens=16),
                         use_tqdm=False)[0]
    assert third.outputs[0].token_ids == streams[2]


def test_priority_policy_serves_the_most_important_first(model_dirs, make_llm):
    llm = make_llm(model_dirs["llama"], scheduling_policy="priority", max_num_seqs=1)
    core = llm.engine_core.core
    params = SamplingParams(temperature=0.0, max_tokens=3)
    for rid, priority in (("low", 9), ("high", 0), ("mid", 4)):
        core.add_request(EngineCoreRequest(rid, [5, 6, 7], params, None, 0.0, priority))
    order: list[str] = []
    while core.has_work():
        for out in [o for by_client in core.step().values() for o in by_client.outputs]:
            if out.finished:
                order.append(out.request_id)
    assert order == ["high", "mid", "low"]


def test_priorities_flow_from_generate(model_dirs, make_llm):
    llm = make_llm(model_dirs["llama"], scheduling_policy="priority", max_num_seqs=1)
    outs = llm.generate(["a", "b"], GREEDY, use_tqdm=False, priority=[1, 0])
    assert all(o.finished for o in outs)
    with pytest.raises(ValueError, match="priorities"):
        llm.generate(["a", "b"], GREEDY, use_tqdm=False, priority=[1])


def test_reset_prefix_cache_across_processes(model_dirs):
    from pagellm import LLM

    prompt = SYSTEM + QUESTIONS[2]
    with LLM(str(model_dirs["llama"]), kv_cache_memory_bytes=8 * 2**20) as llm:
        llm.generate([prompt, prompt], GREEDY, use_tqdm=False)
        hits = llm.get_stats().prefix_cache_hits
        assert hits > 0
        assert llm.reset_prefix_cache() is True
        llm.generate(prompt, GREEDY, use_tqdm=False)
        assert llm.get_stats().prefix_cache_hits == hits  # nothing found after the reset

    engine = AsyncLLM(str(model_dirs["llama"]), kv_cache_memory_bytes=8 * 2**20)

    async def run():
        # Long enough to hold its blocks still when the reset arrives.
        long = SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True)
        stream = engine.generate(prompt, long, "held")
        await stream.__anext__()
        refused = await engine.reset_prefix_cache()  # blocks are held right now
        await stream.aclose()
        await asyncio.sleep(0.1)
        return refused, await engine.reset_prefix_cache()

    try:
        refused, accepted = asyncio.run(run())
    finally:
        engine.shutdown()
    assert (refused, accepted) == (False, True)


def test_n_streams_by_index_and_aborts_every_child(model_dirs, hf_reference):
    engine = AsyncLLM(str(model_dirs["qwen3"]), kv_cache_memory_bytes=8 * 2**20)
    prompt = QUESTIONS[3]

    async def run():
        delta = SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=12,
                               output_kind=RequestOutputKind.DELTA)
        pieces: dict[int, list[int]] = {0: [], 1: [], 2: []}
        last = None
        async for out in engine.generate(prompt, delta, "streamed"):
            assert len(out.outputs) == 1
            pieces[out.outputs[0].index] += out.outputs[0].token_ids
            last = out
        final = [o async for o in engine.generate(
            prompt, delta.clone(output_kind=RequestOutputKind.FINAL_ONLY), "final")]
        long = SamplingParams(n=4, temperature=0.0, max_tokens=1500, ignore_eos=True)
        aborted = engine.generate(prompt, long, "aborted")
        await aborted.__anext__()
        await engine.abort("aborted")
        tail = [out async for out in aborted]  # what was queued, then the abort
        assert tail[-1].finished
        assert {c.finish_reason for c in tail[-1].outputs} == {"abort"}
        await asyncio.sleep(0.1)
        return pieces, last, final, await engine.get_stats()

    try:
        pieces, last, final, stats = asyncio.run(run())
    finally:
        engine.shutdown()
    assert last is not None and last.finished
    assert len(final) == 1 and [c.index for c in final[0].outputs] == [0, 1, 2]
    assert [pieces[i] for i in range(3)] == [c.token_ids for c in final[0].outputs]
    assert stats.num_running_reqs == 0 and stats.num_free_blocks == stats.num_total_blocks
