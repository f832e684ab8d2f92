"""The RL rollout engine: sleep and wake, weight updates, collective_rpc, pause and
resume. References: transformers on the same (or perturbed) weights, the engine's own
tokens before sleeping, and the engine process's RSS measured from outside."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest
import torch
from conftest import assert_no_leaks
from helpers import ROOT, SUPPORT, free_port
from rl_helpers import (
    GREEDY,
    PROMPTS,
    NcclTrainer,
    checkpoint,
    greedy,
    hf_greedy,
    hf_model,
    leftover_buffers,
    parameter_count,
    perturbed,
    rss,
)

from pagellm import LLM, AsyncLLM, SamplingParams
from pagellm.executor.model.loader import safetensors_files
from pagellm.weights.shm import buffer_dirs, shared_weights, shm_dir

# --- weight updates ---------------------------------------------------------------------


def test_update_weights_gives_transformers_tokens_and_logprobs_on_the_new_weights(model_dirs):
    model_dir = model_dirs["llama"]
    new = perturbed(model_dir)
    reference = hf_model(model_dir, new)
    with LLM(str(model_dir), weight_transfer_config={"backend": "ipc"},
             kv_cache_memory_bytes=8 * 2**20) as llm:
        before = greedy(llm)
        assert llm.update_weights(new.items()) == len(new)
        params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=1)
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert not leftover_buffers()
        assert [o.outputs[0].token_ids for o in outputs] != before  # the update landed
        for out in outputs:
            completion = out.outputs[0]
            assert completion.token_ids == hf_greedy(reference, out.prompt_token_ids, 10)
            ids = out.prompt_token_ids + completion.token_ids
            with torch.no_grad():
                logprobs = reference(torch.tensor([ids])).logits[0].log_softmax(-1)
            start = len(out.prompt_token_ids) - 1
            for j, (token, position) in enumerate(zip(completion.token_ids,
                                                      completion.logprobs, strict=True)):
                assert abs(position[token].logprob - float(logprobs[start + j, token])) < 1e-4
        assert_no_leaks(llm)


def test_an_update_forgets_cached_prefixes(model_dirs):
    """A prompt whose prefix was cached under the old weights is recomputed."""
    model_dir = model_dirs["llama"]
    new = perturbed(model_dir, seed=1)
    reference = hf_model(model_dir, new)
    prompt = {"prompt_token_ids": list(range(5, 69))}  # four full blocks
    with LLM(str(model_dir), weight_transfer_config={"backend": "ipc"},
             kv_cache_memory_bytes=8 * 2**20, multiprocess=False) as llm:
        greedy(llm, [prompt])
        llm.update_weights(new.items())
        hits = llm.get_stats().prefix_cache_hits
        assert greedy(llm, [prompt]) == [hf_greedy(reference, prompt["prompt_token_ids"], 10)]
        assert llm.get_stats().prefix_cache_hits == hits


def test_a_bad_update_is_refused_whole_and_the_old_weights_keep_serving(model_dirs):
    model_dir = model_dirs["llama"]
    new = perturbed(model_dir)
    name = "model.layers.0.self_attn.q_proj.weight"
    bad = dict(new)
    bad[name] = new[name][:-1]  # one row short
    bad["model.layers.9.mlp.up_proj.weight"] = torch.zeros(3, 3)  # no such layer
    with LLM(str(model_dir), weight_transfer_config={"backend": "ipc"},
             kv_cache_memory_bytes=8 * 2**20) as llm:
        before = greedy(llm)
        with pytest.raises(RuntimeError) as info:
            llm.update_weights(bad.items())
        message = str(info.value)
        assert "old weights kept" in message and name in message
        assert "model.layers.9.mlp.up_proj.weight: no such weight" in message
        with pytest.raises(ValueError, match="dtype int64 is not a weight dtype"):
            llm.update_weights([(name, torch.zeros(2, dtype=torch.int64))])
        # Review 2: each of these was a raw traceback from deep in the sender.
        for weights, error in (([(name, [1.0] * 4)], f"weight {name}: expected a torch"),
                               ([(7, torch.zeros(2))], r"weights\[0\]: the name must be"),
                               ([(name,)], r"weights\[0\] must be a \(name, tensor\) pair")):
            with pytest.raises(TypeError, match=error):
                llm.update_weights(weights)
        with pytest.raises(RuntimeError, match=f"{name}.*shape"):  # 0-d: written, refused
            llm.update_weights([(name, torch.tensor(1.0))])
        with pytest.raises(ValueError, match=r"<= 4611686018427387904 - at update_info\."
                                             r"shapes\[0\]\[0\]"):
            llm.update_weights({"update_info": {"names": [name], "dtype_names": ["float32"],
                                                "shapes": [[10**30]]}})
        with pytest.raises(RuntimeError, match="broadcast over backend 'nccl'; this engine's "
                                               "backend is 'ipc'"):
            llm.update_weights({"update_info": {"names": [name], "dtype_names": ["float32"],
                                                "shapes": [list(new[name].shape)]}})
        assert greedy(llm) == before  # not one tensor of the bad update was copied
        assert not leftover_buffers()
        assert_no_leaks(llm)


def test_updates_need_weight_transfer_config_and_buffers_come_only_from_shm(model_dirs):
    model_dir = model_dirs["llama"]
    with LLM(str(model_dir), kv_cache_memory_bytes=8 * 2**20, multiprocess=False) as llm, \
            pytest.raises(RuntimeError, match="weight_transfer_config"):
        llm.update_weights(checkpoint(model_dir).items())
    with LLM(str(model_dir), weight_transfer_config={"backend": "ipc"},
             kv_cache_memory_bytes=8 * 2**20) as llm:
        before = greedy(llm)
        with shared_weights(perturbed(model_dir).items()) as update:
            for path in ("/etc/passwd", str(shm_dir() / "other-file"),
                         str(shm_dir() / "pagellm-weights-missing")):
                with pytest.raises(RuntimeError, match="weight buffer"):
                    llm.update_weights(type(update)(update.specs, path, update.buffer_bytes))
            with pytest.raises(RuntimeError, match="regular file of"):
                llm.update_weights(type(update)(update.specs, update.buffer, 7))
        assert greedy(llm) == before


def test_an_update_naming_a_weight_twice_is_refused_naming_it(model_dirs):
    """Each name once per update, checked before the first copy: the old weights keep
    serving."""
    from pagellm.protocol.utility import WeightUpdate

    model_dir = model_dirs["llama"]
    name = "model.layers.0.self_attn.q_proj.weight"
    with LLM(str(model_dir), weight_transfer_config={"backend": "ipc"},
             kv_cache_memory_bytes=8 * 2**20) as llm:
        before = greedy(llm)
        with shared_weights(perturbed(model_dir).items()) as update:
            spec = next(s for s in update.specs if s.name == name)
            twice = WeightUpdate([*update.specs, spec], update.buffer, update.buffer_bytes)
            with pytest.raises(RuntimeError, match=rf"old weights kept: {name} appears "
                                                   r"more than once"):
                llm.update_weights(twice)
        assert greedy(llm) == before  # nothing of the (otherwise good) update was copied
        assert not leftover_buffers()
        assert_no_leaks(llm)


def test_specs_pointing_many_times_at_one_region_are_refused_by_the_limits(model_dirs):
    """Red-team finding 7: a few bytes of specs, all naming one region of one shared
    file, once made the busy loop copy it once per spec while no request was served;
    300,000 distinct names the model skips (RoPE tables) stalled it for 3 s. An
    update's number of tensors (twice the checkpoint's at most) and total size (the
    limit of every path: 2 x the model's bytes) are checked first, and the engine keeps
    serving and taking updates."""
    from pagellm.protocol.utility import WeightSpec, WeightUpdate

    model_dir = model_dirs["llama"]
    weights = checkpoint(model_dir)
    name = "model.embed_tokens.weight"
    with LLM(str(model_dir), weight_transfer_config={"backend": "ipc"},
             kv_cache_memory_bytes=8 * 2**20) as llm:
        before = greedy(llm)
        with shared_weights([(name, perturbed(model_dir)[name])]) as region:
            copies = 2 * len(weights)  # as many as may come; the old code copied each
            alias = WeightUpdate(region.specs * copies, region.buffer, region.buffer_bytes)
            with pytest.raises(RuntimeError) as info:
                llm.update_weights(alias)
            total = copies * weights[name].numel() * weights[name].element_size()
            limit = 2 * 4 * parameter_count(model_dir)  # float32 on the CPU
            assert (f"weight update of {total} bytes is larger than the model allows "
                    f"({limit}); refused, nothing copied or received") in str(info.value)
            skipped = [WeightSpec(f"model.layers.{i}.self_attn.rotary_emb.inv_freq",
                                  "float32", [0], 0) for i in range(copies + 1)]
            with pytest.raises(RuntimeError, match=rf"weight update of {copies + 1} tensors "
                                                   rf"is more than the model has \({copies} "):
                llm.update_weights(WeightUpdate(skipped, region.buffer, region.buffer_bytes))
        assert greedy(llm) == before
        assert llm.update_weights(weights.items()) == len(weights)  # still takes updates
        assert greedy(llm) == before  # the same weights again
        assert not leftover_buffers()
        assert_no_leaks(llm)


def test_weight_update_errors_echo_at_most_a_prefix_of_what_was_sent(model_dirs):
    """A 40 MB tensor name or dtype came back as a 40 MB error string: refused with a
    prefix of it; the engine keeps serving."""
    from pagellm.protocol.utility import WeightSpec, WeightUpdate

    model_dir = model_dirs["llama"]
    name = "model.norm.weight"
    with LLM(str(model_dir), weight_transfer_config={"backend": "ipc"},
             kv_cache_memory_bytes=8 * 2**20) as llm:
        before = greedy(llm)
        with shared_weights([(name, checkpoint(model_dir)[name])]) as update:
            spec = update.specs[0]
            for bad, complaint in (
                    (WeightSpec("x" * 100_000, spec.dtype, spec.shape), "characters"),
                    (WeightSpec(name, "y" * 100_000, spec.shape), "not a weight dtype"),
                    (WeightSpec(name, spec.dtype, [1] * 100_000), "dimensions")):
                with pytest.raises(RuntimeError, match=complaint) as info:
                    llm.update_weights(WeightUpdate([bad], update.buffer, update.buffer_bytes))
                assert len(str(info.value)) < 400, len(str(info.value))
        assert greedy(llm) == before
        assert_no_leaks(llm)


def cuda_share(**changes: object):
    """A well-formed CUDA IPC share, as torch's `_share_cuda_` would describe one."""
    from pagellm.protocol.utility import CudaIpcBuffer

    fields = {"device_uuid": "GPU-5f0c2a9e-0000-0000-0000-000000000000",
              "handle": bytes(range(64)), "buffer_bytes": 4096, "offset_bytes": 512,
              "ref_counter": b"/torch_4242_1234567_0", "ref_counter_offset": 3,
              "event_handle": bytes(64), "event_sync_required": False, **changes}
    return CudaIpcBuffer(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(("changes", "complaint"), [
    ({"ref_counter": b"/etc/passwd"}, "ref_counter must name one of torch's"),
    ({"ref_counter": b"/torch_1_2_3\x00/etc"}, "ref_counter must name one of torch's"),
    ({"ref_counter_offset": 10000}, "ref_counter_offset must be"),
    ({"ref_counter_offset": -1}, "ref_counter_offset must be"),
    ({"event_handle": bytes(63)}, "event_handle must be 64 bytes"),
    ({"handle": b""}, "handle must be"),
    ({"handle": bytes(4097)}, "handle must be"),
    ({"buffer_bytes": 0}, "buffer_bytes must be"),
    ({"offset_bytes": -64}, "offset_bytes must be"),
    ({"device_uuid": ""}, "device_uuid"),
])
def test_cuda_ipc_shares_are_checked_where_they_enter(changes, complaint):
    """torch trusts these values (its counter slot is written at the offset given), so
    the engine's utility decoder refuses a bad one before any worker sees it."""
    from pagellm.protocol.messages import UtilityMethod
    from pagellm.protocol.utility import WeightSpec, WeightUpdate, convert_args

    good = WeightUpdate([WeightSpec("w", "float32", [4], 0)], buffer_bytes=16,
                        cuda_ipc=[cuda_share()])
    wire = msgspec.to_builtins(good)
    assert convert_args(UtilityMethod.UPDATE_WEIGHTS, [wire]) == (good,)
    bad = msgspec.to_builtins(WeightUpdate(good.specs, buffer_bytes=16,
                                           cuda_ipc=[cuda_share()]))
    share = msgspec.to_builtins(cuda_share())
    names = list(msgspec.structs.asdict(cuda_share()))
    for name, value in changes.items():
        share[names.index(name)] = msgspec.to_builtins(value)
    bad[3] = [share]
    with pytest.raises(ValueError, match=complaint):
        convert_args(UtilityMethod.UPDATE_WEIGHTS, [bad])
    both = msgspec.to_builtins(good)
    both[1] = str(shm_dir() / "pagellm-weights-x")
    with pytest.raises(ValueError, match="not both"):
        convert_args(UtilityMethod.UPDATE_WEIGHTS, [both])


def test_a_device_buffer_holds_every_tensor_aligned_and_reads_back_exactly():
    """The CUDA IPC sender's packing (here into a host buffer: the same code on any
    device) read back by the receiver's views: mixed dtypes, odd sizes, an empty and a
    transposed tensor, each at a 64-byte boundary, none overlapping."""
    from pagellm.weights.shm import ALIGN, layout, pack, views

    generator = torch.Generator().manual_seed(0)
    pairs = [("a", torch.randn(5, 3, generator=generator).t()),  # not contiguous
             ("b", torch.randn(7, generator=generator).to(torch.bfloat16)),
             ("c", torch.empty(0, 4, dtype=torch.float16)),
             ("d", torch.randn(3, 3, generator=generator).to(torch.float16)),
             ("e", torch.randn(2, 2, generator=generator))]
    specs, size = layout(pairs)
    assert [s.offset for s in specs] == [0, 64, 128, 128, 192]  # 60, 14, 0, 18 bytes
    assert size == 192 + 16
    buffer = torch.full((size,), 0xAB, dtype=torch.uint8)
    pack(pairs, specs, buffer)
    for (name, tensor), (got_name, got) in zip(pairs, views(buffer, specs), strict=True):
        assert got_name == name and got.dtype == tensor.dtype
        assert torch.equal(got, tensor), name
    assert (buffer[60:64] == 0xAB).all() and (buffer[64 + 14:128] == 0xAB).all()
    with pytest.raises(ValueError, match=r"weight e: bytes \[192, 208\) are outside the "
                                         r"200-byte buffer"):
        views(buffer[:200], specs)
    assert ALIGN == 64


def test_cuda_ipc_handles_sent_to_a_cpu_engine_fail_alone(model_dirs):
    """A CPU engine cannot open them: a clear error, and the old weights keep serving.
    (The CUDA path itself is tests/e2e/test_gpu.py's.)"""
    from pagellm.protocol.utility import WeightSpec, WeightUpdate

    model_dir = model_dirs["llama"]
    spec = WeightSpec("model.norm.weight", "float32", [64], 0)
    with LLM(str(model_dir), weight_transfer_config={"backend": "ipc"},
             kv_cache_memory_bytes=8 * 2**20) as llm:
        before = greedy(llm)
        with pytest.raises(RuntimeError, match="reached an engine without CUDA"):
            llm.update_weights(WeightUpdate([spec], buffer_bytes=256, cuda_ipc=[cuda_share()]))
        with pytest.raises(RuntimeError, match=r"has 0 share\(s\); this is receiver 0"):
            llm.update_weights(WeightUpdate([spec], buffer_bytes=256, cuda_ipc=[]))
        assert greedy(llm) == before
        assert_no_leaks(llm)


def test_cuda_ipc_goes_to_every_worker_outside_this_process():
    from pagellm.protocol.messages import EngineInfo
    from pagellm.weights.sender import cuda_ipc_receivers

    def info(device: str, tp: int = 1, dp: int = 1) -> EngineInfo:
        return EngineInfo("m", 64, 100, 16, 8, 64, device, "float32", world_size=tp,
                          data_parallel_size=dp)

    assert cuda_ipc_receivers(info("cpu", 2, 2), in_process=False) == 0
    assert cuda_ipc_receivers(info("cuda:0"), in_process=True) == 0  # its own handles
    assert cuda_ipc_receivers(info("cuda:0"), in_process=False) == 1
    assert cuda_ipc_receivers(info("cuda:0", tp=2), in_process=True) == 2  # worker procs
    assert cuda_ipc_receivers(info("cuda:1", tp=2, dp=3), in_process=False) == 6


def test_the_nccl_backend_uses_nccl_only_between_distinct_gpus():
    from pagellm.weights.nccl import choose_backend

    assert choose_backend(["GPU-a", "GPU-b", "GPU-c"]) == "nccl"
    assert choose_backend(["GPU-a", "GPU-a"]) == "gloo"  # NCCL refuses a shared GPU
    assert choose_backend(["GPU-a", "cpu"]) == "gloo"  # a CPU engine or trainer
    assert choose_backend(["cpu", "cpu"]) == "gloo"


TRAINER = """
import sys
from pathlib import Path

import msgspec
from rl_helpers import perturbed

from pagellm.weights.shm import shared_weights

with shared_weights(perturbed(Path(sys.argv[1]), seed=7).items()) as update:
    sys.stdout.write(msgspec.msgpack.encode(update).hex() + "\\n")
    sys.stdout.flush()
    sys.stdin.readline()  # the driver's update_weights has returned: free the buffer
"""


def test_a_trainer_in_another_process_pushes_weights_through_shared_memory(model_dirs):
    """The trainer writes its weights to shared memory and hands the driver only the
    (msgspec) description; the driver's LLM loads them."""
    import msgspec

    from pagellm.protocol.utility import WeightUpdate

    model_dir = model_dirs["llama"]
    reference = hf_model(model_dir, perturbed(model_dir, seed=7))
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, str(model_dir)], cwd=SUPPORT,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        with LLM(str(model_dir), weight_transfer_config={"backend": "ipc"},
                 kv_cache_memory_bytes=8 * 2**20) as llm:
            line = trainer.stdout.readline()
            update = msgspec.msgpack.decode(bytes.fromhex(line), type=WeightUpdate)
            assert llm.update_weights(update) == len(update.specs)
            trainer.stdin.write("done\n")
            trainer.stdin.flush()
            out = llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)[0]
            assert out.outputs[0].token_ids == hf_greedy(reference, out.prompt_token_ids, 10)
        assert trainer.wait(30) == 0
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    assert not leftover_buffers()


