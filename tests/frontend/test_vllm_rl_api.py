"""The vLLM calls RL frameworks make on `AsyncLLM` and `LLM` beyond generation, with
vLLM's keywords and meaning (vllm/v1/engine/async_llm.py): verl's
`pause_generation(wait_for_inflight_requests=..., clear_cache=...)` and OpenRLHF's
`mode="keep"`, `reset_prefix_cache(reset_running_requests, reset_connector)`,
`wait_for_requests_to_drain(drain_timeout)`, and `output_processor
.get_num_unfinished_requests()` / `.request_states`. Engines run in their own process.
References: whether a prompt run before finds its blocks in the prefix cache
(`num_cached_tokens`, whole blocks of the prompt, or 0), and the engine's own tokens
for the same request never paused.

The `AsyncLLM` tests share one engine (`shared`: started once per module, on an event
loop kept for the module): each test leaves it as it found it, unpaused with nothing in
flight and every KV block free, which `run` checks after each test (and restores, so
that one failure does not cascade). What the prefix cache holds is no test's
precondition: a test that needs a hit fills it first, one that needs a miss resets it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator

import psutil
import pytest
from conftest import PROMPTS

from pagellm import LLM, AsyncLLM, SamplingParams

# Our code and torch alone: the floors leg skips it (.ci/run).
pytestmark = pytest.mark.own_code

KV = 8 * 2**20
CACHED_PROMPT = PROMPTS[4]  # several 16-token blocks
ONE = SamplingParams(temperature=0.0, max_tokens=1)
# ~1 s here: still running when the call under test lands, on a slow CI too.
LONG = SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True)


async def _collect(engine: AsyncLLM, prompt, params, request_id, started=None):
    final = None
    async for out in engine.generate(prompt, params, request_id=request_id):
        final = out
        if started is not None:
            started.set()
    return final


async def _running(engine: AsyncLLM, prompt, params, request_id) -> asyncio.Task:
    """A request collected in the background, returned once its first token is out."""
    started = asyncio.Event()
    task = asyncio.create_task(_collect(engine, prompt, params, request_id, started))
    await asyncio.wait_for(started.wait(), 30)
    return task


async def _cached_tokens(engine: AsyncLLM, request_id: str) -> int:
    """Prompt tokens of CACHED_PROMPT found in the prefix cache (it is cached after)."""
    out = await _collect(engine, CACHED_PROMPT, ONE, request_id)
    assert out.num_cached_tokens is not None
    return out.num_cached_tokens


async def _leave_as_found(engine: AsyncLLM) -> None:
    """The state every test finds the shared engine in: unpaused, no request in flight
    here or in the engine core, every KV block free (make_llm's leak check). A test that
    left it otherwise fails, after the engine is put back for the tests after it."""
    paused = await engine.is_paused()
    left = sorted(engine.output_processor.request_states)
    if paused:
        await engine.resume_generation()
    if left:
        await engine.abort(left)
    await engine.wait_for_requests_to_drain(60)
    stats = await engine.get_stats()
    assert not paused, "the test left the engine paused"
    assert not left, f"the test left requests in flight: {left}"
    assert stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0, stats
    assert stats.num_free_blocks == stats.num_total_blocks, stats


def _close(loop: asyncio.AbstractEventLoop) -> None:
    """What asyncio.run does once its coroutine is done: cancel what is left, then
    close the loop."""
    try:
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.run_until_complete(loop.shutdown_default_executor())
    finally:
        loop.close()


@pytest.fixture(scope="module")
def shared(model_dirs) -> Iterator[tuple[asyncio.AbstractEventLoop, AsyncLLM]]:
    """One AsyncLLM (its engine core in a process) for the module's tests, with the
    event loop it runs in. At the end, the leak check (nothing in flight, every block
    free), and, once it is shut down, no process it started is left (as
    `no_leftover_processes` checks after a test)."""
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    started: list[psutil.Process] = []
    loop = asyncio.new_event_loop()

    async def start() -> AsyncLLM:
        return AsyncLLM(str(model_dirs["llama"]), kv_cache_memory_bytes=KV)

    async def shutdown(engine: AsyncLLM) -> None:
        engine.shutdown()

    try:
        engine = loop.run_until_complete(start())
        started = [p for p in me.children(recursive=True) if p.pid not in before]
        try:
            yield loop, engine
            loop.run_until_complete(_leave_as_found(engine))
        finally:
            loop.run_until_complete(shutdown(engine))
    finally:
        _close(loop)
        _, alive = psutil.wait_procs(started, timeout=15)
        for p in alive:
            p.kill()
        assert not alive, f"processes left behind: {[p.pid for p in alive]}"


@pytest.fixture
def run(shared) -> Iterator[Callable[[Callable[[AsyncLLM], Awaitable[None]]], None]]:
    """Run a test's coroutine with the module's AsyncLLM (its engine core in a process);
    after the test, check that it left the engine as it found it."""
    loop, engine = shared

    def run(main: Callable[[AsyncLLM], Awaitable[None]]) -> None:
        loop.run_until_complete(main(engine))

    yield run
    loop.run_until_complete(_leave_as_found(engine))


# --- pause_generation -----------------------------------------------------------------


def test_verls_pause_aborts_and_the_deprecated_spelling_waits(run):
    async def main(engine: AsyncLLM) -> None:
        task = await _running(engine, PROMPTS[1], LONG, "a")
        await engine.pause_generation(wait_for_inflight_requests=False, clear_cache=True)
        aborted = await asyncio.wait_for(task, 30)
        assert aborted.outputs[0].finish_reason == "abort"
        await engine.resume_generation()
        task = await _running(engine, PROMPTS[1], LONG, "w")
        with pytest.warns(DeprecationWarning, match="wait_for_inflight_requests"):
            await engine.pause_generation(wait_for_inflight_requests=True)
        assert await engine.is_paused()
        waited = await asyncio.wait_for(task, 30)
        assert waited.outputs[0].finish_reason == "length"
        assert len(waited.outputs[0].token_ids) == 1500
        await engine.resume_generation()  # as the next test expects it
    run(main)


def test_clear_cache_resets_the_prefix_cache_once_paused_and_keep_continues_the_same(run):
    """vLLM's default clear_cache=True: the cache is reset after the pause, the kept
    request preempted to let it go (it continues with the tokens it would have had);
    clear_cache=False keeps what was cached."""
    async def main(engine: AsyncLLM) -> None:
        reference = await _collect(engine, PROMPTS[2], LONG, "ref")
        await _cached_tokens(engine, "fill")
        assert await _cached_tokens(engine, "hit") > 0
        await engine.pause_generation(mode="abort", clear_cache=False)
        await engine.resume_generation()
        assert await _cached_tokens(engine, "kept") > 0
        preemptions = (await engine.get_stats()).num_preemptions
        task = await _running(engine, PROMPTS[2], LONG, "k")
        await engine.pause_generation(mode="keep")  # OpenRLHF's call; clear_cache=True
        assert not task.done()
        assert (await engine.get_stats()).num_preemptions == preemptions + 1
        await engine.resume_generation()
        kept = await asyncio.wait_for(task, 60)
        assert kept.outputs[0].token_ids == reference.outputs[0].token_ids
        assert await _cached_tokens(engine, "cleared") == 0
    run(main)


def test_pause_arguments_are_checked_by_name(run):
    async def main(engine: AsyncLLM) -> None:
        with pytest.raises(TypeError, match="clear_cache must be a bool, got str"):
            await engine.pause_generation(clear_cache="yes")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="wait_for_inflight_requests must be a bool"):
            await engine.pause_generation(wait_for_inflight_requests=1)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"wait_for_inflight_requests=True .* "
                                             r"contradicts mode='keep'"):
            await engine.pause_generation(mode="keep", wait_for_inflight_requests=True)
        assert not await engine.is_paused()
    run(main)


# --- reset_prefix_cache ---------------------------------------------------------------


def test_reset_running_requests_preempts_them_so_that_the_reset_happens(run):
    async def main(engine: AsyncLLM) -> None:
        reference = await _collect(engine, PROMPTS[3], LONG, "ref")
        await _cached_tokens(engine, "fill")
        task = await _running(engine, PROMPTS[3], LONG, "r")
        assert await engine.reset_prefix_cache() is False  # blocks are held: vLLM's rule
        assert await engine.reset_prefix_cache(reset_running_requests=True) is True
        running = await asyncio.wait_for(task, 60)
        assert running.outputs[0].token_ids == reference.outputs[0].token_ids
        assert await _cached_tokens(engine, "after") == 0
    run(main)


def test_reset_connector_without_a_connector_resets_the_cache_and_answers_false(run):
    """As vLLM's scheduler does when no KV connector is configured."""
    async def main(engine: AsyncLLM) -> None:
        await _cached_tokens(engine, "fill")
        assert await engine.reset_prefix_cache(reset_connector=True) is False
        assert await _cached_tokens(engine, "after") == 0
    run(main)


# --- wait_for_requests_to_drain and the output processor's counts ---------------------


def test_wait_for_requests_to_drain_returns_once_nothing_is_in_flight(run):
    async def main(engine: AsyncLLM) -> None:
        await engine.wait_for_requests_to_drain(drain_timeout=5)  # idle: at once
        task = await _running(engine, PROMPTS[1], LONG, "d")
        with pytest.raises(TimeoutError, match=r"did not drain within 0\.1 s \(this "
                                               r"frontend: 1 unfinished"):
            await engine.wait_for_requests_to_drain(drain_timeout=0.1)
        await engine.wait_for_requests_to_drain()
        assert engine.output_processor.get_num_unfinished_requests() == 0
        stats = await engine.get_stats()
        assert stats.num_running_reqs == stats.num_waiting_reqs == 0
        assert (await asyncio.wait_for(task, 5)).outputs[0].finish_reason == "length"
    run(main)


def test_a_request_kept_by_a_pause_is_in_flight_until_resumed(run):
    async def main(engine: AsyncLLM) -> None:
        task = await _running(engine, PROMPTS[1], LONG, "k")
        await engine.pause_generation(mode="keep", clear_cache=False)
        with pytest.raises(TimeoutError, match=r"did not drain within 0\.3 s \(this "
                                               r"frontend: 1 unfinished"):
            await engine.wait_for_requests_to_drain(0.3)
        await engine.resume_generation()
        await engine.wait_for_requests_to_drain(60)
        assert (await asyncio.wait_for(task, 5)).outputs[0].finish_reason == "length"
    run(main)


def test_drain_timeout_is_checked_by_name(run):
    async def main(engine: AsyncLLM) -> None:
        with pytest.raises(ValueError, match="drain_timeout must be >= 0"):
            await engine.wait_for_requests_to_drain(-1)
        with pytest.raises(TypeError, match="drain_timeout must be a number"):
            await engine.wait_for_requests_to_drain("300")  # type: ignore[arg-type]
    run(main)


def test_the_output_processor_counts_each_unfinished_request_once(run):
    async def main(engine: AsyncLLM) -> None:
        processor = engine.output_processor
        assert processor.get_num_unfinished_requests() == 0
        assert not processor.has_unfinished_requests()
        one = await _running(engine, PROMPTS[1], LONG, "one")
        two = await _running(engine, PROMPTS[2], SamplingParams(
            temperature=0.0, max_tokens=1500, ignore_eos=True, n=2), "two")
        assert processor.get_num_unfinished_requests() == 2  # n=2 is one request
        assert processor.has_unfinished_requests()
        assert sorted(processor.request_states) == ["one", "two"]  # verl lists these
        await engine.abort(["one", "two"])
        await asyncio.wait_for(asyncio.gather(one, two), 30)
        assert processor.get_num_unfinished_requests() == 0
    run(main)


# --- LLM ------------------------------------------------------------------------------


def test_llm_takes_the_same_keywords(model_dirs):
    def cached(llm: LLM) -> int:
        [out] = llm.generate([CACHED_PROMPT], ONE, use_tqdm=False)
        return out.num_cached_tokens

    with LLM(str(model_dirs["llama"]), kv_cache_memory_bytes=KV) as llm:
        cached(llm)
        llm.pause_generation("abort", clear_cache=False)  # mode by position, as before
        llm.resume_generation()
        assert cached(llm) > 0
        llm.pause_generation(wait_for_inflight_requests=False, clear_cache=True)
        assert llm.is_paused()
        llm.resume_generation()
        assert cached(llm) == 0
        assert llm.output_processor.get_num_unfinished_requests() == 0
        assert llm.reset_prefix_cache(reset_running_requests=True) is True
        assert cached(llm) == 0
        assert llm.reset_prefix_cache(reset_connector=True) is False
        assert cached(llm) == 0
        with pytest.raises(TypeError, match="clear_cache must be a bool"):
            llm.pause_generation(clear_cache=None)  # type: ignore[arg-type]
        assert not llm.is_paused()
