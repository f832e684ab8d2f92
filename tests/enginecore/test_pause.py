"""Pausing generation with requests in flight (AsyncLLM's pause_generation and sleep's
modes, over the engine core's pause): "abort" ends them, "wait" returns once they have
finished, "keep" freezes them in place and continues them with the same tokens as if
never paused, through a sleep that freed their KV cache too; a waiting pause resumed
before it settled says so. The reference is the engine's own tokens for the same
request, never paused."""

from __future__ import annotations

import asyncio

import pytest
from rl_helpers import PROMPTS

from pagellm import AsyncLLM, SamplingParams

# Our code and torch alone: the floors leg skips it (.ci/run).
pytestmark = pytest.mark.own_code


async def _collect(engine: AsyncLLM, prompt, params, request_id, started=None):
    final = None
    async for out in engine.generate(prompt, params, request_id=request_id):
        final = out
        if started is not None:
            started.set()
    return final


async def _running(engine: AsyncLLM, prompt, params, request_id) -> asyncio.Task:
    """A request collected in the background, returned once its first token is out: a
    fixed wait instead raced the engine, which may finish a short request in that time."""
    started = asyncio.Event()
    task = asyncio.create_task(_collect(engine, prompt, params, request_id, started))
    await asyncio.wait_for(started.wait(), 30)
    return task


def test_pause_in_each_mode_with_requests_in_flight(model_dirs):
    model_dir = model_dirs["llama"]
    # 1500 tokens (~1 s here): still running when each pause lands, on a slow CI too.
    long = SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True)

    async def main() -> None:
        engine = AsyncLLM(str(model_dir), kv_cache_memory_bytes=8 * 2**20)
        try:
            reference = await _collect(engine, PROMPTS[1], long, "ref")
            # abort: in-flight requests end now, with reason "abort"
            task = await _running(engine, PROMPTS[1], long, "a")
            await engine.pause_generation(mode="abort")
            aborted = await asyncio.wait_for(task, 30)
            assert aborted.outputs[0].finish_reason == "abort"
            assert len(aborted.outputs[0].token_ids) < 1500
            with pytest.raises(ValueError, match=r"paused.*resume_generation"):
                await _collect(engine, PROMPTS[0], long, "refused")
            await engine.resume_generation()
            # wait: the call returns when they are done, and they finish normally
            task = await _running(engine, PROMPTS[1], long, "w")
            await engine.pause_generation(mode="wait")  # returns once "w" has finished
            assert await engine.is_paused()
            waited = await asyncio.wait_for(task, 30)
            assert waited.outputs[0].finish_reason == "length"
            assert waited.outputs[0].token_ids == reference.outputs[0].token_ids
            await engine.resume_generation()
            # keep: frozen in place, then continued: the same tokens as never paused
            task = await _running(engine, PROMPTS[1], long, "k")
            await engine.pause_generation(mode="keep")
            late = asyncio.create_task(_collect(engine, PROMPTS[1], long, "late"))
            stats = await engine.get_stats()
            await asyncio.sleep(0.5)
            assert not task.done() and not late.done()
            assert (await engine.get_stats()).num_steps == stats.num_steps  # frozen
            await engine.resume_generation()
            kept, queued = await asyncio.wait_for(asyncio.gather(task, late), 60)
            assert kept.outputs[0].token_ids == reference.outputs[0].token_ids
            assert queued.outputs[0].token_ids == reference.outputs[0].token_ids
            stats = await engine.get_stats()
            assert stats.num_free_blocks == stats.num_total_blocks
        finally:
            engine.shutdown()

    asyncio.run(main())


def test_a_waiting_pause_that_is_resumed_before_it_settles_says_so(model_dirs):
    """Review 2: sleep(mode="wait") answered "sleeping" after a wake_up had resumed the
    engine meanwhile (nothing freed): a trainer acting on that answer could run out of
    memory. Both a waiting sleep and a waiting pause now fail, saying why."""
    long = SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True)

    async def main() -> None:
        engine = AsyncLLM(str(model_dirs["llama"]), kv_cache_memory_bytes=8 * 2**20,
                          enable_sleep_mode=True)
        try:
            for start in (lambda: engine.sleep(1, mode="wait"),
                          lambda: engine.pause_generation(mode="wait")):
                task = await _running(engine, PROMPTS[1], long, f"r{id(start)}")
                waiting = asyncio.create_task(start())
                await asyncio.sleep(0.2)
                assert not waiting.done()  # the request still runs
                await engine.wake_up()
                with pytest.raises(RuntimeError, match=r"resumed .* before the pause settled"):
                    await asyncio.wait_for(waiting, 60)
                assert not await engine.is_sleeping()
                assert (await asyncio.wait_for(task, 60)).outputs[0].finish_reason == "length"
        finally:
            engine.shutdown()

    asyncio.run(main())


def test_sleep_in_keep_mode_continues_the_requests_after_waking(model_dirs):
    """Their KV is freed with the cache: they recompute after waking, same tokens."""
    model_dir = model_dirs["llama"]
    long = SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True)

    async def main() -> None:
        engine = AsyncLLM(str(model_dir), enable_sleep_mode=True,
                          kv_cache_memory_bytes=8 * 2**20)
        try:
            reference = await _collect(engine, PROMPTS[2], long, "ref")
            task = await _running(engine, PROMPTS[2], long, "k")
            await engine.sleep(level=1, mode="keep")
            assert await engine.is_sleeping() and not task.done()
            assert await engine.wake_up() is True
            kept = await asyncio.wait_for(task, 60)
            assert kept.outputs[0].token_ids == reference.outputs[0].token_ids
        finally:
            engine.shutdown()

    asyncio.run(main())