def test_packed_bf16_weights_follow_extension_writes_sleep_and_updates(model_dirs, tmp_path,
                                                                        monkeypatch):
    """On CPUs with AMX a bf16 engine multiplies oneDNN's packed copies of its weights
    (cpu_linear); every way the weights change must reach those copies: an extension
    writing through `.data` (no version counter sees it), a level-2 sleep refilled by an
    update, an update. Forced on any CPU here, with the engine in this process. The
    reference for each set of weights is a fresh packed engine started from them: the
    same code on the same weights gives the same tokens and the same logprobs."""
    import shutil

    from safetensors.torch import save_file

    from pagellm.executor.model import linear as cpu_linear

    if cpu_linear.REORDER_WEIGHT is None:
        pytest.skip("this torch has no oneDNN packed weights")
    monkeypatch.setattr(cpu_linear, "THIS_CPU",
                        cpu_linear.Cpu(cpu_linear.THIS_CPU.intel_mkl, amx_bf16=True))
    monkeypatch.setenv("PYTHONPATH", str(SUPPORT))
    model_dir = model_dirs["llama"]
    old, new = checkpoint(model_dir), perturbed(model_dir, seed=5)
    new_dir = tmp_path / "new"
    shutil.copytree(model_dir, new_dir)
    for f in safetensors_files(new_dir):
        f.unlink()
    save_file(new, new_dir / "model.safetensors")
    params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=0)
    common = dict(dtype="bfloat16", kv_cache_memory_bytes=8 * 2**20, multiprocess=False)

    def run(llm: LLM) -> list[tuple[list[int], float | None]]:
        llm.reset_prefix_cache()  # the same computation as a fresh engine's
        return [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob)
                for o in llm.generate(PROMPTS, params, use_tqdm=False)]

    with LLM(str(new_dir), **common) as llm:
        on_new = run(llm)
    with LLM(str(model_dir), worker_extension_cls="rl_extension.Probe",
             weight_transfer_config={"backend": "ipc"}, enable_sleep_mode=True,
             **common) as llm:
        assert len(cpu_linear.PACKED_WEIGHTS) > 0  # at load, before the KV cache is sized
        on_old = run(llm)
        assert on_old != on_new  # the two weight sets are told apart
        assert llm.collective_rpc("load_unseen", args=(new,)) == [len(new)]
        assert run(llm) == on_new
        llm.sleep(level=2)
        assert len(cpu_linear.PACKED_WEIGHTS) == 0  # freed with the weights
        llm.wake_up(tags=["weights"])
        llm.update_weights(old.items())
        llm.wake_up(tags=["kv_cache"])
        assert run(llm) == on_old
        llm.update_weights(new.items())
        assert run(llm) == on_new
        assert len(cpu_linear.PACKED_WEIGHTS) > 0  # packed again by the steps
        assert_no_leaks(llm)


