"""The engine core in its own process (enginecore/proc.py, __main__.py): three clients,
streaming, faults, shutdown (a SIGTERM drains what runs for at most --shutdown-timeout,
then the engine exits 0), nothing left behind (no orphaned engine core, no socket
directory or file, no ZeroMQ context that hangs at exit), and `pagellm engine-core
--model demo`."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
from conftest import PROMPTS
from helpers import ROOT, RawEngineClient, request, stop

from pagellm import LLM, AsyncLLM, EngineDeadError, RequestOutputKind, SamplingParams
from pagellm.frontend.output_processor import ProcessedRequest
from pagellm.protocol.messages import EngineCoreRequest, FinishReason, RequestType

# Our code and torch alone: the floors leg skips it (.ci/run).
pytestmark = pytest.mark.own_code

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
KV = 8 * 2**20


def wait_until(predicate, timeout=5.0, interval=0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def assert_all_free(stats):
    assert stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0, stats
    assert stats.num_free_blocks == stats.num_total_blocks, stats


@pytest.fixture(scope="module")
def async_llm(model_dirs):
    engine = AsyncLLM(str(model_dirs["llama"]), kv_cache_memory_bytes=KV)
    yield engine
    engine.shutdown()


async def collect(engine, prompt, params, request_id):
    return [out async for out in engine.generate(prompt, params, request_id)]


def test_three_clients_give_transformers_tokens(model_dirs, hf_reference, async_llm):
    expected = None
    results = {}
    for multiprocess in (False, True):
        with LLM(str(model_dirs["llama"]), kv_cache_memory_bytes=KV,
                 multiprocess=multiprocess) as llm:
            outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
            results[multiprocess] = [o.outputs[0].token_ids for o in outputs]
            assert_all_free(llm.get_stats())
            if expected is None:
                expected = [hf_reference("llama", llm.tokenizer.encode(p), 24) for p in PROMPTS]

    async def run_async():
        finals = await asyncio.gather(*[collect(async_llm, p, GREEDY, f"a{i}")
                                        for i, p in enumerate(PROMPTS)])
        return [f[-1].outputs[0].token_ids for f in finals]

    results["async"] = asyncio.run(run_async())
    assert results[False] == expected
    assert results[True] == expected
    assert results["async"] == expected


def test_delta_stream_concatenates_to_the_final_output(async_llm):
    # 300 tokens: enough steps that the stream arrives in several deltas even when
    # the frontend falls behind and one delta carries several steps.
    base = dict(temperature=0.8, seed=7, max_tokens=300, ignore_eos=True)

    async def run():
        delta = await collect(async_llm, "stream me",
                              SamplingParams(**base, output_kind=RequestOutputKind.DELTA), "d")
        final = await collect(async_llm, "stream me",
                              SamplingParams(**base, output_kind=RequestOutputKind.FINAL_ONLY),
                              "f")
        cumulative = await collect(async_llm, "stream me", SamplingParams(**base), "c")
        return delta, final, cumulative

    delta, final, cumulative = asyncio.run(run())
    assert len(final) == 1 and final[0].finished
    assert len(delta) > 1 and delta[-1].finished and not delta[0].finished
    tokens = [t for out in delta for t in out.outputs[0].token_ids]
    assert tokens == final[0].outputs[0].token_ids
    assert "".join(out.outputs[0].text for out in delta) == final[0].outputs[0].text
    for earlier, later in itertools.pairwise(cumulative):
        ids = later.outputs[0].token_ids
        assert ids[:len(earlier.outputs[0].token_ids)] == earlier.outputs[0].token_ids
    assert cumulative[-1].outputs[0].token_ids == final[0].outputs[0].token_ids


@pytest.mark.parametrize("how", ["cancel", "break", "abort"])
def test_leaving_a_stream_frees_its_blocks(async_llm, how):
    long = SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True)

    async def run():
        seen = []

        async def consume():
            async for out in async_llm.generate("a long story", long, f"long-{how}"):
                seen.append(out)
                if len(seen) == 3:
                    if how == "break":
                        break
                    if how == "abort":
                        await async_llm.abort(f"long-{how}")
        task = asyncio.create_task(consume())
        if how == "cancel":
            deadline = time.monotonic() + 30
            while len(seen) < 3:
                assert not task.done() and time.monotonic() < deadline
                await asyncio.sleep(0.01)
            task.cancel()
        with __import__("contextlib").suppress(asyncio.CancelledError):
            await task
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            stats = await async_llm.get_stats()
            if stats.num_running_reqs == 0 and stats.num_free_blocks == stats.num_total_blocks:
                break
            await asyncio.sleep(0.02)
        return seen, stats

    seen, stats = asyncio.run(run())
    assert_all_free(stats)
    if how == "abort":  # the stream ends with a final output saying so
        assert seen[-1].finished and seen[-1].outputs[0].finish_reason == "abort"
    assert len(seen[-1].outputs[0].token_ids) < 1500


def test_thousand_concurrent_streams(async_llm):
    params = SamplingParams(temperature=0.0, max_tokens=3)
    prompts = [f"prompt number {i % 10}" for i in range(1000)]

    async def run():
        finals = await asyncio.gather(*[collect(async_llm, p, params, f"many-{i}")
                                        for i, p in enumerate(prompts)])
        return finals, await async_llm.get_stats()

    finals, stats = asyncio.run(run())
    assert all(f[-1].finished for f in finals)
    by_prompt: dict[str, list[int]] = {}
    for prompt, f in zip(prompts, finals, strict=True):
        assert by_prompt.setdefault(prompt, f[-1].outputs[0].token_ids) == \
            f[-1].outputs[0].token_ids
    assert_all_free(stats)


def test_duplicate_request_id_is_rejected_while_running(async_llm):
    # Long enough to be running still when the second one arrives.
    long = SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True)

    async def run():
        first = async_llm.generate("x", long, "dup")
        await first.__anext__()
        with pytest.raises(ValueError, match="dup"):
            await async_llm.generate("y", long, "dup").__anext__()
        await first.aclose()

    asyncio.run(run())


def test_stop_string_aborts_the_request_in_the_engine(model_dirs):
    with LLM(str(model_dirs["llama"]), kv_cache_memory_bytes=KV) as llm:
        base = llm.generate("def f(x):", SamplingParams(temperature=0, max_tokens=60),
                            use_tqdm=False)[0].outputs[0]
        stop = base.text[10:13]
        out = llm.generate("def f(x):", SamplingParams(temperature=0, max_tokens=60,
                                                       stop=[stop]),
                           use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop" and out.text == base.text[:base.text.find(stop)]
        assert_all_free(llm.get_stats())  # the abort reached the engine before this call


# --- faults ---------------------------------------------------------------------------


def test_sigkill_mid_generation_fails_every_caller_within_a_second(model_dirs):
    engine = AsyncLLM(str(model_dirs["llama"]), kv_cache_memory_bytes=KV)
    long = SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True)
    pid = engine.engine_core.engine_process.pid
    started = set()

    async def stream(i):
        async for _ in engine.generate(f"prompt {i}", long, f"k{i}"):
            started.add(i)

    async def run():
        tasks = [asyncio.create_task(stream(i)) for i in range(8)]
        deadline = time.monotonic() + 30
        while len(started) < 8 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert len(started) == 8
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        elapsed = time.monotonic() - killed
        with pytest.raises(EngineDeadError, match="SIGKILL"):
            await collect(engine, "later", GREEDY, "later")
        with pytest.raises(EngineDeadError):
            await engine.get_stats()
        return results, elapsed

    try:
        results, elapsed = asyncio.run(run())
    finally:
        engine.shutdown()
    assert all(isinstance(r, EngineDeadError) for r in results), results
    assert "SIGKILL" in str(results[0])
    assert elapsed < 1.0


def test_sigkill_fails_a_blocked_llm_generate_within_a_second(model_dirs):
    llm = LLM(str(model_dirs["llama"]), kv_cache_memory_bytes=KV)
    errors: list[BaseException] = []
    done = threading.Event()

    def generate():
        try:
            llm.generate(["a", "b"], SamplingParams(max_tokens=1500, ignore_eos=True,
                                                    temperature=0),
                         use_tqdm=False)
        except BaseException as e:
            errors.append(e)
        done.set()

    thread = threading.Thread(target=generate)
    thread.start()
    try:
        assert wait_until(lambda: llm.get_stats().num_running_reqs == 2)
        killed = time.monotonic()
        os.kill(llm.engine_core.engine_process.pid, signal.SIGKILL)
        assert done.wait(5)
        elapsed = time.monotonic() - killed
    finally:  # a failed wait must not leave the engine and the thread behind
        llm.shutdown()
        thread.join(30)
    assert len(errors) == 1 and isinstance(errors[0], EngineDeadError), errors
    assert elapsed < 1.0


FAULTY_ENGINE = textwrap.dedent("""
    import sys
    from pagellm.enginecore.core import EngineCore

    real_step = EngineCore.step
    calls = 0

    def faulty_step(self):
        global calls
        calls += 1
        if calls == 5:
            raise RuntimeError("injected fault in the busy loop")
        return real_step(self)

    EngineCore.step = faulty_step
    from pagellm.enginecore.__main__ import main
    sys.exit(main(sys.argv[1:]))
