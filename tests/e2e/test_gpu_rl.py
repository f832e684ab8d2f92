"""On a CUDA machine (`pytest -m gpu`): the GPU halves of the RL engine. Weight updates
from CUDA tensors by CUDA IPC (the sender's buffer freed after), the "nccl" backend's
choice between NCCL and gloo with a CUDA engine, and sleep giving device and pinned host
memory back. References: transformers on the pushed weights, the engine's own tokens
before sleeping, `torch.cuda.mem_get_info` and the process's RSS. Skipped cleanly
without a GPU; the CPU halves are in tests/weights/ (test_shm_updates.py, test_cuda_ipc.py,
test_nccl_updates.py) and tests/executor/test_sleep.py."""

from __future__ import annotations

import time

import psutil
import pytest
import torch
from rl_helpers import NcclTrainer, greedy, hf_greedy, hf_model, parameter_count, perturbed

from pagellm import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = ["Hello", "The quick brown fox", "def fibonacci(n):", "a b c d e f"]
KV = 64 * 2**20


def test_cuda_tensors_travel_by_cuda_ipc_and_the_senders_buffer_is_freed(model_dirs,
                                                                        monkeypatch):
    """GPU tensors to an engine in another process: CUDA IPC, never /dev/shm. The
    engine loads transformers' tokens on the new weights; a bad update is refused whole;
    either way every share is released, so the sender's buffer is freed."""
    import pagellm.weights.shm as weight_transfer

    def no_shared_memory(*args: object, **kwargs: object) -> None:
        raise AssertionError("CUDA tensors went through shared memory")

    monkeypatch.setattr(weight_transfer, "shared_weights", no_shared_memory)
    model_dir = model_dirs["llama"]
    new = {name: t.cuda() for name, t in perturbed(model_dir, seed=3).items()}
    with LLM(str(model_dir), device="cuda", dtype="float32", kv_cache_memory_bytes=KV,
             weight_transfer_config={"backend": "ipc"}) as llm:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        assert llm.update_weights(new.items()) == len(new)
        torch.cuda.ipc_collect()
        assert torch.cuda.memory_allocated() == base  # the shared buffer is gone
        reference = hf_model(model_dir, perturbed(model_dir, seed=3))
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=10),
                               use_tqdm=False)
        after = [o.outputs[0].token_ids for o in outputs]
        assert after == [hf_greedy(reference, o.prompt_token_ids, 10) for o in outputs]
        name = "model.layers.0.self_attn.q_proj.weight"
        bad = dict(new)
        bad[name] = new[name][:-1]
        with pytest.raises(RuntimeError, match=f"old weights kept: {name}"):
            llm.update_weights(bad.items())
        torch.cuda.ipc_collect()
        assert torch.cuda.memory_allocated() == base
        assert greedy(llm, PROMPTS) == after


@pytest.mark.parametrize("engine_gpu", [0, 1], ids=["shared-gpu", "own-gpu"])
def test_the_nccl_backend_with_a_cuda_engine(model_dirs, engine_gpu):
    """The trainer (its own process, on cuda:0) broadcasts to a CUDA engine: over NCCL
    when the engine has a GPU of its own, over gloo through host memory when they share
    one (NCCL refuses two ranks on one GPU). Either way the engine then gives
    transformers' tokens on the pushed weights."""
    from helpers import free_port

    if engine_gpu >= torch.cuda.device_count():
        pytest.skip(f"needs {engine_gpu + 1} GPUs")
    model_dir = model_dirs["llama"]
    init_info = {"master_address": "127.0.0.1", "master_port": free_port(),
                 "rank_offset": 1, "world_size": 2}
    with NcclTrainer(model_dir, init_info, device="cuda:0") as trainer, \
            LLM(str(model_dir), device=f"cuda:{engine_gpu}", dtype="float32",
                kv_cache_memory_bytes=KV, weight_transfer_config={"backend": "nccl"}) as llm:
        trainer.guard(llm.engine_core.engine_process.pid)
        llm.init_weight_transfer_engine({"init_info": init_info})
        joined = trainer.joined()
        assert joined["backend"] == ("nccl" if engine_gpu else "gloo")
        llm.start_weight_update()
        trainer.send()
        names = joined["update_info"]["names"]
        assert llm.update_weights({"update_info": joined["update_info"]}) == len(names)
        llm.finish_weight_update()
        assert trainer.sent()
        reference = hf_model(model_dir, perturbed(model_dir, seed=7))
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=10),
                               use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == [
            hf_greedy(reference, o.prompt_token_ids, 10) for o in outputs]
        assert trainer.finish() == 0


