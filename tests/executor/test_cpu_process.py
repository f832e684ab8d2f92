"""The CPU engine process's settings, read from inside it (a worker extension): every
usable core, subnormal floats flushed in every thread of its pool (with one thread
that kept them the engine decoded 3.6 tokens/s instead of 14.6: BENCHMARKS.md), and a
frozen start-up heap in every rank's process."""

from __future__ import annotations

import os

import pytest
from helpers import SUPPORT

from pagellm import LLM

# Our code and torch alone: the floors leg skips it (.ci/run).
pytestmark = pytest.mark.own_code


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_a_launched_cpu_engine_uses_every_core_and_flushes_subnormals_everywhere(
        model_dirs, monkeypatch, tensor_parallel_size):
    monkeypatch.setenv("PYTHONPATH", str(SUPPORT))  # the engine imports rl_extension
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    with LLM(str(model_dirs["llama"]), worker_extension_cls="rl_extension.Probe",
             kv_cache_memory_bytes=8 * 2**20,
             tensor_parallel_size=tensor_parallel_size) as llm:
        settings = llm.collective_rpc("cpu_settings")
    cores = len(os.sched_getaffinity(0))
    assert [s["subnormals_kept"] for s in settings] == [0.0] * tensor_parallel_size
    # Tensor-parallel ranks share the cores; one engine has them all.
    assert [s["threads"] for s in settings] == \
        [max(1, cores // tensor_parallel_size)] * tensor_parallel_size
    # Every rank's start-up heap (torch alone: 160 000+ objects) is out of the
    # collector's reach: a full collection walking it stalls the step ~0.2 s, and a
    # tensor-parallel step waits for its slowest rank.
    assert all(s["frozen_objects"] > 100_000 for s in settings), settings


def _subnormals_survive() -> bool:
    """Whether this process's floats keep subnormals: 1e-39 is one (normals start at
    1.2e-38), flushed to zero where denormals-are-zero is set."""
    import torch

    return bool(torch.tensor([1e-39], dtype=torch.float32).item() != 0.0)


def test_an_in_process_engine_leaves_the_host_process_floats_alone(model_dirs):
    """Flushing subnormals is process-wide: an engine embedded in a user's process
    (multiprocess=False) must not change the arithmetic of every other library there
    (hypothesis, numpy, the user's own code)."""
    assert _subnormals_survive()
    with LLM(str(model_dirs["llama"]), multiprocess=False,
             kv_cache_memory_bytes=8 * 2**20) as llm:
        assert llm.generate([{"prompt_token_ids": [1, 2, 3]}])[0].outputs[0].token_ids
        assert _subnormals_survive()
    assert _subnormals_survive()
