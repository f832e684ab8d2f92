"""RL frameworks' released code, unchanged, on pagellm through `install_as_vllm()`.

TRL's GRPOTrainer in colocate mode trains two steps with the engine in the trainer's
process (TRL passes distributed_executor_backend="external_launcher", which means that
in vLLM) and with the engine core in its own process (VLLM_ENABLE_V1_MULTIPROCESSING=1,
so TRL's per-parameter `llm_engine...model.load_weights` goes through the batching
proxy). The reference: after a final weight sync, the engine's greedy tokens equal
transformers' on the trained model, which moved away from the initial weights (so
every sync must have landed). Each run is its own interpreter
(tests/support/trl_grpo_colocate.py): the `vllm` alias never enters this process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import SUPPORT

pytest.importorskip("trl", reason="TRL is a test dependency (pip install -e '.[test]')")


def assert_serves_new_weights(llm, model_dir, new, before) -> None:
    """The engine's greedy tokens changed from `before` and equal transformers' on the
    new weights."""
    from rl_helpers import GREEDY, PROMPTS, greedy, hf_greedy, hf_model

    after = greedy(llm)
    assert after != before
    reference = hf_model(model_dir, new)
    tokenizer = llm.get_tokenizer()
    assert after == [hf_greedy(reference, tokenizer.encode(p), GREEDY.max_tokens)
                     for p in PROMPTS]


@pytest.mark.parametrize("engine_process", ["in-process", "own-process"])
def test_trl_grpo_colocate_trains_and_every_weight_sync_lands(model_dirs, tmp_path,
                                                              engine_process):
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING":
           "1" if engine_process == "own-process" else "0"}
    env.pop("PAGELLM_AS_VLLM", None)
    done = subprocess.run(
        [sys.executable, str(SUPPORT / "trl_grpo_colocate.py"), str(model_dirs["llama"]),
         str(tmp_path)], env=env, capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["global_step"] == 2
    assert result["moved"] > 1e-3  # training changed the weights
    assert result["model_class"] == ("RemoteModel" if engine_process == "own-process"
                                     else "DecoderForCausalLM")
    assert result["engine_tokens"] == result["hf_tokens"]
    steps = [entry for entry in result["log"] if "sampling/sampling_logp_difference/max"
             in entry]
    assert len(steps) == 2
    for entry in steps:  # the engine's logprobs are the trainer's (fp32 on both sides)
        assert entry["sampling/sampling_logp_difference/max"] < 1e-4


def test_openrlhf_weight_sync_through_its_vllm_imports(model_dirs, monkeypatch):
    """OpenRLHF's calls (tests/support/openrlhf_shaped.py): `WorkerWrap` as
    worker_extension_cls asserting a default process group, the group built from vLLM's
    StatelessProcessGroup and PyNcclCommunicator on both sides (gloo on the CPU), and
    `collective_rpc("update_weight", args=(name, torch.dtype, torch.Size, False))` once
    per tensor while the trainer broadcasts it. Then greedy tokens equal transformers'
    on the new weights."""
    import threading

    import torch
    from helpers import free_port
    from rl_helpers import greedy, perturbed

    from pagellm import LLM
    from pagellm.vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from pagellm.vllm.distributed.utils import StatelessProcessGroup

    monkeypatch.setenv("PAGELLM_AS_VLLM", "1")  # the engine process resolves vllm.*
    monkeypatch.setenv("PYTHONPATH", str(SUPPORT))  # and imports openrlhf_shaped
    model_dir = model_dirs["llama"]
    new = perturbed(model_dir, seed=3)
    port = free_port()
    with LLM(str(model_dir), kv_cache_memory_bytes=8 * 2**20,
             worker_extension_cls="openrlhf_shaped.WorkerWrap") as llm:
        before = greedy(llm)

        def in_background(method: str, *args: object) -> threading.Thread:
            thread = threading.Thread(target=llm.collective_rpc, args=(method,),
                                      kwargs={"args": args}, daemon=True)
            thread.start()
            return thread

        joining = in_background("init_process_group", "127.0.0.1", port, 1, 2, "openrlhf",
                                "gloo", False)
        trainer = PyNcclCommunicator(StatelessProcessGroup.create(
            host="127.0.0.1", port=port, rank=0, world_size=2), device="cpu")
        joining.join(60)
        for name, tensor in new.items():
            receiving = in_background("update_weight", name, tensor.dtype, tensor.shape,
                                      False)
            trainer.broadcast(tensor.clone(), src=0)
            receiving.join(60)
            assert not receiving.is_alive()
        trainer.close()
        with pytest.raises(RuntimeError, match="mismatch dtype"):
            llm.collective_rpc("update_weight", args=("lm_head.weight", torch.bfloat16,
                                                      torch.Size([2, 2]), False))
        llm.reset_prefix_cache()
        assert_serves_new_weights(llm, model_dir, new, before)


def test_trl_server_mode_weight_sync_calls_on_the_cpu(model_dirs):
    """What TRL 1.16's VLLMClient does to sync weights (it refuses a non-CUDA trainer
    before this, so its own code runs only on a GPU): the engine joins with
    `init_info["packed"] = True`, the trainer opens vLLM's `nccl_common.trainer_init`
    and streams every parameter with `packed_nccl_broadcast_producer` while the engine
    is inside `update_weights({"update_info": ...})`, then clears the communicator's
    `group.store` and `group.socket` as TRL's close does. Greedy tokens then equal
    transformers' on the new weights."""
    import threading

    from helpers import free_port
    from rl_helpers import greedy, perturbed

    from pagellm import LLM
    from pagellm.vllm.distributed.weight_transfer.nccl_common import trainer_init
    from pagellm.vllm.distributed.weight_transfer.packed_tensor import (
        packed_nccl_broadcast_producer,
    )

    model_dir = model_dirs["llama"]
    new = perturbed(model_dir, seed=7)
    init_info = {"master_address": "127.0.0.1", "master_port": free_port(),
                 "rank_offset": 1, "world_size": 2, "packed": True}  # TRL's init_info
    with LLM(str(model_dir), kv_cache_memory_bytes=8 * 2**20,
             weight_transfer_config={"backend": "nccl"}) as llm:
        before = greedy(llm)
        joining = threading.Thread(target=llm.init_weight_transfer_engine,
                                   args=({"init_info": init_info},), daemon=True)
        joining.start()
        communicator = trainer_init(init_info)
        joining.join(60)
        metadata = [(n, str(t.dtype).removeprefix("torch."), list(t.shape))
                    for n, t in new.items()]
        names, dtype_names, shapes = (list(f) for f in zip(*metadata, strict=True))
        llm.start_weight_update()
        receiving = threading.Thread(target=llm.update_weights, args=(
            {"update_info": {"names": names, "dtype_names": dtype_names,
                             "shapes": shapes}},), daemon=True)
        receiving.start()
        packed_nccl_broadcast_producer(iterator=iter(new.items()), group=communicator,
                                       src=0, post_iter_func=lambda item: item[1])
        receiving.join(60)
        assert not receiving.is_alive()
        llm.finish_weight_update()
        communicator.group.store = None  # TRL's close_communicator
        communicator.group.socket = None
        communicator.close()
        assert_serves_new_weights(llm, model_dir, new, before)