@pytest.mark.parametrize("case", ["good", "bad", "asleep"])
def test_a_trainer_broadcasts_weights_over_the_nccl_backend(model_dirs, case):
    """vLLM's four phases with the trainer in its own process (gloo on the CPU): init
    (both sides join), start, update (the engine receives what the trainer
    broadcasts), finish. A bad tensor is refused after the transfer drained, and the
    old weights keep serving; an update while the weights sleep is refused naming that,
    also after draining (the trainer never hangs)."""
    bad = case == "bad"
    from helpers import free_port

    model_dir = model_dirs["llama"]
    init_info = {"master_address": "127.0.0.1", "master_port": free_port(),
                 "rank_offset": 1, "world_size": 2}
    with NcclTrainer(model_dir, init_info, "bad" if bad else "good") as trainer, \
            LLM(str(model_dir), weight_transfer_config={"backend": "nccl"},
                kv_cache_memory_bytes=8 * 2**20, enable_sleep_mode=True) as llm:
        trainer.guard(llm.engine_core.engine_process.pid)
        before = greedy(llm)
        llm.init_weight_transfer_engine({"init_info": init_info})
        if case == "asleep":
            llm.sleep(level=1)
        joined = trainer.joined()
        assert joined["backend"] == "gloo"  # NCCL only between GPUs
        update_info = joined["update_info"]
        llm.start_weight_update()
        with pytest.raises(RuntimeError, match="already in progress"):
            llm.start_weight_update()
        trainer.send()
        if bad:
            with pytest.raises(RuntimeError, match=r"old weights kept: model\.layers\.1"):
                llm.update_weights({"update_info": update_info})
        elif case == "asleep":
            with pytest.raises(RuntimeError, match="the weights are asleep"):
                llm.update_weights({"update_info": update_info})
            assert llm.wake_up() is True
        else:
            assert llm.update_weights({"update_info": update_info}) == len(
                update_info["names"])
        llm.finish_weight_update(weight_version="step-1")
        assert trainer.sent()
        if case != "good":
            assert greedy(llm) == before
        else:
            reference = hf_model(model_dir, perturbed(model_dir, seed=7))
            out = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in out] == [
                hf_greedy(reference, o.prompt_token_ids, 10) for o in out]
        assert_no_leaks(llm)
        assert trainer.finish() == 0


