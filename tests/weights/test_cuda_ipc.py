"""weights/cuda_ipc.py and what guards it: the CUDA IPC shares a trainer on the same
GPU sends are checked where they enter (protocol/utility.py's decoder: torch trusts
their values), the sender's packing (weights/shm.py's layout: every tensor aligned,
read back exactly), which workers receive them (weights/sender.py), and a CPU engine
sent them fails alone. References: hand-built shares and tensors, compared exactly.
(The CUDA path itself is tests/e2e/test_gpu.py's and test_gpu_rl.py's.)"""

from __future__ import annotations

import msgspec
import pytest
import torch
from conftest import assert_no_leaks
from rl_helpers import greedy

from pagellm import LLM
from pagellm.weights.shm import shm_dir


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
