"""Data parallelism: one frontend client, several engine cores (engine_client/dp_client.py).

Greedy tokens equal transformers' whatever core serves them; requests spread over the
cores; an abort reaches the core that holds the request; utility calls reach every core
and merge; one core's death is every caller's EngineDeadError naming it, and stops the
rest; engine cores of a second (headless) node attach over loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from conftest import PROMPTS
from helpers import NAME, ROOT, SUPPORT, Server, free_port

from pagellm import LLM, AsyncLLM, EngineDeadError, SamplingParams, StructuredOutputsParams
from pagellm.frontend.engine_client.dp_client import DPSyncClient
from pagellm.frontend.engine_client.dp_routing import Router, merge_results
from pagellm.protocol.messages import UtilityMethod

# Our code and torch alone: the floors leg skips it (.ci/run).
pytestmark = pytest.mark.own_code

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
LONG = SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True)
KV = 8 * 2**20


def wait_until(predicate: Any, timeout: float = 10.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def gone(pid: int) -> bool:
    """The process has exited (reaped or not)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def with_tests_on_path() -> str:
    """PYTHONPATH for engine processes that import tests/support/rl_extension.py (keeping what
    is there: it may point at the checkout under test)."""
    return os.pathsep.join(p for p in (str(SUPPORT), os.environ.get("PYTHONPATH")) if p)


@pytest.fixture(scope="module")
def dp_llm(model_dirs: dict[str, Path]) -> Iterator[LLM]:
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = with_tests_on_path()
    try:
        llm = LLM(str(model_dirs["llama"]), data_parallel_size=2, kv_cache_memory_bytes=KV,
                  worker_extension_cls="rl_extension.Probe")
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
    yield llm
    llm.shutdown()


def client_of(llm: LLM) -> DPSyncClient:
    assert isinstance(llm.engine_core, DPSyncClient)
    return llm.engine_core


def assert_all_free(llm: LLM) -> None:
    stats = llm.get_stats()
    assert len(stats.per_engine) == 2
    for s in [stats, *stats.per_engine]:
        assert s.num_running_reqs == 0 and s.num_waiting_reqs == 0, s
        assert s.num_free_blocks == s.num_total_blocks, s


def test_greedy_tokens_equal_transformers_and_both_cores_serve(dp_llm, hf_reference):
    client = client_of(dp_llm)
    before = list(client.requests_per_engine)
    steps_before = [s.num_steps for s in dp_llm.get_stats().per_engine]
    outputs = dp_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    expected = [hf_reference("llama", dp_llm.tokenizer.encode(p), 16) for p in PROMPTS]
    assert [o.outputs[0].token_ids for o in outputs] == expected
    routed = [a - b for a, b in zip(client.requests_per_engine, before, strict=True)]
    assert sum(routed) == len(PROMPTS) and min(routed) >= len(PROMPTS) // 2 - 1, routed
    stats = dp_llm.get_stats()
    assert all(s.num_steps > b for s, b in zip(stats.per_engine, steps_before, strict=True))
    assert stats.num_steps == sum(s.num_steps for s in stats.per_engine)
    assert stats.num_total_blocks == sum(s.num_total_blocks for s in stats.per_engine)
    assert client._owner == {}  # finished requests are forgotten
    assert_all_free(dp_llm)


def test_dp1_and_dp2_give_the_same_tokens_for_n_and_seeded_sampling(dp_llm, model_dirs):
    """...and for structured outputs: each engine core compiles its own grammars."""
    regex = r"[a-f]{2}-[0-9]{1,3}"
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=12, n=2) for i in range(6)]
    params += [SamplingParams(seed=i, max_tokens=12, n=2, structured_outputs=
                              StructuredOutputsParams(regex=regex)) for i in range(2)]
    prompts = PROMPTS[:8]
    dp2 = dp_llm.generate(prompts, params, use_tqdm=False)
    with LLM(str(model_dirs["llama"]), kv_cache_memory_bytes=KV) as llm:
        dp1 = llm.generate(prompts, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in dp2] == \
        [[c.token_ids for c in o.outputs] for o in dp1]
    assert all(re.fullmatch(regex, c.text) for o in dp2[6:] for c in o.outputs)
    assert_all_free(dp_llm)