def test_broadcast_tensors_load_as_they_arrive_and_a_refused_update_is_drained():
    """The receiving side of the "nccl" backend, over a real gloo group (trainer and
    engine ranks in two threads): every tensor reaches its destination exactly as sent,
    whether it lands in the parameter itself (kept whole, same dtype) or goes through
    scratch (another dtype; a rank's slice); a refused update still drains every
    broadcast and leaves the parameters alone; an oversized one is refused before the
    first; a trainer that leaves midway is named."""
    import threading

    from helpers import free_port

    from pagellm.executor.model.decoder import Destination
    from pagellm.executor.worker.weight_receiver import receive
    from pagellm.weights.nccl import (
        TransferInit,
        WeightGroup,
        specs_from_update_info,
        trainer_send_weights,
        update_info_for,
    )
    from pagellm.weights.tensor_codec import UpdateTooLarge, check_specs

    init = TransferInit(master_address="127.0.0.1", master_port=free_port(), world_size=2)
    groups: dict[int, WeightGroup] = {}

    def run(target, *args) -> threading.Thread:
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        return thread

    joins = [run(lambda r: groups.__setitem__(r, WeightGroup(init, r)), r) for r in (0, 1)]
    for thread in joins:
        thread.join(60)
    assert set(groups) == {0, 1} and groups[0].backend == groups[1].backend == "gloo"
    generator = torch.Generator().manual_seed(0)
    sent = [(f"w{i}", torch.randn(48, 40, generator=generator).to(dtype))
            for i, dtype in enumerate([torch.float32, torch.bfloat16, torch.float16,
                                       torch.float32])]
    specs = specs_from_update_info(update_info_for(sent))
    params = [torch.zeros(48, 40), torch.zeros(48, 40, dtype=torch.bfloat16),
              torch.zeros(48, 40), torch.zeros(48, 16)]  # [3]: this rank's 16 columns
    dests = [Destination(params[0], (48, 40)), Destination(params[1], (48, 40)),
             Destination(params[2], (48, 40)), Destination(params[3], (48, 40), 1, 8, 16)]
    want = [sent[0][1], sent[1][1], sent[2][1].float(), sent[3][1][:, 8:24]]
    assert [d.receiver(t.dtype, torch.device("cpu")) is not None
            for d, (_, t) in zip(dests, sent, strict=True)] == [True, True, False, False]
    try:
        trainer = run(trainer_send_weights, sent, groups[0])
        assert receive(groups[1], specs, dests) == len(sent)
        trainer.join(60)
        for got, expected in zip(params, want, strict=True):
            assert got.dtype == expected.dtype and torch.equal(got, expected)
        before = [p.clone() for p in params]
        trainer = run(trainer_send_weights, [(n, t + 1) for n, t in sent], groups[0])
        assert receive(groups[1], specs, None) == len(sent)
        trainer.join(60)
        assert not trainer.is_alive()  # every broadcast was taken
        assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
        with pytest.raises(UpdateTooLarge, match="larger than the model allows"):
            check_specs(specs, limit_bytes=1000, limit_count=10)  # the worker's, first

        def send_half_and_leave() -> None:
            trainer_send_weights(sent[:2], groups[0])
            groups[0].close()

        trainer = run(send_half_and_leave)
        with pytest.raises(RuntimeError, match=r"broadcast 3 of 4 \(w2\) failed \(the model "
                                               r"now mixes old and new weights"):
            receive(groups[1], specs, dests)
        trainer.join(60)
    finally:
        for group in groups.values():
            group.close()


def test_a_broadcast_update_is_checked_in_the_same_place(model_dirs):
    """The "nccl" path refuses what the others do, before the first broadcast: a name
    given twice is refused after every broadcast was drained (the trainer never hangs)
    and the old weights keep serving; an update larger than the model allows is refused
    with nothing received. The group stays in step: a good update then lands."""
    from helpers import free_port

    from pagellm.weights.nccl import (
        trainer_init,
        trainer_send_weights,
        update_info_for,
    )

    model_dir = model_dirs["llama"]
    init_info = {"master_address": "127.0.0.1", "master_port": free_port(),
                 "rank_offset": 1, "world_size": 2}
    new = perturbed(model_dir, seed=7)
    info = update_info_for(new.items())
    first, second = (f"model.layers.{i}.self_attn.q_proj.weight" for i in (0, 1))
    twice = {**info, "names": [first if n == second else n for n in info["names"]]}
    copies = 2 * len(new)  # as many tensors as may come, too many bytes
    huge = {"names": ["model.embed_tokens.weight"] * copies,
            "dtype_names": ["float32"] * copies,
            "shapes": [list(new["model.embed_tokens.weight"].shape)] * copies}
    groups: list = []

    def send() -> threading.Thread:
        thread = threading.Thread(target=trainer_send_weights, args=(new.items(), groups[0]),
                                  daemon=True)
        thread.start()
        return thread

    with LLM(str(model_dir), weight_transfer_config={"backend": "nccl"},
             kv_cache_memory_bytes=8 * 2**20, multiprocess=False) as llm:
        before = greedy(llm)
        joiner = threading.Thread(target=lambda: groups.append(trainer_init(init_info, "cpu")),
                                  daemon=True)
        joiner.start()
        llm.init_weight_transfer_engine({"init_info": init_info})
        joiner.join(60)
        try:
            llm.start_weight_update()
            trainer = send()
            with pytest.raises(RuntimeError, match=rf"old weights kept: {first} appears more "
                                                   r"than once"):
                llm.update_weights({"update_info": twice})
            trainer.join(60)
            assert not trainer.is_alive()  # every broadcast was taken
            assert greedy(llm) == before
            with pytest.raises(RuntimeError, match=r"larger than the model allows \(\d+\); "
                                                   r"refused, nothing copied or received"):
                llm.update_weights({"update_info": huge})  # the trainer sends nothing
            trainer = send()
            assert llm.update_weights({"update_info": info}) == len(new)
            trainer.join(60)
            llm.finish_weight_update()
            assert greedy(llm) != before  # the good update landed, in step
        finally:
            for group in groups:
                group.close()


