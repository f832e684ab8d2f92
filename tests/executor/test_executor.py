"""The in-process executor (executor/executor.py: UniProcExecutor)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from pagellm import LLM

pytestmark = pytest.mark.own_code


def test_a_start_that_fails_leaves_no_default_process_group(model_dirs):
    """The worker's group of one goes with an engine that could not start: a process
    that outlives the failure (a notebook, a test suite, a trainer) would otherwise hold
    a default group no one owns, and libraries that ask `dist.is_initialized()` take
    their multi-process paths (compressed-tensors then shares tensors through torch's
    shm manager)."""
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="not enough memory for the KV cache"):
        LLM(str(model_dirs["llama"]), multiprocess=False, kv_cache_memory_bytes=2**16)
    assert not dist.is_initialized()
    with LLM(str(model_dirs["llama"]), multiprocess=False,
             kv_cache_memory_bytes=8 * 2**20) as llm:  # and one that starts still has one
        assert dist.is_initialized() and dist.get_world_size() == 1
        llm.generate("Hi", use_tqdm=False)
    assert not dist.is_initialized()