""")


def test_exception_in_the_busy_loop_reaches_callers_by_name(model_dirs, tmp_path):
    address = f"ipc://{tmp_path}/faulty"
    engine = subprocess.Popen([sys.executable, "-c", FAULTY_ENGINE, "--model",
                               str(model_dirs["llama"]), "--kv-cache-memory-bytes", str(KV),
                               "--address", address])
    try:
        llm = LLM(str(model_dirs["llama"]), engine_address=address)
        with pytest.raises(EngineDeadError, match="injected fault in the busy loop"):
            llm.generate(["a", "b"], SamplingParams(max_tokens=50), use_tqdm=False)
        with pytest.raises(EngineDeadError, match="injected fault"):
            llm.get_stats()
        llm.shutdown()
        assert engine.wait(10) == 1
    finally:
        engine.kill()
        engine.wait()


def test_out_of_vocabulary_request_fails_alone(model_dirs, hf_reference):
    engine = AsyncLLM(str(model_dirs["qwen2"]), kv_cache_memory_bytes=KV)
    vocab = engine.info.vocab_size

    async def bad_stream():
        # Bypass the frontend's validation, as a client we did not write might.
        request = EngineCoreRequest("bad", [5, vocab + 5], GREEDY.clone(max_tokens=4), 0,
                                    time.time())
        collector = engine.output_processor.add_stream(
            ProcessedRequest("bad", None, request.prompt_token_ids, request.sampling_params,
                             [request]))
        engine.engine_core.add_request(request)
        item = await collector.get()
        assert isinstance(item, ValueError)
        raise item

    async def run():
        engine._ensure_output_handler()
        goods = [collect(engine, p, GREEDY, f"g{i}") for i, p in enumerate(PROMPTS[:4])]
        return await asyncio.gather(bad_stream(), *goods, return_exceptions=True)

    try:
        results = asyncio.run(run())
        stats = asyncio.run(engine.get_stats())
    finally:
        engine.shutdown()
    assert isinstance(results[0], ValueError) and "vocabulary" in str(results[0])
    for prompt, outs in zip(PROMPTS[:4], results[1:], strict=True):
        ids = engine.tokenizer.encode(prompt)
        assert outs[-1].outputs[0].token_ids == hf_reference("qwen2", ids, 24)
    assert_all_free(stats)


# --- start-up and shutdown ------------------------------------------------------------


def test_start_up_failure_in_the_engine_names_the_cause(model_dirs, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in model_dirs["llama"].iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    config = (broken / "config.json").read_text().replace("LlamaForCausalLM", "GPT9Model")
    (broken / "config.json").write_text(config)
    with pytest.raises(ValueError, match="engine core failed to start: unsupported "
                                         "architecture 'GPT9Model'"):
        LLM(str(broken))
    with pytest.raises(ValueError, match="not enough memory for the KV cache"):
        LLM(str(model_dirs["llama"]), kv_cache_memory_bytes=4096)


def test_shutdown_and_context_manager_leave_no_process(model_dirs):
    with LLM(str(model_dirs["llama"]), kv_cache_memory_bytes=KV) as llm:
        pid = llm.engine_core.engine_process.pid
        assert psutil.pid_exists(pid)
    assert not psutil.pid_exists(pid)
    engine = AsyncLLM(str(model_dirs["llama"]), kv_cache_memory_bytes=KV)
    pid = engine.engine_core.engine_process.pid
    engine.shutdown()
    assert not psutil.pid_exists(pid)


@pytest.mark.parametrize("exit_how", ["return", "sigkill"])
def test_frontend_exit_leaves_no_orphan(model_dirs, exit_how):
    script = textwrap.dedent(f"""
        import os, signal, sys
        from pagellm import LLM
        llm = LLM({str(model_dirs["llama"])!r}, kv_cache_memory_bytes={KV})
        print(llm.engine_core.engine_process.pid, flush=True)
        if {exit_how!r} == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    frontend = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              timeout=120, cwd=Path(__file__).parents[2])
    pid = int(frontend.stdout.split()[0])
    assert wait_until(lambda: not _alive(pid), timeout=15), f"engine core {pid} orphaned"


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_shutdown_wakes_a_generate_blocked_in_another_thread(model_dirs):
    """A generate left waiting (its caller's thread still blocked when a test failed and
    shut the LLM down) waited forever, and kept the process from exiting."""
    llm = LLM(str(model_dirs["llama"]), kv_cache_memory_bytes=KV)
    errors: list[BaseException] = []

    def generate() -> None:
        try:
            llm.generate(["a"], SamplingParams(max_tokens=1500, ignore_eos=True),
                         use_tqdm=False)
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=generate, daemon=True)
    thread.start()
    assert wait_until(lambda: llm.get_stats().num_running_reqs == 1)
    llm.shutdown()
    thread.join(10)
    assert not thread.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], EngineDeadError), errors