def test_sleep_gives_device_and_pinned_memory_back_and_wakes_with_graphs(big_config):
    """Level 1: the device's free memory grows by the KV cache and the weights, which
    wait in one pinned host buffer of their exact size, freed after waking. Waking
    captures the CUDA graphs again (printed: what it costs) and gives the same tokens.
    Level 2 also returns the weights' device memory, with no host copy.

    The host copy is measured as the RSS of level 1 asleep minus that of level 2 asleep:
    both states have freed the same graphs and caches, so only the copy differs (against
    the awake RSS, the first H200 run saw the graphs' own host memory, freed at sleep,
    outweigh the 78 MiB copy)."""
    kv_bytes = 512 * 2**20
    with LLM(str(big_config), load_format="dummy", skip_tokenizer_init=True,
             device="cuda", dtype="float32", enable_sleep_mode=True,
             kv_cache_memory_bytes=kv_bytes, max_model_len=1024, multiprocess=False) as llm:
        worker = llm.engine_core.core.executor.worker
        runner = worker.model_runner
        weights = parameter_count(big_config) * 4  # fp32
        prompts = [{"prompt_token_ids": [(7 * i + j) % 8000 + 1 for j in range(50)]}
                   for i in range(4)]
        params = SamplingParams(temperature=0.0, max_tokens=16)

        def tokens() -> list[list[int]]:
            return [o.outputs[0].token_ids
                    for o in llm.generate(prompts, params, use_tqdm=False)]

        before = tokens()
        assert runner.graphs is not None
        process = psutil.Process()
        free_awake, rss_awake = torch.cuda.mem_get_info()[0], process.memory_info().rss
        llm.sleep(level=1)
        free_asleep, rss_level1 = torch.cuda.mem_get_info()[0], process.memory_info().rss
        assert free_asleep - free_awake > 0.9 * (kv_bytes + weights)
        backup = worker._weight_backup
        assert backup is not None and backup.pinned is not None
        assert backup.pinned.is_pinned()  # page-locked: waking copies at bus speed
        assert weights <= backup.pinned.numel() < 1.01 * weights  # not rounded up
        assert runner.graphs is None
        start = time.perf_counter()
        assert llm.wake_up() is True
        seconds = time.perf_counter() - start
        assert runner.graphs is not None
        assert worker._weight_backup is None and backup.pinned is None  # unpinned, dropped
        assert abs(torch.cuda.mem_get_info()[0] - free_awake) < 0.1 * (kv_bytes + weights)
        assert process.memory_info().rss - rss_awake < 0.2 * weights  # the copy is freed
        print(f"\nwake_up after level 1 (weights {weights / 2**20:.0f} MiB, KV "
              f"{kv_bytes / 2**20:.0f} MiB, CUDA graphs captured again): {seconds:.2f} s")
        assert tokens() == before
        llm.sleep(level=2)
        free_level2, rss_level2 = torch.cuda.mem_get_info()[0], process.memory_info().rss
        assert free_level2 - free_awake > 0.9 * (kv_bytes + weights)
        assert worker._weight_backup is None
        assert 0.8 * weights < rss_level1 - rss_level2 < 1.2 * weights  # the host copy
        assert llm.wake_up() is True  # weights undefined until pushed (executor/test_sleep.py)
        assert abs(torch.cuda.mem_get_info()[0] - free_awake) < 0.1 * (kv_bytes + weights)


def test_openrlhf_worker_wrap_unchanged_syncs_weights_on_cuda(model_dirs, monkeypatch):
    """OpenRLHF 0.11's own `WorkerWrap` (its `update_weight` allocates on "cuda") as
    worker_extension_cls, its default weight sync (vLLM's StatelessProcessGroup and
    PyNcclCommunicator on both sides; gloo, as trainer and engine share the GPU), the
    dtype and shape sent as torch objects. Needs `pip install --no-deps openrlhf`
    (its own dependencies pin flash-attn), so CI's CPU leg runs the same calls through
    tests/support/openrlhf_shaped.py instead."""
    import threading

    pytest.importorskip("openrlhf")
    from helpers import SUPPORT, free_port

    from pagellm.vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from pagellm.vllm.distributed.utils import StatelessProcessGroup

    monkeypatch.setenv("PAGELLM_AS_VLLM", "1")
    monkeypatch.setenv("PYTHONPATH", str(SUPPORT))
    model_dir = model_dirs["llama"]
    new = {name: t.cuda() for name, t in perturbed(model_dir, seed=5).items()}
    port = free_port()
    with LLM(str(model_dir), device="cuda", dtype="float32", kv_cache_memory_bytes=KV,
             worker_extension_cls="openrlhf.trainer.ray.vllm_worker_wrap.WorkerWrap") as llm:
        def rpc(method: str, *args: object) -> threading.Thread:
            thread = threading.Thread(target=llm.collective_rpc, args=(method,),
                                      kwargs={"args": args}, daemon=True)
            thread.start()
            return thread

        joining = rpc("init_process_group", "127.0.0.1", port, 1, 2, "openrlhf", "nccl",
                      False)
        trainer = PyNcclCommunicator(StatelessProcessGroup.create(
            host="127.0.0.1", port=port, rank=0, world_size=2), device=0)
        joining.join(120)
        for name, tensor in new.items():
            receiving = rpc("update_weight", name, tensor.dtype, tensor.shape, False)
            trainer.broadcast(tensor, src=0, stream=torch.cuda.current_stream())
            receiving.join(120)
            assert not receiving.is_alive()
        trainer.close()
        llm.reset_prefix_cache()
        reference = hf_model(model_dir, {n: t.cpu() for n, t in new.items()})
        tokenizer = llm.get_tokenizer()
        assert greedy(llm) == [hf_greedy(reference, tokenizer.encode(p), 10) for p in PROMPTS]