def test_phases_out_of_order_and_bad_init_info_are_errors(model_dirs):
    with LLM(str(model_dirs["llama"]), weight_transfer_config={"backend": "nccl"},
             kv_cache_memory_bytes=8 * 2**20, multiprocess=False) as llm:
        with pytest.raises(RuntimeError, match="start_weight_update first"):
            llm.finish_weight_update()
        with pytest.raises(RuntimeError, match="init_weight_transfer_engine first"):
            llm.update_weights({"update_info": {"names": [], "dtype_names": [],
                                                "shapes": []}})
        with pytest.raises(RuntimeError, match="world_size"):
            llm.init_weight_transfer_engine({"init_info": {
                "master_address": "127.0.0.1", "master_port": 1, "world_size": 1}})
        with pytest.raises(ValueError, match="init_info"):
            llm.init_weight_transfer_engine({"master_port": 1})
        # vLLM's packed broadcasts (many tensors per buffer) are not spoken here:
        # received one tensor at a time they would load garbage, so they are refused.
        empty = {"names": [], "dtype_names": [], "shapes": []}
        with pytest.raises(ValueError, match="packed broadcasts are not supported"):
            llm.update_weights({"update_info": {**empty, "packed": True}})
        with pytest.raises(ValueError, match=r"unknown field.*is_checkpoint_format"):
            llm.update_weights({"update_info": {**empty, "is_checkpoint_format": True}})
        with pytest.raises(RuntimeError, match="init_weight_transfer_engine first"):
            llm.update_weights({"update_info": {**empty, "packed": False,
                                                "packed_num_buffers": 2}})


def test_an_init_that_no_trainer_joins_fails_alone_naming_where_it_looked(model_dirs):
    """Issue 37, item 1, in process (the client steps the engine while the join waits):
    the join gives up after init_timeout_s naming the address; the next init starts
    clean; a host name beyond any DNS name is refused before anything connects."""
    port = free_port()
    info = {"init_info": {"master_address": "127.0.0.1", "master_port": port,
                          "world_size": 2}}
    with LLM(str(model_dirs["llama"]), weight_transfer_config={"backend": "nccl",
                                                               "init_timeout_s": 1},
             kv_cache_memory_bytes=8 * 2**20, multiprocess=False) as llm:
        for _ in range(2):  # a failed join leaves nothing behind: the second is the same
            start = time.monotonic()
            with pytest.raises(RuntimeError, match=rf"could not join the trainer's "
                                                   rf"weight-transfer group at 127.0.0.1:"
                                                   rf"{port} as rank 1 within "
                                                   rf"init_timeout_s=1"):
                llm.init_weight_transfer_engine(info)
            assert 1 <= time.monotonic() - start < 30
        with pytest.raises(RuntimeError, match="master_address must be a host name"):
            llm.init_weight_transfer_engine({"init_info": {
                **info["init_info"], "master_address": "x" * 254}})
        assert greedy(llm, PROMPTS[:1])


# --- sleep and wake ---------------------------------------------------------------------


def test_level_1_wakes_to_the_same_tokens_and_level_2_to_the_pushed_weights(model_dirs):
    model_dir = model_dirs["qwen2"]
    with LLM(str(model_dir), enable_sleep_mode=True, weight_transfer_config={"backend": "ipc"},
             kv_cache_memory_bytes=8 * 2**20) as llm:
        before = greedy(llm)
        llm.sleep(level=1)
        assert llm.is_sleeping()
        assert llm.wake_up() is True and not llm.is_sleeping()
        assert greedy(llm) == before
        llm.sleep(level=2)
        assert llm.wake_up(tags=["weights"]) is False  # the KV cache still sleeps
        assert llm.is_sleeping()
        new = perturbed(model_dir, seed=3)
        llm.update_weights(new.items())
        assert llm.wake_up(tags=["kv_cache"]) is True
        reference = hf_model(model_dir, new)
        out = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in out] == [
            hf_greedy(reference, o.prompt_token_ids, 10) for o in out]
        assert_no_leaks(llm)


def test_a_level_2_wake_refuses_requests_until_every_weight_is_loaded(model_dirs):
    """Issue 37, item 7: woken from level 2 with no weights loaded, the engine served
    garbage. Requests are refused (naming the state) while any checkpoint tensor has not
    been loaded since, a partial update included; the full update serves transformers'
    tokens on the new weights."""
    model_dir = model_dirs["llama"]
    new = perturbed(model_dir, seed=5)
    names = sorted(new)
    with LLM(str(model_dir), enable_sleep_mode=True, weight_transfer_config={"backend": "ipc"},
             kv_cache_memory_bytes=8 * 2**20) as llm:
        greedy(llm)
        llm.sleep(level=2)
        assert llm.wake_up() is True and not llm.is_sleeping()
        with pytest.raises(ValueError, match=rf"discarded by sleep\(level=2\) and "
                                             rf"{len(names)} of {len(names)} checkpoint"):
            llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
        half = names[: len(names) // 2]
        llm.update_weights([(n, new[n]) for n in half])
        with pytest.raises(ValueError, match=rf"{len(names) - len(half)} of {len(names)} "
                                             "checkpoint tensors have not been loaded"):
            llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
        llm.update_weights([(n, new[n]) for n in names[len(half):]])
        reference = hf_model(model_dir, new)
        out = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in out] == [
            hf_greedy(reference, o.prompt_token_ids, 10) for o in out]
        assert_no_leaks(llm)


def test_asleep_requests_fail_naming_the_state_and_waking_twice_is_harmless(model_dirs):
    with LLM(str(model_dirs["llama"]), enable_sleep_mode=True,
             kv_cache_memory_bytes=8 * 2**20) as llm:
        before = greedy(llm)
        llm.sleep(level=1)
        llm.sleep(level=1)  # twice: a no-op (frameworks call worker-level sleep directly)
        with pytest.raises(ValueError, match=r"sleeping \(level 1.*wake_up\(\)"):
            llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
        with pytest.raises(RuntimeError, match="call wake_up"):
            llm.resume_generation()
        assert llm.wake_up(["kv_cache"]) is False
        assert llm.wake_up(["kv_cache"]) is False  # already awake: nothing changes
        assert llm.wake_up(["weights"]) is True
        assert llm.wake_up() is True
        assert greedy(llm) == before
        llm.sleep(level=0)  # scheduling only
        assert llm.is_sleeping() and llm.is_paused()
        assert llm.wake_up(["scheduling"]) is True
        assert greedy(llm) == before
        assert_no_leaks(llm)


def test_sleep_levels_need_enable_sleep_mode_and_bad_arguments_name_the_call(model_dirs):
    with LLM(str(model_dirs["llama"]), kv_cache_memory_bytes=8 * 2**20,
             multiprocess=False) as llm:
        with pytest.raises(RuntimeError, match="enable_sleep_mode=True"):
            llm.sleep(level=1)
        assert not llm.is_sleeping()
        with pytest.raises(RuntimeError, match="bad arguments for sleep"):
            llm.sleep(level=3)
        with pytest.raises(RuntimeError, match="bad arguments for wake_up"):
            llm.wake_up(tags=["everything"])
        with pytest.raises(RuntimeError, match="bad arguments for pause"):
            llm.pause_generation(mode="later")
        assert greedy(llm, PROMPTS[:1])