def test_async_shutdown_ends_every_open_stream_and_pending_call(model_dirs):
    """shutdown() with streams open and a pause in mode "wait" pending: each ends at
    once with EngineDeadError (they waited forever: the output handler was cancelled
    without failing its streams, and the client's pending calls were never woken); a
    generate afterwards says the engine was shut down."""
    engine = AsyncLLM(str(model_dirs["llama"]), kv_cache_memory_bytes=KV)
    long = SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True)
    started: set[int] = set()

    async def stream(i: int) -> None:
        async for _ in engine.generate(f"prompt {i}", long, f"s{i}"):
            started.add(i)

    async def run() -> tuple[list, Exception]:
        tasks = [asyncio.create_task(stream(i)) for i in range(3)]
        while len(started) < 3:
            await asyncio.sleep(0.01)
        tasks.append(asyncio.create_task(engine.pause_generation("wait")))
        await asyncio.sleep(0.3)  # the pause waits for the streams
        engine.shutdown()
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
        try:
            async for _ in engine.generate("late", GREEDY, "late"):
                pass
        except RuntimeError as e:
            return results, e
        raise AssertionError("a generate after shutdown ran")

    results, late = asyncio.run(run())
    assert all(isinstance(r, EngineDeadError) and "shut down" in str(r) for r in results), \
        results
    assert "this AsyncLLM has been shut down" in str(late)


