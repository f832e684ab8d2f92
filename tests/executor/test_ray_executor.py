"""executor/ray_executor.py: tensor-parallel workers as Ray actors, on a local Ray
cluster on loopback (tests/support/ray_cluster.py, owned by the test). The reference:
the multiprocess executor's tokens on the same model. A killed actor is an
EngineDeadError naming its rank; an engine started inside a placement group (as
OpenRLHF's and verl's are) places its workers in it (each actor reports its group), at
the bundles VLLM_RAY_BUNDLE_INDICES names (a list of the wrong length is refused). The
engine's own placement group (none given) is the CLI path, tested by hand."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest
from helpers import SUPPORT
from rl_helpers import greedy

from pagellm import LLM, EngineDeadError

pytest.importorskip("ray", reason="the Ray executor's tests need pagellm[ray]")

KV = 8 * 2**20


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[tuple[str, str, str]]:
    """(address, placement group id, auth mode) of a cluster this test module owns."""
    proc = subprocess.Popen([sys.executable, str(SUPPORT / "ray_cluster.py")],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().split()
        assert len(line) == 3, "the Ray cluster did not start"
        yield line[0], line[1], line[2]
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def on_cluster(ray_cluster, monkeypatch) -> tuple[str, str, str]:
    monkeypatch.setenv("RAY_ADDRESS", ray_cluster[0])
    if ray_cluster[2] == "token":  # a client of a token cluster says so, as users' do
        monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("PYTHONPATH", str(SUPPORT))  # the actors import rl_extension
    return ray_cluster


def test_ray_workers_in_a_placement_group_give_the_mp_tokens_and_a_dead_one_is_named(
        model_dirs, on_cluster, monkeypatch):
    """Started inside a placement group (as OpenRLHF's and verl's engines are), at the
    bundles VLLM_RAY_BUNDLE_INDICES names: every actor reports that group, the tokens
    are the multiprocess executor's, and a killed actor is an EngineDeadError naming
    its rank."""
    _, group, _ = on_cluster
    model_dir = str(model_dirs["llama"])
    with LLM(model_dir, tensor_parallel_size=2, kv_cache_memory_bytes=KV) as llm:
        expected = greedy(llm)
    monkeypatch.setenv("PAGELLM_RAY_PLACEMENT_GROUP", group)
    monkeypatch.setenv("VLLM_RAY_BUNDLE_INDICES", "2,0")
    with LLM(model_dir, tensor_parallel_size=2, kv_cache_memory_bytes=KV,
             distributed_executor_backend="ray",
             worker_extension_cls="rl_extension.Probe") as llm:
        assert greedy(llm) == expected
        assert llm.collective_rpc("ray_placement_group") == [group, group]
        pids = llm.collective_rpc("pid")
        assert len(set(pids)) == 2 and os.getpid() not in pids
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(EngineDeadError, match=r"tensor-parallel rank 1 \(Ray actor\)"):
            for _ in range(100):  # noticed within a poll interval, or by the next step
                greedy(llm)


def test_bundle_indices_must_name_one_bundle_per_rank(model_dirs, on_cluster,
                                                      monkeypatch):
    monkeypatch.setenv("PAGELLM_RAY_PLACEMENT_GROUP", on_cluster[1])
    monkeypatch.setenv("VLLM_RAY_BUNDLE_INDICES", "1")
    with pytest.raises(Exception, match="must name 2 distinct bundles"):
        LLM(str(model_dirs["llama"]), tensor_parallel_size=2, kv_cache_memory_bytes=KV,
            distributed_executor_backend="ray")