def test_the_weight_backup_is_one_buffer_of_exactly_the_weights_bytes():
    """A level-1 backup on CUDA is one host buffer, pinned as a whole (torch's pinned
    allocator would round each parameter up to a power of two): every parameter has an
    aligned view of its own in it, none overlapping, and the buffer is no larger than
    their bytes plus alignment."""
    from pagellm.executor.worker.memory import host_views
    from pagellm.weights.shm import ALIGN

    params = [(f"p{i}", torch.nn.Parameter(torch.randn(*shape).to(dtype)))
              for i, (shape, dtype) in enumerate([((3, 5), torch.float32),
                                                  ((7,), torch.bfloat16),
                                                  ((0, 4), torch.float16),
                                                  ((33, 3), torch.float32)])]
    buffer, views = host_views(params)
    nbytes = [p.numel() * p.element_size() for _, p in params]
    assert sum(nbytes) <= buffer.numel() < sum(nbytes) + len(params) * ALIGN
    spans = []
    for (name, p), size in zip(params, nbytes, strict=True):
        view = views[name]
        assert view.shape == p.shape and view.dtype == p.dtype
        start = view.data_ptr() - buffer.data_ptr()
        assert start % ALIGN == 0 and start + size <= buffer.numel()
        spans.append((start, start + size))
        view.copy_(p.data)
    spans.sort()
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    for name, p in params:
        assert torch.equal(views[name], p.data)


def test_sleeping_gives_the_memory_back_to_the_system(big_config):
    """RSS of the engine process, measured from outside: level 1 frees the KV cache
    (the part that was written), level 2 also the ~80 MB of weights."""
    with LLM(str(big_config), load_format="dummy", skip_tokenizer_init=True,
             enable_sleep_mode=True, kv_cache_memory_bytes=64 * 2**20, max_model_len=1024,
             max_num_batched_tokens=4096) as llm:
        bytes_per_token = 4 * 2 * 2 * 64 * 4  # layers x K|V x kv_heads x head_dim x fp32
        # Write ~45 MiB of KV: 11 distinct prompts of 1000 tokens (freed blocks go to the
        # back of the free queue, so each prompt writes blocks no other one wrote).
        prompts = [{"prompt_token_ids": [(7 * i + j) % 8000 + 1 for j in range(1000)]}
                   for i in range(11)]
        llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
        written = 11 * 1000 * bytes_per_token
        weights = parameter_count(big_config) * 4  # fp32
        time.sleep(0.2)
        awake = rss(llm)
        llm.sleep(level=1)
        level1 = rss(llm)
        assert awake - level1 > 0.8 * written, (awake, level1, written)
        llm.wake_up()
        llm.sleep(level=2)
        level2 = rss(llm)
        assert awake - level2 > 0.8 * (written + weights), (awake, level2, written + weights)
        assert llm.wake_up() is True  # fresh, unwritten memory: the RSS grows as it is used


def test_the_roll_guide_configuration_works_as_written(big_config):
    with LLM(str(big_config), gpu_memory_utilization=0.8, block_size=16, max_model_len=8000,
             load_format="dummy", enable_sleep_mode=True, skip_tokenizer_init=True) as llm:
        params = SamplingParams(n=4, top_p=0.99, top_k=100, temperature=0.99, max_tokens=8)
        outputs = llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], params, use_tqdm=False)
        assert len(outputs[0].outputs) == 4
        assert all(len(c.token_ids) == 8 for c in outputs[0].outputs)
        llm.sleep(level=1)
        llm.wake_up()
        outputs = llm.generate([{"prompt_token_ids": [5, 6]}], params, use_tqdm=False)
        assert len(outputs[0].outputs) == 4


@pytest.mark.slow
def test_fifty_cycles_of_sleep_update_wake_leak_nothing(model_dirs):
    model_dir = model_dirs["llama"]
    weights = [perturbed(model_dir, seed=s) for s in range(2)]
    with LLM(str(model_dir), enable_sleep_mode=True, weight_transfer_config={"backend": "ipc"},
             kv_cache_memory_bytes=8 * 2**20) as llm:
        results = []
        for cycle in range(50):
            results.append(greedy(llm, PROMPTS[:2]))
            llm.sleep(level=2 if cycle % 2 else 1)
            llm.wake_up(["weights"])
            llm.update_weights(weights[cycle % 2].items())
            assert llm.wake_up() is True
            if cycle == 4:
                baseline = rss(llm)
            assert_no_leaks(llm)
        assert rss(llm) - baseline < 16 * 2**20  # no growth cycle over cycle
        # Same weights, same tokens, whichever path (level 1 or 2) led there.
        assert all(r == results[1] for r in results[1::2])
        assert all(r == results[2] for r in results[2::2])
        assert not leftover_buffers()


# --- pause and resume (AsyncLLM: requests in flight) ------------------------------------


async def _collect(engine: AsyncLLM, prompt, params, request_id, started=None):
    final = None
    async for out in engine.generate(prompt, params, request_id=request_id):
        final = out
        if started is not None:
            started.set()
    return final


async def _running(engine: AsyncLLM, prompt, params, request_id) -> asyncio.Task:
    """A request collected in the background, returned once its first token is out: a
    fixed wait instead raced the engine, which may finish a short request in that time."""
    started = asyncio.Event()
    task = asyncio.create_task(_collect(engine, prompt, params, request_id, started))
    await asyncio.wait_for(started.wait(), 30)
    return task


def test_pause_in_each_mode_with_requests_in_flight(model_dirs):
    model_dir = model_dirs["llama"]
    # 1500 tokens (~1 s here): still running when each pause lands, on a slow CI too.
    long = SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True)

    async def main() -> None:
        engine = AsyncLLM(str(model_dir), kv_cache_memory_bytes=8 * 2**20)
        try:
            reference = await _collect(engine, PROMPTS[1], long, "ref")
            # abort: in-flight requests end now, with reason "abort"
            task = await _running(engine, PROMPTS[1], long, "a")
            await engine.pause_generation(mode="abort")
            aborted = await asyncio.wait_for(task, 30)
            assert aborted.outputs[0].finish_reason == "abort"
            assert len(aborted.outputs[0].token_ids) < 1500
            with pytest.raises(ValueError, match=r"paused.*resume_generation"):
                await _collect(engine, PROMPTS[0], long, "refused")
            await engine.resume_generation()
            # wait: the call returns when they are done, and they finish normally
            task = await _running(engine, PROMPTS[1], long, "w")
            await engine.pause_generation(mode="wait")  # returns once "w" has finished
            assert await engine.is_paused()
            waited = await asyncio.wait_for(task, 30)
            assert waited.outputs[0].finish_reason == "length"
            assert waited.outputs[0].token_ids == reference.outputs[0].token_ids
            await engine.resume_generation()
            # keep: frozen in place, then continued: the same tokens as never paused
            task = await _running(engine, PROMPTS[1], long, "k")
            await engine.pause_generation(mode="keep")
            late = asyncio.create_task(_collect(engine, PROMPTS[1], long, "late"))
            stats = await engine.get_stats()
            await asyncio.sleep(0.5)
            assert not task.done() and not late.done()
            assert (await engine.get_stats()).num_steps == stats.num_steps  # frozen
            await engine.resume_generation()
            kept, queued = await asyncio.wait_for(asyncio.gather(task, late), 60)
            assert kept.outputs[0].token_ids == reference.outputs[0].token_ids
            assert queued.outputs[0].token_ids == reference.outputs[0].token_ids
            stats = await engine.get_stats()
            assert stats.num_free_blocks == stats.num_total_blocks
        finally:
            engine.shutdown()

    asyncio.run(main())


