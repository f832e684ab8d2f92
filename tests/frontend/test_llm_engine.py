"""`LLM.llm_engine` (frontend/llm_engine.py) and where the engine core runs for vLLM's
executor backends: the path TRL's colocate mode loads weights through
(`llm_engine.model_executor.driver_worker.model_runner.model.load_weights`) reaches
the real model in-process and a batching proxy otherwise; either way the next
generation matches transformers on the new weights. References: transformers on the
same weights; the engine's own tokens before a refused batch."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from rl_helpers import GREEDY, PROMPTS, checkpoint, greedy, hf_greedy, hf_model, perturbed

from pagellm import LLM
from pagellm.executor.model.decoder import DecoderForCausalLM
from pagellm.frontend.llm import engine_in_own_process
from pagellm.frontend.llm_engine import RemoteModel
from pagellm.protocol.engine_args import EngineArgs

KV = 8 * 2**20


def _model(llm: LLM):
    return llm.llm_engine.model_executor.driver_worker.model_runner.model


def _hf_tokens(model_dir, weights, llm: LLM) -> list[list[int]]:
    reference = hf_model(model_dir, weights)
    tokenizer = llm.get_tokenizer()
    return [hf_greedy(reference, tokenizer.encode(p), GREEDY.max_tokens) for p in PROMPTS]


def test_load_weights_in_process_reaches_the_real_model(model_dirs):
    model_dir = model_dirs["llama"]
    new = perturbed(model_dir)
    with LLM(str(model_dir), kv_cache_memory_bytes=KV, multiprocess=False) as llm:
        model = _model(llm)
        assert isinstance(model, DecoderForCausalLM)
        for name, tensor in new.items():  # TRL's loop: one call per parameter
            assert _model(llm).load_weights([(name, tensor)]) == {name}
        llm.reset_prefix_cache()
        assert greedy(llm) == _hf_tokens(model_dir, new, llm)


def test_load_weights_to_an_engine_process_is_sent_batched(model_dirs, monkeypatch):
    model_dir = model_dirs["llama"]
    new = perturbed(model_dir, seed=1)
    with LLM(str(model_dir), kv_cache_memory_bytes=KV) as llm:
        before = greedy(llm)
        sent: list[int] = []
        update = llm.update_weights
        monkeypatch.setattr(llm, "update_weights",
                            lambda pairs: sent.append(len(pairs)) or update(pairs))
        assert isinstance(_model(llm), RemoteModel)
        for name, tensor in new.items():
            _model(llm).load_weights([(name, tensor)])
            tensor.add_(1.0)  # the trainer's next optimizer step: the queue holds copies
        assert sent == []  # nothing sent yet: queued until the next call
        llm.reset_prefix_cache()
        assert sent == [len(new)]  # one batch, one round trip
        after = greedy(llm)
        assert after != before
        assert after == _hf_tokens(model_dir, perturbed(model_dir, seed=1), llm)


def test_a_refused_batch_fails_the_next_call_and_keeps_the_old_weights(model_dirs):
    model_dir = model_dirs["llama"]
    weights = checkpoint(model_dir)
    with LLM(str(model_dir), kv_cache_memory_bytes=KV) as llm:
        before = greedy(llm)
        name = "model.layers.0.mlp.up_proj.weight"
        _model(llm).load_weights([(name, weights[name] * 2)])
        _model(llm).load_weights([("model.layers.0.no_such.weight", torch.zeros(2))])
        with pytest.raises(RuntimeError, match=r"load_weights: the batched update of 2 "
                                               r"tensor\(s\).*no_such"):
            llm.generate(PROMPTS[:1], use_tqdm=False)
        assert greedy(llm) == before  # nothing of the batch landed; the engine serves on
        with pytest.raises(TypeError, match="load_weights takes \\(name, tensor\\) pairs"):
            _model(llm).load_weights([name])


def test_executor_backends_choose_where_the_engine_core_runs(model_dirs, monkeypatch):
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    args = EngineArgs(model="demo")
    assert engine_in_own_process(args, None)
    assert not engine_in_own_process(args.replace(
        distributed_executor_backend="external_launcher"), None)
    assert engine_in_own_process(args.replace(distributed_executor_backend="uni"), None)
    assert engine_in_own_process(args, True) and not engine_in_own_process(args, False)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    assert not engine_in_own_process(args, None)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    assert engine_in_own_process(args.replace(
        distributed_executor_backend="external_launcher"), None)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "yes")
    with pytest.raises(ValueError, match="VLLM_ENABLE_V1_MULTIPROCESSING must be 0 or 1"):
        engine_in_own_process(args, None)
    for backend in ("uni", "external_launcher"):
        with pytest.raises(ValueError, match=f"'{backend}' runs one worker: "
                                             "tensor_parallel_size must be 1"):
            EngineArgs(model="demo", distributed_executor_backend=backend,
                       tensor_parallel_size=2)


def test_the_worker_has_a_default_process_group_of_one_owned_by_the_engine(model_dirs):
    """vLLM's workers always have one (OpenRLHF's extension asserts it); an engine that
    made it destroys it, one that found it (an external launcher's) leaves it. In a
    fresh interpreter: the process-wide group is this test's subject."""
    script = f"""
import torch.distributed as dist
from pagellm import LLM
from pagellm.executor.model.decoder import DecoderForCausalLM
assert not dist.is_initialized()
with LLM({str(model_dirs["llama"])!r}, kv_cache_memory_bytes={KV},
         distributed_executor_backend="external_launcher") as llm:
    assert dist.is_initialized() and dist.get_world_size() == 1 and dist.get_rank() == 0
    model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    assert isinstance(model, DecoderForCausalLM)  # in this process
assert not dist.is_initialized()
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
group = dist.group.WORLD
with LLM({str(model_dirs["llama"])!r}, kv_cache_memory_bytes={KV}, multiprocess=False):
    assert dist.group.WORLD is group
assert dist.is_initialized()  # the trainer's group outlives the engine
dist.destroy_process_group()
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("ok")


def test_install_as_vllm_serves_vllm_imports_and_refuses_the_unserved():
    """In a fresh interpreter: the alias must not leak into this test process."""
    script = """
import importlib.util, sys
import pagellm
pagellm.install_as_vllm()
import vllm
from vllm import LLM, SamplingParams, AsyncLLMEngine, AsyncEngineArgs
from vllm.sampling_params import StructuredOutputsParams
from vllm.inputs import TokensPrompt
from vllm.utils import random_uuid
from vllm.utils.network_utils import get_ip, get_open_port
from vllm.distributed.weight_transfer.nccl_common import trainer_init
assert LLM is pagellm.LLM and SamplingParams is pagellm.SamplingParams
assert AsyncLLMEngine is pagellm.AsyncLLM and AsyncEngineArgs is pagellm.EngineArgs
assert vllm.__version__ == "0.31.0", vllm.__version__
assert importlib.util.find_spec("vllm") is not None
assert len(random_uuid()) == 32 and 0 < get_open_port() < 65536 and get_ip()
assert LLM.__module__ == "pagellm.frontend.llm"  # pickles under its real name
try:
    import vllm.model_executor.layers
except ModuleNotFoundError as e:
    assert "vllm.model_executor" in str(e) and "install_as_vllm" in str(e), e
else:
    raise AssertionError("an unserved vLLM module imported")
import os
assert os.environ["PAGELLM_AS_VLLM"] == "1"  # the engine processes install it too
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("ok")
    assert "vllm" not in sys.modules


def test_install_as_vllm_refuses_when_another_vllm_is_imported():
    script = """
import sys, types
sys.modules["vllm"] = types.ModuleType("vllm")  # what the real vLLM leaves there
import pagellm
try:
    pagellm.install_as_vllm()
except RuntimeError as e:
    assert "the real vLLM is already imported" in str(e), e
    print("refused")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "refused"