def test_a_stream_left_after_its_request_finished_spares_a_new_request_with_its_id(
        model_dirs):
    """Stream A's request finishes in the engine while its consumer has not read the
    end; a new request reuses A's id (a service retrying a job); then A's consumer
    leaves. Its cleanup aborted the new request by name; now it leaves it alone."""
    engine = AsyncLLM(str(model_dirs["llama"]), kv_cache_memory_bytes=KV)
    delta = dict(temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def until(condition) -> None:
        """Poll with a deadline: a missed state fails here instead of hanging."""
        deadline = time.monotonic() + 60
        while not condition():
            assert time.monotonic() < deadline, "the state the test waits for never came"
            await asyncio.sleep(0.01)

    async def run() -> tuple[str | None, int]:
        first = engine.generate("a", SamplingParams(max_tokens=4, **delta), "job")
        await first.__anext__()
        await until(lambda: "job" not in engine.output_processor.requests)  # A finished

        async def second() -> tuple[str | None, int]:
            tokens, reason = 0, None
            async for out in engine.generate("b", SamplingParams(max_tokens=40, **delta),
                                             "job"):
                tokens += len(out.outputs[0].token_ids)
                reason = out.outputs[0].finish_reason
            return reason, tokens

        # Paused with "keep", the new request stays in flight while A's consumer leaves:
        # it finished in 40 quick steps before A's cleanup on a loaded machine (the
        # wait for it to appear then never ended).
        await engine.pause_generation(mode="keep", clear_cache=False)
        task = asyncio.create_task(second())
        await until(lambda: "job" in engine.output_processor.requests)
        await first.aclose()  # A's consumer leaves without its final output
        await engine.resume_generation()
        return await task

    try:
        assert asyncio.run(run()) == ("length", 40)
        assert_all_free(engine_stats(engine))
    finally:
        engine.shutdown()


def engine_stats(engine: AsyncLLM):
    return asyncio.run(engine.get_stats())


def test_sigterm_drains_for_at_most_the_shutdown_timeout(model_dirs, engine_at):
    """Finding 9: SIGTERM waited for every stream with no bound. The engine core now
    finishes what runs for up to --shutdown-timeout seconds, then aborts and exits 0."""
    # 0.3 s: well inside the ~1.5 s the 1900-token request runs on 2 CPU cores.
    engine, address = engine_at("llama", None, "--shutdown-timeout", "0.3")
    llm = LLM(str(model_dirs["llama"]), engine_address=address)
    try:
        processed = llm.input_processor.process_inputs(
            "endless", "x", SamplingParams(max_tokens=1900, ignore_eos=True, temperature=0))
        llm.output_processor.add_request(processed)
        llm.engine_core.add_request(processed.engine_requests[0])
        deadline = time.monotonic() + 30
        while llm.get_stats().num_running_reqs == 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        signalled = time.monotonic()
        engine.send_signal(signal.SIGTERM)
        assert engine.wait(15) == 0
        assert time.monotonic() - signalled < 6
        with pytest.raises(EngineDeadError, match="shut down"):
            llm._run(["endless"], use_tqdm=False)
    finally:
        llm.shutdown()


def test_sigterm_lets_a_short_request_finish(model_dirs, engine_at, hf_reference):
    engine, address = engine_at("llama", None, "--shutdown-timeout", "30")
    llm = LLM(str(model_dirs["llama"]), engine_address=address)
    try:
        # Short against the 30 s drain, long enough (~1 s) to be still running when
        # the signal lands: 40 tokens could finish before the first look at the stats.
        params = SamplingParams(max_tokens=400, ignore_eos=True, temperature=0)
        processed = llm.input_processor.process_inputs("short", PROMPTS[1], params)
        llm.output_processor.add_request(processed)
        llm.engine_core.add_request(processed.engine_requests[0])
        deadline = time.monotonic() + 30
        while llm.get_stats().num_running_reqs == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        engine.send_signal(signal.SIGTERM)
        (out,) = llm._run(["short"], use_tqdm=False)
        tokens = out.outputs[0].token_ids
        reference = hf_reference("llama", llm.tokenizer.encode(PROMPTS[1]), 400)
        # transformers stops at EOS; the request ignores it and runs to its length.
        assert len(tokens) == 400 and tokens[:len(reference)] == reference
        assert out.outputs[0].finish_reason == "length"
        assert engine.wait(15) == 0
        with pytest.raises((EngineDeadError, RuntimeError)):  # then it is gone
            llm.generate("more", GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()


def test_no_socket_directory_is_left_behind(model_dirs, tmp_path):
    """Finding 9: /tmp/pagellm-* stayed behind after a SIGKILL."""
    script = textwrap.dedent(f"""
        import os, signal, sys
        from pagellm import LLM
        llm = LLM({str(model_dirs["llama"])!r}, kv_cache_memory_bytes={KV})
        print(llm.engine_core.engine_process.pid, flush=True)
        print(len(os.listdir({str(tmp_path)!r})), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120, cwd=ROOT, env=env)
    pid, entries_while_running = map(int, result.stdout.split()[:2])
    assert entries_while_running == 0  # removed as soon as the sockets connected
    deadline = time.monotonic() + 15
    while _alive(pid):
        assert time.monotonic() < deadline, "engine core orphaned"
        time.sleep(0.05)
    assert list(tmp_path.iterdir()) == []


def test_a_process_that_exits_with_a_context_open_exits(tmp_path):
    """An engine core whose frontend died hung at interpreter exit for good (an orphan):
    the context it still held started a thread to terminate it, which never runs then."""
    script = textwrap.dedent(f"""
        import zmq
        from pagellm.transport.sockets import Context
        context = Context()
        server = context.socket(zmq.PULL)
        server.bind("ipc://{tmp_path}/socket")
        client = context.socket(zmq.PUSH)
        client.connect("ipc://{tmp_path}/socket")
        client.send(b"x")
        assert server.recv() == b"x"
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr


def test_engine_core_accepts_the_demo_model(tmp_path):
    """Finding 9: `pagellm engine-core --model demo` was refused."""
    address = f"ipc://{tmp_path}/demo-engine"
    env = {**os.environ, "PAGELLM_CACHE_DIR": str(tmp_path / "cache")}
    engine = subprocess.Popen([sys.executable, "-m", "pagellm", "engine-core", "--model",
                               "demo", "--kv-cache-memory-bytes", "32MiB", "--address",
                               address], cwd=ROOT, env=env)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "demo-engine").exists():
            assert engine.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        # Bound before it builds and loads the demo model: HELLO waits for both.
        client = RawEngineClient(address, hello_timeout_s=120)
        assert client.reply.info.model.endswith(tmp_path.joinpath("cache").name) or \
            "cache" in client.reply.info.model
        client.send(RequestType.ADD, request("d", [5, 6, 7]))
        assert client.finished("d").finish_reason == FinishReason.LENGTH
        client.close()
    finally:
        assert stop(engine) == 0
    assert not list(tmp_path.glob("demo-engine*"))  # socket files removed on exit
