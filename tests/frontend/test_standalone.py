"""A standalone engine core (`python -m pagellm.enginecore`) that frontends attach to."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq.auth
from conftest import PROMPTS
from helpers import ROOT, free_port, stop

from pagellm import LLM, EngineDeadError, SamplingParams

# Our code and torch alone: the floors leg skips it (.ci/run).
pytestmark = pytest.mark.own_code

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


def greedy_ids(llm: LLM, prompts: list[str]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_attach_detach_attach_gives_the_same_tokens(engine_at, model_dirs, hf_reference):
    engine, address = engine_at()
    with LLM(str(model_dirs["llama"]), engine_address=address) as llm:
        first = greedy_ids(llm, PROMPTS)
        assert llm.info.num_kv_blocks > 0 and llm.get_stats().num_running_reqs == 0
        expected = [hf_reference("llama", llm.tokenizer.encode(p), 16) for p in PROMPTS]
    assert engine.poll() is None  # a frontend leaving does not stop the engine core
    with LLM(str(model_dirs["llama"]), engine_address=address) as llm:
        assert greedy_ids(llm, PROMPTS) == first == expected
    assert stop(engine) == 0


def test_a_frontend_that_leaves_mid_generation_frees_its_blocks(engine_at, model_dirs):
    _, address = engine_at()
    first = LLM(str(model_dirs["llama"]), engine_address=address)
    request = first.input_processor.process_inputs(
        "left-behind", "x", SamplingParams(max_tokens=1500, ignore_eos=True))
    first.engine_core.add_request(request.engine_requests[0])
    first.shutdown()  # BYE: the engine aborts what this frontend left running
    with LLM(str(model_dirs["llama"]), engine_address=address) as second:
        deadline = time.monotonic() + 5
        while second.get_stats().num_running_reqs and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = second.get_stats()
        assert stats.num_running_reqs == 0 and stats.num_free_blocks == stats.num_total_blocks


def test_two_frontends_each_get_only_their_own_outputs(engine_at, model_dirs, hf_reference):
    _, address = engine_at()
    a = LLM(str(model_dirs["llama"]), engine_address=address)
    b = LLM(str(model_dirs["llama"]), engine_address=address)
    prompts = {"a": PROMPTS[:5], "b": PROMPTS[5:]}
    results: dict[str, list[list[int]]] = {}

    def run(name: str, llm: LLM) -> None:  # both number their requests 0, 1, 2, ...
        results[name] = greedy_ids(llm, prompts[name])

    threads = [threading.Thread(target=run, args=item) for item in (("a", a), ("b", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name, llm in (("a", a), ("b", b)):
        assert results[name] == [hf_reference("llama", llm.tokenizer.encode(p), 16)
                                 for p in prompts[name]]
    a.shutdown()
    b.shutdown()


def test_engine_options_are_refused_when_attaching(engine_at, model_dirs):
    _, address = engine_at()
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(str(model_dirs["llama"]), engine_address=address, max_model_len=64)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signals_stop_the_engine_core_gracefully(engine_at, model_dirs, sig):
    engine, address = engine_at(module="pagellm")  # `pagellm engine-core ...`
    with LLM(str(model_dirs["llama"]), engine_address=address) as llm:
        greedy_ids(llm, PROMPTS[:2])
        assert stop(engine, sig) == 0
        with pytest.raises(EngineDeadError, match="shut down"):
            greedy_ids(llm, PROMPTS[:2])


def test_a_killed_engine_is_noticed_from_the_socket_within_a_second(engine_at, model_dirs):
    engine, address = engine_at()
    with LLM(str(model_dirs["llama"]), engine_address=address) as llm:
        greedy_ids(llm, PROMPTS[:1])
        killed = time.monotonic()
        engine.kill()  # SIGKILL: no last word, but the connection drops
        engine.wait()
        with pytest.raises(EngineDeadError, match="lost the connection"):
            llm.generate(PROMPTS[:1], SamplingParams(max_tokens=1000, ignore_eos=True,
                                                     temperature=0), use_tqdm=False)
        assert time.monotonic() - killed < 1.5


def test_a_silently_hung_engine_is_noticed_by_its_heartbeat(engine_at, model_dirs,
                                                            monkeypatch):
    import pagellm.frontend.engine_client.mp_client

    monkeypatch.setattr(pagellm.frontend.engine_client.mp_client, "HEARTBEAT_TIMEOUT_S", 1.5)
    engine, address = engine_at()
    with LLM(str(model_dirs["llama"]), engine_address=address) as llm:
        greedy_ids(llm, PROMPTS[:1])
        engine.send_signal(signal.SIGSTOP)  # alive, connected, and silent
        try:
            with pytest.raises(EngineDeadError, match="no heartbeat"):
                llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4), use_tqdm=False)
        finally:
            engine.send_signal(signal.SIGCONT)


def test_a_stopped_launched_engine_is_noticed_and_killed(model_dirs, monkeypatch):
    """Review 2: a launched engine core (or one of several data-parallel cores) that
    stopped (SIGSTOP) hung every call forever: only its exit was watched. Its silence
    now kills it, and every waiter, sync or async, gets EngineDeadError."""
    import asyncio

    import psutil

    import pagellm.frontend.engine_client.mp_client
    from pagellm import AsyncLLM

    monkeypatch.setattr(pagellm.frontend.engine_client.mp_client, "HEARTBEAT_TIMEOUT_S", 1.5)
    dead = r"no heartbeat from the engine core .* for 2 s \(pid (\d+), killed\)"
    with LLM(str(model_dirs["llama"]), kv_cache_memory_bytes=8 * 2**20) as llm:
        greedy_ids(llm, PROMPTS[:1])
        process = psutil.Process(llm.engine_core.engine_process.pid)  # before it can go
        process.send_signal(signal.SIGSTOP)
        with pytest.raises(EngineDeadError, match=dead):
            llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4), use_tqdm=False)
        process.wait(timeout=10)

    async def main() -> None:
        engine = AsyncLLM(str(model_dirs["llama"]), kv_cache_memory_bytes=8 * 2**20)
        try:
            process = psutil.Process(engine.engine_core.engine_process.pid)
            process.send_signal(signal.SIGSTOP)
            with pytest.raises(EngineDeadError, match=dead):
                async for _ in engine.generate(PROMPTS[0], SamplingParams(max_tokens=4),
                                               "stopped"):
                    pass
            process.wait(timeout=10)
        finally:
            engine.shutdown()

    asyncio.run(main())


def test_bad_arguments_exit_non_zero_with_a_message(model_dirs, tmp_path):
    run = [sys.executable, "-m", "pagellm.enginecore"]
    result = subprocess.run([*run, "--model", str(model_dirs["llama"])], capture_output=True,
                            text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 2 and "--address" in result.stderr
    result = subprocess.run([*run, "--model", str(tmp_path / "nope"), "--address",
                             f"ipc://{tmp_path}/e"], capture_output=True, text=True, cwd=ROOT,
                            timeout=120)
    assert result.returncode == 1 and "model directory not found" in result.stderr


# --- CURVE ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("keys")
    for name in ("server", "client", "stranger"):
        zmq.auth.create_certificates(root, name)
    authorized = root / "authorized"
    authorized.mkdir()
    (authorized / "client.key").write_bytes((root / "client.key").read_bytes())
    return {"server_secret": root / "server.key_secret", "server_public": root / "server.key",
            "client": root / "client.key_secret", "stranger": root / "stranger.key_secret",
            "authorized": authorized}


def test_non_loopback_bind_needs_curve_keys(model_dirs):
    result = subprocess.run([sys.executable, "-m", "pagellm.enginecore", "--model",
                             str(model_dirs["llama"]), "--address",
                             f"tcp://0.0.0.0:{free_port()}"],
                            capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 1
    assert "refusing to bind" in result.stderr and "CURVE" in result.stderr


def test_curve_admits_the_right_key_and_refuses_a_wrong_one(engine_at, model_dirs, keys):
    port = free_port()
    engine, _ = engine_at("llama", f"tcp://0.0.0.0:{port}",
                          "--curve-secret-key", str(keys["server_secret"]),
                          "--curve-authorized-keys", str(keys["authorized"]))
    address = f"tcp://127.0.0.1:{port}"
    with LLM(str(model_dirs["llama"]), engine_address=address,
             curve_secret_key=str(keys["client"]),
             curve_server_public_key=str(keys["server_public"])) as llm:
        assert greedy_ids(llm, PROMPTS[:2])
    with pytest.raises(PermissionError, match="CURVE authentication"):
        LLM(str(model_dirs["llama"]), engine_address=address,
            curve_secret_key=str(keys["stranger"]),
            curve_server_public_key=str(keys["server_public"]))
    with pytest.raises(PermissionError, match="CURVE authentication"):
        LLM(str(model_dirs["llama"]), engine_address=address)  # no keys at all
    assert engine.poll() is None


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_attaching_where_nothing_listens_fails_within_seconds(model_dirs, tmp_path,
                                                              transport):
    """Issue 37: attaching to an address where nothing listens took 30-36 s before its
    error (the wait for an engine that accepts but does not answer)."""
    address = (f"tcp://127.0.0.1:{free_port()}" if transport == "tcp"
               else f"ipc://{tmp_path}/no-engine-here")
    start = time.monotonic()
    with pytest.raises(ConnectionRefusedError, match="nothing accepts connections at "
                       + re.escape(address)):
        LLM(str(model_dirs["llama"]), engine_address=address)
    assert time.monotonic() - start < 10


def test_cli_help_documents_the_address(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-m", "pagellm", "engine-core", "--help"],
                            capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0 and "--address" in result.stdout
    assert "--curve-secret-key" in result.stdout and "--max-model-len" in result.stdout


def test_async_llm_attaches_beside_a_sync_frontend(engine_at, model_dirs, hf_reference):
    import asyncio

    from pagellm import AsyncLLM

    _, address = engine_at()
    engine = AsyncLLM(str(model_dirs["llama"]), engine_address=address)
    llm = LLM(str(model_dirs["llama"]), engine_address=address)

    async def stream(i: int, prompt: str) -> list[int]:
        outs = [o async for o in engine.generate(prompt, GREEDY, str(i))]  # ids "0", "1"..
        return outs[-1].outputs[0].token_ids

    async def run() -> tuple[list[list[int]], list[list[int]]]:
        sync = asyncio.to_thread(greedy_ids, llm, PROMPTS[:3])  # also ids "0", "1", ...
        streams = asyncio.gather(*[stream(i, p) for i, p in enumerate(PROMPTS[3:6])])
        return await asyncio.gather(sync, streams)

    try:
        sync_ids, async_ids = asyncio.run(run())
        stats = asyncio.run(engine.get_stats())
    finally:
        engine.shutdown()
        llm.shutdown()
    expected = [hf_reference("llama", llm.tokenizer.encode(p), 16) for p in PROMPTS[:6]]
    assert sync_ids == expected[:3] and async_ids == expected[3:]
    assert stats.num_running_reqs == 0