def test_an_abort_reaches_the_core_that_holds_the_request(dp_llm):
    client = client_of(dp_llm)
    requests = [dp_llm.input_processor.process_inputs(f"abort-{i}", f"long prompt {i}", LONG)
                for i in range(2)]
    ids = []
    for processed in requests:
        for request in processed.engine_requests:
            client.add_request(request)
            ids.append(request.request_id)
    owners = [client.owner_of(i) for i in ids]
    assert sorted(owners) == [0, 1], owners  # two idle cores: one each

    def running() -> list[int]:
        return [s.num_running_reqs for s in dp_llm.get_stats().per_engine]

    assert wait_until(lambda: running() == [1, 1])
    on_one = ids[owners.index(1)]
    client.abort_requests([on_one])
    assert client.owner_of(on_one) is None
    assert wait_until(lambda: running() == [1, 0])
    per_engine = dp_llm.get_stats().per_engine
    assert per_engine[1].num_free_blocks == per_engine[1].num_total_blocks
    assert per_engine[0].num_free_blocks < per_engine[0].num_total_blocks
    client.abort_requests(ids)  # the finished one is ignored, the other stops
    assert wait_until(lambda: running() == [0, 0])
    time.sleep(0.2)
    while not client._outputs.empty():  # outputs of the aborted requests
        client._outputs.get_nowait()
    assert_all_free(dp_llm)


def test_utility_calls_reach_every_core_and_merge(dp_llm):
    client = client_of(dp_llm)
    assert (dp_llm.info.world_size, dp_llm.info.data_parallel_size) == (1, 2)

    def per_core(method: UtilityMethod) -> list[Any]:
        return [c.call_utility(method) for c in client.clients]

    dp_llm.pause_generation("keep")
    assert dp_llm.is_paused() and per_core(UtilityMethod.IS_PAUSED) == [True, True]
    dp_llm.resume_generation()
    assert not dp_llm.is_paused() and per_core(UtilityMethod.IS_PAUSED) == [False, False]
    client.clients[1].call_utility(UtilityMethod.PAUSE, "keep")  # one core only
    assert dp_llm.is_paused()  # not every core serves
    dp_llm.resume_generation()
    dp_llm.sleep(level=0)
    assert dp_llm.is_sleeping() and per_core(UtilityMethod.IS_SLEEPING) == [True, True]
    assert dp_llm.wake_up() is True
    assert not dp_llm.is_sleeping()
    assert dp_llm.reset_prefix_cache() is True
    results = dp_llm.collective_rpc("describe", args=("dp",), kwargs={"scale": 2.0})
    assert len(results) == 2 and results[0] == results[1]  # one per worker, every core
    checksums = dp_llm.collective_rpc("weight_checksum")
    assert len(checksums) == 2 and checksums[0] == checksums[1]
    with pytest.raises(RuntimeError, match=r"data-parallel rank 0.*fail"):
        dp_llm.collective_rpc("fail")
    assert merge_results(UtilityMethod.WAKE_UP, [True, False]) is False
    assert merge_results(UtilityMethod.UPDATE_WEIGHTS, [3, 3]) == 3
    assert_all_free(dp_llm)


@pytest.mark.slow
def test_a_trainer_broadcasts_weights_to_every_core(model_dirs, monkeypatch):
    """The "nccl" backend (gloo here) with two data-parallel cores, in vLLM's numbering:
    core d's worker r joins the trainer's group as rank_offset + d x tp + r, so each
    broadcast reaches both cores and both serve the new weights. A group too small for
    every worker is refused, naming the size it needs, before any worker joins."""
    from rl_helpers import NcclTrainer, hf_greedy, hf_model, perturbed

    monkeypatch.setenv("PYTHONPATH", with_tests_on_path())
    model_dir = model_dirs["llama"]
    init_info = {"master_address": "127.0.0.1", "master_port": free_port(),
                 "rank_offset": 1, "world_size": 3}
    with LLM(str(model_dir), data_parallel_size=2, kv_cache_memory_bytes=KV,
             weight_transfer_config={"backend": "nccl"},
             worker_extension_cls="rl_extension.Probe") as llm:
        with pytest.raises(RuntimeError, match=r"world_size=2 cannot hold this engine's 2 "
                                               r"worker\(s\) .* = 3"):
            llm.init_weight_transfer_engine({"init_info": {**init_info, "world_size": 2}})
        before = llm.collective_rpc("weight_checksum")
        with NcclTrainer(model_dir, init_info) as trainer:
            trainer.guard(client_of(llm).clients[0].engine_process.pid)  # all go with it
            trainer.push(llm, init_info)
            assert trainer.finish() == 0
        after = llm.collective_rpc("weight_checksum")
        assert before[0] == before[1] and after[0] == after[1] and after != before
        reference = hf_model(model_dir, perturbed(model_dir, seed=7))
        out = llm.generate(PROMPTS[:6], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in out] == [
            hf_greedy(reference, o.prompt_token_ids, GREEDY.max_tokens) for o in out]
        assert_all_free(llm)