def test_a_waiting_pause_that_is_resumed_before_it_settles_says_so(model_dirs):
    """Review 2: sleep(mode="wait") answered "sleeping" after a wake_up had resumed the
    engine meanwhile (nothing freed): a trainer acting on that answer could run out of
    memory. Both a waiting sleep and a waiting pause now fail, saying why."""
    long = SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True)

    async def main() -> None:
        engine = AsyncLLM(str(model_dirs["llama"]), kv_cache_memory_bytes=8 * 2**20,
                          enable_sleep_mode=True)
        try:
            for start in (lambda: engine.sleep(1, mode="wait"),
                          lambda: engine.pause_generation(mode="wait")):
                task = await _running(engine, PROMPTS[1], long, f"r{id(start)}")
                waiting = asyncio.create_task(start())
                await asyncio.sleep(0.2)
                assert not waiting.done()  # the request still runs
                await engine.wake_up()
                with pytest.raises(RuntimeError, match=r"resumed .* before the pause settled"):
                    await asyncio.wait_for(waiting, 60)
                assert not await engine.is_sleeping()
                assert (await asyncio.wait_for(task, 60)).outputs[0].finish_reason == "length"
        finally:
            engine.shutdown()

    asyncio.run(main())


def test_sleep_in_keep_mode_continues_the_requests_after_waking(model_dirs):
    """Their KV is freed with the cache: they recompute after waking, same tokens."""
    model_dir = model_dirs["llama"]
    long = SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True)

    async def main() -> None:
        engine = AsyncLLM(str(model_dir), enable_sleep_mode=True,
                          kv_cache_memory_bytes=8 * 2**20)
        try:
            reference = await _collect(engine, PROMPTS[2], long, "ref")
            task = await _running(engine, PROMPTS[2], long, "k")
            await engine.sleep(level=1, mode="keep")
            assert await engine.is_sleeping() and not task.done()
            assert await engine.wake_up() is True
            kept = await asyncio.wait_for(task, 60)
            assert kept.outputs[0].token_ids == reference.outputs[0].token_ids
        finally:
            engine.shutdown()

    asyncio.run(main())


# --- collective_rpc ---------------------------------------------------------------------


@pytest.mark.parametrize("multiprocess", [False, True])
def test_collective_rpc_calls_extension_methods_by_name(model_dirs, monkeypatch,
                                                        multiprocess):
    monkeypatch.setenv("PYTHONPATH", str(SUPPORT))  # the engine process imports rl_extension
    model_dir = model_dirs["llama"]
    weights = checkpoint(model_dir)
    with LLM(str(model_dir), worker_extension_cls="rl_extension.Probe",
             weight_transfer_config={"backend": "ipc"}, kv_cache_memory_bytes=8 * 2**20,
             multiprocess=multiprocess) as llm:
        [checksum] = llm.collective_rpc("weight_checksum")
        expected = float(sum(t.double().sum() for t in weights.values()))
        assert abs(checksum - expected) < 1e-6 * max(1.0, abs(expected))
        [rows] = llm.collective_rpc("embedding_rows", args=(torch.tensor([3, 5]),))
        assert torch.equal(rows, weights["model.embed_tokens.weight"][[3, 5]])
        assert llm.collective_rpc("describe", args=("x",), kwargs={"scale": 2.5}) == [
            {"prefix": "x", "scale": 2.5, "rank": 0}]
        with pytest.raises(RuntimeError, match=r"collective_rpc.*unknown method '_private'"):
            llm.collective_rpc("_private")
        with pytest.raises(RuntimeError, match="probe failed on purpose"):
            llm.collective_rpc("fail")
        # What the wire cannot carry is refused in-process too (it used to pass there).
        with pytest.raises(TypeError, match="Encoding objects of type object"):
            llm.collective_rpc("describe", args=(object(),))
        if multiprocess:  # a timeout is an error for the caller; the engine goes on
            with pytest.raises(TimeoutError, match=r"collective_rpc timed out after 0\.5 s"):
                llm.collective_rpc("nap", timeout=0.5, args=(2.0,))
        assert greedy(llm, PROMPTS[:1])
        assert_no_leaks(llm)


def test_an_extension_loads_weights_one_tensor_at_a_time_as_with_vllm(model_dirs,
                                                                    monkeypatch):
    """RL frameworks' worker extensions (TRL, OpenRLHF) call
    `self.model_runner.model.load_weights(weights=[(name, tensor)])` per tensor, as
    vLLM's models allow: every tensor pushed that way, the engine gives transformers'
    tokens on the new weights (q/k/v and gate/up land in their merged parameters). A name
    the model lacks fails the call, naming it."""
    monkeypatch.setenv("PYTHONPATH", str(SUPPORT))
    model_dir = model_dirs["qwen2"]
    weights = perturbed(model_dir, seed=11)
    with LLM(str(model_dir), worker_extension_cls="rl_extension.Probe",
             kv_cache_memory_bytes=8 * 2**20) as llm:
        greedy(llm)  # fills the prefix cache with the old weights' KV
        for name, tensor in weights.items():
            assert llm.collective_rpc("load_named", args=(name, tensor)) == [[name]]
        assert llm.reset_prefix_cache()
        reference = hf_model(model_dir, weights)
        out = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in out] == [
            hf_greedy(reference, o.prompt_token_ids, 10) for o in out]
        with pytest.raises(RuntimeError, match=r"no such weight in the model: "
                                               r"\['model\.nope\.weight'\]"):
            llm.collective_rpc("load_named", args=("model.nope.weight", torch.zeros(2)))
        assert_no_leaks(llm)


def test_collective_rpc_without_an_extension_and_a_bad_extension(model_dirs):
    with LLM(str(model_dirs["llama"]), kv_cache_memory_bytes=8 * 2**20,
             multiprocess=False) as llm, \
            pytest.raises(RuntimeError, match="set worker_extension_cls"):
        llm.collective_rpc("weight_checksum")
    with pytest.raises(ValueError, match="cannot be imported"):
        LLM(str(model_dirs["llama"]), worker_extension_cls="no_such_module.Class",
            kv_cache_memory_bytes=8 * 2**20, multiprocess=False)