def test_each_core_takes_the_gpus_after_those_of_the_cores_before_it(monkeypatch):
    """On CUDA, tensor-parallel rank r of data-parallel core d picks device
    (d - the node's first core) * tp + r among the devices it sees, whoever launched it
    (this node's frontend, a headless node, a supervisor): `device_for` is the one
    place, and the launcher leaves CUDA_VISIBLE_DEVICES as it found it (and, when the
    launch itself fails, no pipe behind)."""
    import torch

    from pagellm.executor.worker import worker
    from pagellm.frontend.engine_client.engine_process import EngineProcess
    from pagellm.protocol.engine_args import EngineArgs

    monkeypatch.setattr(worker, "resolve_device", lambda device: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    args = EngineArgs(model="demo", device="cuda", tensor_parallel_size=2,
                      data_parallel_size=2)
    picked = [[worker.device_for(args.replace(data_parallel_rank=d), r).index
               for r in (0, 1)] for d in (0, 1)]
    assert picked == [[0, 1], [2, 3]]
    headless = args.replace(data_parallel_size=4, data_parallel_start_rank=2,
                            data_parallel_rank=3)
    assert [worker.device_for(headless, r).index for r in (0, 1)] == [2, 3]
    with pytest.raises(ValueError, match="needs cuda:4, but this node has 4"):
        worker.device_for(args.replace(data_parallel_size=3, data_parallel_rank=2), 0)

    launched: list[dict[str, str]] = []

    class Stop(Exception):
        pass

    def popen(*_: Any, env: dict[str, str], **__: Any) -> None:
        launched.append(env)
        raise Stop

    monkeypatch.setattr(subprocess, "Popen", popen)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    fds = set(os.listdir("/proc/self/fd"))
    with pytest.raises(Stop):
        EngineProcess(args.replace(data_parallel_rank=1), num_local=2)
    assert launched[0]["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    assert set(os.listdir("/proc/self/fd")) == fds  # a launch that fails leaves no pipe


def test_router_prefers_the_cached_prefix_only_among_near_equal_loads():
    router = Router(block_size=4, capacities=[8, 8])
    from pagellm.protocol.messages import EngineCoreRequest

    def request(ids: list[int]) -> EngineCoreRequest:
        return EngineCoreRequest("r", ids, SamplingParams(max_tokens=1), None, 0.0)

    shared = list(range(12))
    hashes = router.hashes(request([*shared, 99]))
    assert len(hashes) == 3
    router.record(1, hashes)
    assert router.choose([0, 0], hashes) == 1  # equal loads: the cache decides
    assert router.choose([0, 1], hashes) == 1  # one request more buys the hit
    assert router.choose([0, 2], hashes) == 0  # two do not
    assert router.choose([20, 22], hashes) == 1  # 10% of the least load does
    other = router.hashes(request([7] * 12))  # cached nowhere: exact ties take turns
    assert {router.choose([0, 0], other), router.choose([0, 0], other)} == {0, 1}
    assert router.choose([3, 2], other) == 1
    router.record(0, router.hashes(request(list(range(100, 140)))))  # 10 blocks: LRU of 8
    assert len(router.indexes[0]) == 8
    router.prefix_aware = False
    assert router.hashes(request(shared)) == []
    assert router.choose([1, 0], []) == 1


def shared_prefix_rounds(llm: LLM, prefix_aware: bool, seed: int = 0) -> tuple[int, int]:
    """Groups of prompts that share a long prefix, one of each group per round in a
    shuffled order (as users of several system prompts would come); (hits, queries)
    of the prefix cache over every round but the first. A round sends its requests one
    at a time: every routing decision then sees settled loads, so the two rules are
    compared, not the timing of the cores' load reports (in a burst, within
    LOAD_SLACK_REQUESTS, that timing decided a tenth of the hits)."""
    client = client_of(llm)
    client.prefix_aware = prefix_aware
    assert llm.reset_prefix_cache()
    rng = random.Random(seed)
    groups = [[rng.randrange(10, 1000) for _ in range(96)] for _ in range(12)]
    params = SamplingParams(temperature=0.0, max_tokens=1)
    order = list(range(len(groups)))
    llm.generate([{"prompt_token_ids": [*g, 1]} for g in groups], params, use_tqdm=False)
    before = llm.get_stats()
    for round_ in range(3):
        rng.shuffle(order)
        for g in order:
            llm.generate({"prompt_token_ids": [*groups[g], 2, round_, g]}, params,
                         use_tqdm=False)
    after = llm.get_stats()
    client.prefix_aware = True
    return (after.prefix_cache_hits - before.prefix_cache_hits,
            after.prefix_cache_queries - before.prefix_cache_queries)


def test_prefix_aware_routing_raises_the_prefix_cache_hit_rate(dp_llm):
    least_loaded = shared_prefix_rounds(dp_llm, prefix_aware=False)
    prefix_aware = shared_prefix_rounds(dp_llm, prefix_aware=True)
    rates = [hits / queries for hits, queries in (least_loaded, prefix_aware)]
    print(f"\nprefix-cache hit rate: least loaded {rates[0]:.1%} {least_loaded}, "
          f"prefix aware {rates[1]:.1%} {prefix_aware}")
    assert rates[1] > rates[0] + 0.1
    # Prefix aware, every later request lands where its group's prefix is: each of the
    # 3 rounds x 12 groups hits all 6 full blocks of its 96-token prefix.
    assert prefix_aware[0] == 3 * 12 * 96
    assert_all_free(dp_llm)


async def final_tokens(engine: AsyncLLM, prompt: str, request_id: str,
                       params: SamplingParams = GREEDY) -> list[int]:
    outputs = [o async for o in engine.generate(prompt, params, request_id)]
    return outputs[-1].outputs[0].token_ids


@pytest.mark.slow
def test_async_llm_serves_from_both_cores_then_one_sigkill_fails_every_stream(
        model_dirs, hf_reference):
    """AsyncLLM with two cores: transformers' tokens, a cancelled stream frees its
    blocks on its core; then SIGKILL of one core fails every stream within a second,
    naming it, and the other core is stopped."""
    engine = AsyncLLM(str(model_dirs["llama"]), data_parallel_size=2,
                      kv_cache_memory_bytes=KV)
    clients = engine.engine_core.clients  # type: ignore[union-attr]
    pids = [c.engine_process.pid for c in clients]
    started: set[int] = set()

    async def serve_and_cancel() -> list[list[int]]:
        tokens = await asyncio.gather(*[final_tokens(engine, p, f"p{i}")
                                        for i, p in enumerate(PROMPTS)])
        # LONG: a 16-token request can finish before the first look at the stats.
        task = asyncio.create_task(final_tokens(engine, "cancel me", "cancelled", LONG))
        deadline = time.monotonic() + 30
        while (await engine.get_stats()).num_running_reqs == 0:
            assert not task.done() and time.monotonic() < deadline
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            stats = await engine.get_stats()
            if stats.num_running_reqs == 0 and stats.num_free_blocks == stats.num_total_blocks:
                break
            await asyncio.sleep(0.02)
        assert all(s.num_free_blocks == s.num_total_blocks for s in stats.per_engine), stats
        return tokens

    tokenizer = engine.tokenizer
    assert tokenizer is not None
    try:
        assert asyncio.run(serve_and_cancel()) == [
            hf_reference("llama", tokenizer.encode(p), 16) for p in PROMPTS]
        # Both cores served. Not an even split: prompts are tokenized off the event loop,
        # so a short request may finish (lowering its core's load) before the next is
        # routed. The exact split is checked below, with streams that stay running.
        assert min(engine.engine_core.requests_per_engine) >= 2  # type: ignore[union-attr]
    except BaseException:
        engine.shutdown()
        raise
    before = list(engine.engine_core.requests_per_engine)  # type: ignore[union-attr]

    async def stream(i: int) -> None:
        async for _ in engine.generate(f"prompt {i}", LONG, f"k{i}"):
            started.add(i)

    async def run() -> tuple[list[Any], float]:
        tasks = [asyncio.create_task(stream(i)) for i in range(6)]
        deadline = time.monotonic() + 60
        while len(started) < 6 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert len(started) == 6
        now = engine.engine_core.requests_per_engine  # type: ignore[union-attr]
        # Both cores hold streams. Not always 3 and 3: a load report computed before an
        # add reached its core can make that core look lighter for one step.
        routed = [a - b for a, b in zip(now, before, strict=True)]
        assert sum(routed) == 6 and min(routed) >= 2, routed
        killed = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        elapsed = time.monotonic() - killed
        with pytest.raises(EngineDeadError, match="data-parallel rank 1"):
            await engine.get_stats()
        return results, elapsed

    try:
        results, elapsed = asyncio.run(run())
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert all("data-parallel rank 1" in str(r) and "SIGKILL" in str(r)
                   for r in results), results
        assert elapsed < 1.0
        assert wait_until(lambda: gone(pids[0]))  # the other core was stopped
    finally:
        engine.shutdown()
    assert not any(psutil.pid_exists(pid) for pid in pids)


@pytest.mark.slow
def test_sigkill_of_one_core_fails_a_blocked_generate_within_a_second(model_dirs):
    llm = LLM(str(model_dirs["llama"]), data_parallel_size=2, kv_cache_memory_bytes=KV)
    client = client_of(llm)
    pids = [c.engine_process.pid for c in client.clients]  # type: ignore[union-attr]
    errors: list[BaseException] = []
    done = threading.Event()

    def generate() -> None:
        try:
            llm.generate(["a", "b", "c", "d"], LONG, use_tqdm=False)
        except BaseException as e:
            errors.append(e)
        done.set()

    thread = threading.Thread(target=generate)
    thread.start()
    try:
        assert wait_until(lambda: [s.num_running_reqs for s in llm.get_stats().per_engine]
                          == [2, 2], timeout=30)
        killed = time.monotonic()
        os.kill(pids[0], signal.SIGKILL)
        assert done.wait(5)
        elapsed = time.monotonic() - killed
        thread.join()
        assert len(errors) == 1 and isinstance(errors[0], EngineDeadError), errors
        assert "data-parallel rank 0" in str(errors[0]) and "SIGKILL" in str(errors[0])
        assert elapsed < 1.0
        with pytest.raises(EngineDeadError, match="data-parallel rank 0"):
            llm.get_stats()
        assert wait_until(lambda: gone(pids[1]))  # the other core was stopped
    finally:
        llm.shutdown()
    assert not any(psutil.pid_exists(pid) for pid in pids)


@pytest.mark.slow
def test_a_core_that_cannot_start_fails_the_start_and_leaves_nothing(model_dirs):
    with pytest.raises(ValueError, match="engine core failed to start"):
        LLM(str(model_dirs["llama"]), data_parallel_size=2, kv_cache_memory_bytes=KV,
            max_model_len=10**6)


def test_data_parallel_needs_engine_processes(model_dirs):
    with pytest.raises(ValueError, match="process of its own"):
        LLM(str(model_dirs["llama"]), data_parallel_size=2, multiprocess=False)
    with pytest.raises(ValueError, match="exceeds data_parallel_size"):
        LLM(str(model_dirs["llama"]), data_parallel_size=2, data_parallel_size_local=2,
            data_parallel_start_rank=1)


def _serve(model_dir: Path, *flags: str) -> subprocess.Popen:
    env = {**os.environ, "PAGELLM_LOG_LEVEL": "WARNING"}
    return subprocess.Popen([sys.executable, "-m", "pagellm", "serve", str(model_dir),
                             "--kv-cache-memory-bytes", "8MiB", *flags], cwd=ROOT, env=env)


def _stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def engine_metric(server: Server, name: str) -> dict[str, float]:
    """A per-engine-core metric from /metrics, by data-parallel rank."""
    text = server.get("/metrics")[1].decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            rank = line.split('engine="', 1)[1].split('"', 1)[0]
            values[rank] = float(line.rsplit(" ", 1)[1])
    return values


def headless_node(model_dir: Path, rpc_port: int) -> subprocess.Popen:
    """`pagellm serve --headless`: node 1 of two, data-parallel rank 1."""
    env = {**os.environ, "PAGELLM_LOG_LEVEL": "WARNING"}
    return subprocess.Popen(
        [sys.executable, "-m", "pagellm", "serve", str(model_dir), "-dp", "2",
         "--data-parallel-size-local", "1", "--data-parallel-start-rank", "1",
         "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(rpc_port),
         "--kv-cache-memory-bytes", "8MiB", "--headless"], cwd=ROOT, env=env)


def node_flags(rpc_port: int) -> list[str]:
    return ["-dp", "2", "--data-parallel-size-local", "1", "--data-parallel-address",
            "127.0.0.1", "--data-parallel-rpc-port", str(rpc_port)]


def engine_cores_of(proc: subprocess.Popen) -> list[psutil.Process]:
    return [c for c in psutil.Process(proc.pid).children(recursive=True)
            if "pagellm.enginecore" in " ".join(c.cmdline())]


@pytest.mark.slow
def test_two_nodes_on_loopback_serve_together_and_stop_together(model_dirs):
    """Node 1 (headless, rank 1) and node 0 (the API server with rank 0), each started
    by its own command: completions equal one engine's, both cores step, and the
    headless node stops its core once the server stops."""
    model_dir = model_dirs["llama"]
    rpc_port = free_port()
    node1 = headless_node(model_dir, rpc_port)
    server = None
    try:
        server = Server(model_dir, *node_flags(rpc_port))
        prompts = PROMPTS[:6]
        with LLM(str(model_dir), kv_cache_memory_bytes=KV, multiprocess=False) as reference:
            expected = [o.outputs[0].text for o in reference.generate(prompts, GREEDY,
                                                                       use_tqdm=False)]
        client = server.client()
        texts = [client.completions.create(model=NAME, prompt=p, max_tokens=16,
                                           temperature=0.0).choices[0].text for p in prompts]
        assert texts == expected
        steps = engine_metric(server, "pagellm:engine_num_steps")
        assert set(steps) == {"0", "1"} and min(steps.values()) > 0, steps
        cores = engine_cores_of(node1)
        assert len(cores) == 1
        assert server.stop() == 0
        server = None
        assert node1.wait(20) == 0  # the frontend left: the headless node stops
        assert not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in cores)
    finally:
        if server is not None:
            server.stop()
        _stop(node1)


@pytest.mark.slow
def test_a_remote_core_killed_fails_requests_and_stops_both_nodes(model_dirs):
    model_dir = model_dirs["llama"]
    rpc_port = free_port()
    node1 = headless_node(model_dir, rpc_port)
    server = None
    try:
        server = Server(model_dir, *node_flags(rpc_port))
        local_core = server.engine_pid()
        os.kill(engine_cores_of(node1)[0].pid, signal.SIGKILL)
        assert wait_until(lambda: server.get("/health")[0] == 503, timeout=2)
        status, body = server.post("/v1/completions", {"model": NAME, "prompt": "hi",
                                                       "max_tokens": 4})
        assert status >= 500 and "data-parallel rank 1" in json.dumps(body), body
        assert node1.wait(20) == 1  # its core failed
        assert wait_until(lambda: gone(local_core))  # node 0's core was stopped too
    finally:
        if server is not None:
            server.stop()
        _stop(node1)


def non_loopback_ipv4() -> str | None:
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == socket.AF_INET and not address.address.startswith("127."):
                return str(address.address)
    return None


@pytest.mark.slow
def test_two_nodes_on_a_network_address_need_curve_and_admit_only_the_engine_key(
        model_dirs, hf_reference, tmp_path):
    """A non-loopback --data-parallel-address: refused without keys on both sides; with
    them, a node registering with a key other than the engine cores' is refused, the
    right one serves, and the frontend's shutdown stops it."""
    import zmq.auth

    ip = non_loopback_ipv4()
    if ip is None:
        pytest.skip("no non-loopback IPv4 address on this machine")
    for name in ("frontend", "engine", "stranger"):
        zmq.auth.create_certificates(tmp_path, name)
    model_dir = model_dirs["llama"]
    rpc_port = free_port()
    common = dict(data_parallel_size=2, data_parallel_size_local=1,
                  data_parallel_address=ip, data_parallel_rpc_port=rpc_port,
                  kv_cache_memory_bytes=KV)
    with pytest.raises(ValueError, match="CURVE"):
        LLM(str(model_dir), **common)

    def node(key: str, *extra: str) -> subprocess.Popen:
        env = {**os.environ, "PAGELLM_LOG_LEVEL": "WARNING"}
        return subprocess.Popen(
            [sys.executable, "-m", "pagellm", "serve", str(model_dir), "-dp", "2",
             "--data-parallel-size-local", "1", "--data-parallel-start-rank", "1",
             "--data-parallel-address", ip, "--data-parallel-rpc-port", str(rpc_port),
             "--kv-cache-memory-bytes", "8MiB", "--headless", *(
                 ["--curve-secret-key", str(tmp_path / f"{key}.key_secret"),
                  "--curve-server-public-key", str(tmp_path / "frontend.key")]
                 if key else []), *extra], cwd=ROOT, env=env)

    keyless = node("")
    assert keyless.wait(60) == 2  # refused before it starts anything
    stranger = node("stranger")  # waits for the frontend to come up, then ...
    node1 = None
    try:
        node1 = node("engine")
        with LLM(str(model_dir), curve_secret_key=str(tmp_path / "frontend.key_secret"),
                 curve_server_public_key=str(tmp_path / "engine.key"), **common) as llm:
            assert stranger.wait(30) == 1  # ... its key is refused
            outputs = llm.generate(PROMPTS[:4], GREEDY, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outputs] == [
                hf_reference("llama", llm.tokenizer.encode(p), 16) for p in PROMPTS[:4]]
            assert client_of(llm).requests_per_engine == [2, 2]
            assert_all_free(llm)
        assert node1.wait(20) == 0
    finally:
        _stop(stranger)
        if node1 is not None:
            _stop(node1)


# -- the registration socket: bounded, and strict about what it takes ---------------------

def _register(port: int, ranks: list[int], addresses: list[str], timeout_ms: int = 5000
              ) -> str | None:
    """One registration on a fresh connection: the frontend's reply (its error)."""
    import msgspec
    import zmq

    from pagellm.protocol.messages import PROTOCOL_VERSION, DPRegister, DPRegisterReply

    context = zmq.Context()
    try:
        sock = context.socket(zmq.DEALER)
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send(msgspec.msgpack.encode(DPRegister(PROTOCOL_VERSION, ranks, addresses)))
        assert sock.poll(timeout_ms), "no reply to a registration"
        return msgspec.msgpack.decode(sock.recv(), type=DPRegisterReply).error
    finally:
        context.destroy(linger=0)


def _no_reply_to_oversized(port: int, size: int) -> bool:
    """Send `size` bytes to the registration socket: True if nothing came back (the
    connection was dropped unread) within a second."""
    import zmq

    context = zmq.Context()
    try:
        sock = context.socket(zmq.DEALER)
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send(b"\x93" + b"x" * size)
        return not sock.poll(1000)
    finally:
        context.destroy(linger=0)


def _listener() -> socket.socket:
    """A bound, listening TCP socket: where a genuine engine core would be."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def test_the_registration_socket_drops_oversized_messages_and_refuses_bad_addresses():
    """Without loading anything: a message larger than any DPRegister is dropped unread;
    malformed addresses, out-of-range ports, overlong hosts, dead ports and a rank given
    twice are refused with a reply saying why (echoing a bounded prefix at most), and
    the rank stays open for the genuine node, whose registration ends the wait."""
    from pagellm.frontend.engine_client.dp_registration import (
        RegistrationListener,
        max_registration_bytes,
    )
    from pagellm.protocol.engine_args import EngineArgs

    port = free_port()
    listener = RegistrationListener(EngineArgs(
        model="demo", data_parallel_size=2, data_parallel_size_local=1,
        data_parallel_address="127.0.0.1", data_parallel_rpc_port=port), None)
    result: dict[str, Any] = {}

    def wait() -> None:
        try:
            result["found"] = listener.wait([1], {})
        except BaseException as e:  # reported below
            result["error"] = e

    waiter = threading.Thread(target=wait, daemon=True)
    genuine, other = _listener(), _listener()
    address = f"tcp://127.0.0.1:{genuine.getsockname()[1]}"
    waiter.start()
    try:
        assert max_registration_bytes(2) < 4096
        assert _no_reply_to_oversized(port, 2**20)
        long_host = "h" * 300
        cases = {
            "tcp://nonsense": "not a tcp://HOST:PORT",
            "tcp://127.0.0.1:70000": "out of range",
            "tcp://127.0.0.1:0": "out of range",
            "ipc:///tmp/x": "not a tcp://HOST:PORT",
            "tcp://*:5555": "not a tcp://HOST:PORT",
            f"tcp://{long_host}:5555": "not a tcp://HOST:PORT",
            f"tcp://127.0.0.1:{free_port()}": "nothing accepts connections",
        }
        for bad, why in cases.items():
            error = _register(port, [1], [bad])
            assert error is not None and why in error, (bad, error)
            assert len(error) < 250, error  # a bounded prefix of the address at most
        other_address = f"tcp://127.0.0.1:{other.getsockname()[1]}"
        error = _register(port, [1, 1], [other_address, address])
        assert error is not None and "twice" in error, error
        assert waiter.is_alive() and not result  # still waiting for rank 1
        assert _register(port, [1], [address]) is None  # the genuine node
        waiter.join(10)
        assert result == {"found": {1: address}}, result
    finally:
        if waiter.is_alive():  # a failure above: end the wait
            with contextlib.suppress(Exception):
                _register(port, [1], [address], timeout_ms=1000)
            waiter.join(10)
        listener.close()
        genuine.close()
        other.close()


@pytest.mark.slow
def test_a_frontend_waiting_for_a_node_survives_oversized_and_bogus_registrations(
        model_dirs):
    """The frontend is waiting for rank 1: an oversized message and a bogus address
    (which used to kill the start-up) are refused, and the genuine headless node then
    registers and serves."""
    model_dir = model_dirs["llama"]
    rpc_port = free_port()
    started: dict[str, Any] = {}

    def start() -> None:
        try:
            started["llm"] = LLM(str(model_dir), data_parallel_size=2,
                                 data_parallel_size_local=1,
                                 data_parallel_address="127.0.0.1",
                                 data_parallel_rpc_port=rpc_port, kv_cache_memory_bytes=KV)
        except BaseException as e:  # reported below
            started["error"] = e

    frontend = threading.Thread(target=start, daemon=True)
    frontend.start()
    node1 = None
    try:
        assert wait_until(lambda: _port_open(rpc_port), timeout=60)
        assert _no_reply_to_oversized(rpc_port, 2**20)
        error = _register(rpc_port, [1], ["tcp://nonsense"])
        assert error is not None and "not a tcp://HOST:PORT" in error
        node1 = headless_node(model_dir, rpc_port)
        frontend.join(120)
        assert "llm" in started, started
        outputs = started["llm"].generate(PROMPTS[:2], GREEDY, use_tqdm=False)
        assert all(o.outputs[0].token_ids for o in outputs)
        assert client_of(started["llm"]).requests_per_engine == [1, 1]
    finally:
        if node1 is None and frontend.is_alive():  # a failure above: end its start-up
            for core in psutil.Process().children(recursive=True):
                if "pagellm.enginecore" in " ".join(core.cmdline()):
                    core.kill()  # the frontend sees its local core die and stops
        frontend.join(120)
        if "llm" in started:
            started["llm"].shutdown()
        if node1 is not None:
            _stop(node1)


def _port_open(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
        return True
    return False