def test_cli_takes_the_rl_options_as_vllm_spells_them():
    import argparse

    from pagellm.protocol.engine_args import EngineArgs

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args([
        "--model", "m", "--enable-sleep-mode", "--weight-transfer-config",
        json.dumps({"backend": "ipc"}), "--worker-extension-cls", "pkg.mod.Ext"]))
    assert args.enable_sleep_mode and args.weight_transfer_config == {"backend": "ipc"}
    assert EngineArgs.from_cli_args(parser.parse_args(args.to_cli_args())) == args
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--weight-transfer-config", "{not json"])
    with pytest.raises(ValueError, match="weight_transfer_config must be"):
        EngineArgs(model="m", weight_transfer_config={"backend": "carrier-pigeon"})
    with pytest.raises(ValueError, match="weight_transfer_config must be"):
        EngineArgs(model="m", weight_transfer_config={"init_timeout_s": 5})
    for bad in (0, -1, float("inf"), 10**6):
        with pytest.raises(ValueError, match="init_timeout_s"):
            EngineArgs(model="m", weight_transfer_config={"backend": "nccl",
                                                          "init_timeout_s": bad})


# --- the HTTP dev routes ----------------------------------------------------------------


def test_get_world_size_counts_every_worker_as_vllm_does():
    """Tensor-parallel ranks times engine cores (without the cores: include_dp=false):
    what a trainer sizes its weight-transfer group by. The engine's own figures come
    from its EngineInfo (checked in test_tensor_parallel and test_data_parallel)."""
    from types import SimpleNamespace

    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from pagellm.frontend.server.dev_routes import add_dev_routes
    from pagellm.protocol.messages import EngineInfo

    app = FastAPI()
    info = EngineInfo("m", 64, 100, 16, 8, 64, "cuda:0", "bfloat16", world_size=4,
                      data_parallel_size=2)
    add_dev_routes(app, SimpleNamespace(info=info), None)  # type: ignore[arg-type]
    with TestClient(app) as client:
        assert client.get("/get_world_size").json() == {"world_size": 8}
        assert client.get("/get_world_size?include_dp=false").json() == {"world_size": 4}


def test_dev_routes_drive_sleep_pause_rpc_and_nccl_updates_over_http(model_dirs, monkeypatch):
    from helpers import NAME, Server

    monkeypatch.setenv("PYTHONPATH", str(SUPPORT))
    model_dir = model_dirs["llama"]
    # Off unless asked for: tests/frontend/server/test_hardening_http.py checks the 404s.
    server = Server(model_dir, "--enable-dev-endpoints", "--enable-sleep-mode",
                    "--weight-transfer-config", '{"backend": "nccl"}',
                    "--worker-extension-cls", "rl_extension.Probe", "--api-key", "k")
    key = {"Authorization": "Bearer k"}
    trainer: NcclTrainer | None = None
    try:
        def call(method: str, path: str, body: object = None) -> tuple[int, dict]:
            status, data = server.request(method, path, body, headers=key)
            return status, json.loads(data)

        def complete() -> str:
            response = server.client("k").completions.create(
                model=NAME, prompt=PROMPTS[1],
                max_tokens=8, temperature=0)
            return response.choices[0].text

        assert server.request("POST", "/sleep?level=1")[0] == 401  # behind the API key
        before = complete()
        assert call("POST", "/sleep?level=1") == (200, {"status": "sleeping", "level": 1})
        assert call("GET", "/is_sleeping") == (200, {"is_sleeping": True})
        status, body = call("POST", "/v1/completions", {
            "model": NAME, "prompt": "x", "max_tokens": 2})
        assert status == 503 and "sleeping" in body["error"]["message"]
        assert call("POST", "/wake_up?tags=kv_cache") == (
            200, {"status": "sleeping", "tags": ["kv_cache"]})
        assert call("POST", "/wake_up") == (200, {"status": "awake", "tags": None})
        assert complete() == before
        assert call("POST", "/pause?mode=keep") == (200, {"status": "paused"})
        assert call("GET", "/is_paused") == (200, {"is_paused": True})
        assert call("POST", "/resume") == (200, {"status": "resumed"})
        for path in ("/sleep?level=7", "/sleep?level=x", "/pause?mode=soon",
                     "/wake_up?tags=everything"):
            status, body = call("POST", path)
            assert status == 400 and body["error"]["message"], path
        assert call("GET", "/get_world_size") == (200, {"world_size": 1})
        assert call("GET", "/get_world_size?include_dp=false") == (200, {"world_size": 1})
        assert call("POST", "/reset_prefix_cache") == (200, {"reset": True})
        status, body = call("POST", "/collective_rpc", {"method": "describe", "args": ["p"],
                                                        "kwargs": {"scale": 3.0}})
        assert (status, body) == (200, {"results": [{"prefix": "p", "scale": 3.0,
                                                     "rank": 0}]})
        status, body = call("POST", "/collective_rpc", {"method": "fail"})
        assert status == 400 and "probe failed on purpose" in body["error"]["message"]
        status, body = call("POST", "/collective_rpc", {"method": "nap", "args": [2.0],
                                                        "timeout": 0.3})
        assert status == 504
        # The weight-update phases with a trainer broadcasting (gloo).
        init_info = {"master_address": "127.0.0.1", "master_port": free_port(),
                     "rank_offset": 1, "world_size": 2}
        trainer = NcclTrainer(model_dir, init_info)
        trainer.guard(server.engine_pid())
        assert call("POST", "/init_weight_transfer_engine", {"init_info": init_info}) == (
            200, {"message": "Weight transfer initialized"})
        update_info = trainer.joined()["update_info"]
        assert call("POST", "/start_weight_update")[0] == 200
        trainer.send()
        assert call("POST", "/update_weights", {"update_info": update_info}) == (
            200, {"message": "Weights updated"})
        assert call("POST", "/finish_weight_update", {"weight_version": "1"})[0] == 200
        assert trainer.finish() == 0
        reference = hf_model(model_dir, perturbed(model_dir, seed=7))
        ids = server.post("/tokenize", {"prompt": PROMPTS[1]}, headers=key)[1]["tokens"]
        tokens = hf_greedy(reference, ids, 8)
        from transformers import AutoTokenizer

        assert complete() == AutoTokenizer.from_pretrained(model_dir).decode(tokens)
    finally:
        if trainer is not None:
            trainer.stop()
        assert server.stop() == 0


@pytest.mark.slow
def test_the_rl_rollout_example_raises_the_reward_with_matching_logprobs():
    """examples/rl_rollout.py end to end: generate, sleep, train (another process),
    push over the nccl backend, wake; the reward rises and the engine's logprobs of the
    sampled tokens equal the trainer's within 1e-4 (fp32)."""
    result = subprocess.run([sys.executable, str(ROOT / "examples/rl_rollout.py"),
                             "--iterations", "6"], capture_output=True, text=True,
                            timeout=600, check=True)
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["last_reward"] > summary["first_reward"] + 0.2, summary
    assert summary["max_mismatch"] <= 1e-4, summary


def test_a_small_dev_shm_falls_back_to_the_temp_dir_or_names_the_shortage(monkeypatch):
    """Containers often give /dev/shm 64 MiB: a bigger update goes through the temp
    directory instead, and when nothing has room the error says what to enlarge."""

    from pagellm.weights import shm as weight_transfer

    real = os.statvfs

    def small_shm(path):
        stats = real(path)
        if str(path) == "/dev/shm":
            return os.statvfs_result((stats.f_bsize, 4096, 100, 100, 100, *stats[5:]))
        return stats

    monkeypatch.setattr(weight_transfer.os, "statvfs", small_shm)
    dirs = buffer_dirs()
    assert shm_dir(1 << 20) == dirs[-1]  # 1 MiB does not fit in 400 KiB of /dev/shm
    with shared_weights([("w", torch.ones(512, 512))]) as update:
        assert Path(update.buffer).parent == dirs[-1]
    monkeypatch.setattr(weight_transfer.os, "statvfs", lambda path: os.statvfs_result(
        (4096, 4096, 1, 1, 1, 0, 0, 0, 0, 255)))
    with pytest.raises(ValueError, match=r"no room for a 1 MiB weight buffer.*shm-size"):
        shm_dir(1 << 20)
