"""The "ipc" weight-transfer backend's device half: CUDA IPC handles.

When every tensor is on a GPU and the engine runs on CUDA in another process, the
sender packs the tensors into one device buffer (a copy at device speed, no trip
through host memory) and shares it through torch's CUDA IPC, once per receiving
worker. Each worker maps it, checks every spec against it exactly as for a
shared-memory file, copies, and lets go of it before answering; the sender frees the
buffer when the call returns. These paths run only on a GPU (tests/e2e/test_gpu_rl.py).

Everything but the handles (layout, packing, the checks on each spec) is the
shared-memory path's, in shm.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch

from pagellm.protocol.utility import CudaIpcBuffer, WeightUpdate
from pagellm.weights.shm import ALIGN, check_weights, layout, pack, views


def cuda_ipc_usable(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether these tensors can travel by CUDA IPC: all on CUDA (and at least one)."""
    devices = {t.device.type for t in tensors}
    return devices == {"cuda"}


@contextlib.contextmanager
def cuda_ipc_weights(weights: Iterable[tuple[str, torch.Tensor]],
                     receivers: int) -> Iterator[WeightUpdate]:
    """Pack CUDA `(checkpoint name, tensor)` pairs into one device buffer on the first
    tensor's GPU and share it `receivers` times (one share per worker that will open
    it); yields the `WeightUpdate`. The buffer is freed afterwards."""
    pairs = list(weights)
    check_weights(pairs)
    if not pairs or not cuda_ipc_usable(t for _, t in pairs):
        raise ValueError("CUDA IPC carries CUDA tensors only")
    specs, size = layout(pairs)
    device = pairs[0][1].device
    buffer = torch.empty(max(size, ALIGN), dtype=torch.uint8, device=device)  # [bytes]
    pack(pairs, specs, buffer)
    torch.cuda.synchronize(device)  # written before anyone maps it
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    try:
        shares = [_share(buffer, uuid) for _ in range(receivers)]
        yield WeightUpdate(specs, buffer_bytes=size, cuda_ipc=shares)
    finally:
        del buffer
        torch.cuda.ipc_collect()  # free it now if a receiver let go only after returning


def _share(buffer: torch.Tensor, uuid: str) -> CudaIpcBuffer:
    (_, handle, size, offset, ref_counter, ref_counter_offset, event_handle,
     event_sync_required) = buffer.untyped_storage()._share_cuda_()
    return CudaIpcBuffer(uuid, handle, size, offset, ref_counter, ref_counter_offset,
                         event_handle, bool(event_sync_required))


@contextlib.contextmanager
def open_cuda_ipc(update: WeightUpdate, receiver: int
                  ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The update's tensors as views of the sender's device buffer (share number
    `receiver`), valid inside the `with`; ValueError naming what is wrong. The share is
    released on leaving, whatever happened, so the sender can free its buffer."""
    shares = update.cuda_ipc or []
    if not 0 <= receiver < len(shares):
        raise ValueError(f"CUDA IPC update has {len(shares)} share(s); this is receiver "
                         f"{receiver} (one share per worker of every engine core)")
    share = shares[receiver]
    if not torch.cuda.is_available():
        raise ValueError("CUDA IPC handles reached an engine without CUDA; send host "
                         "tensors (they travel through shared memory)")
    index = _device_index(share.device_uuid)
    if index is None:
        torch.UntypedStorage._release_ipc_counter(share.ref_counter,
                                                  share.ref_counter_offset)
        raise ValueError(f"the weights lie on GPU {share.device_uuid}, which this engine's "
                         "worker cannot see (CUDA_VISIBLE_DEVICES); send host tensors")
    if share.buffer_bytes < update.buffer_bytes:
        torch.UntypedStorage._release_ipc_counter(share.ref_counter,
                                                  share.ref_counter_offset)
        raise ValueError(f"CUDA IPC buffer of {share.buffer_bytes} bytes is smaller than "
                         f"the update's {update.buffer_bytes}")
    storage = torch.UntypedStorage._new_shared_cuda(
        index, share.handle, share.buffer_bytes, share.offset_bytes, share.ref_counter,
        share.ref_counter_offset, share.event_handle, share.event_sync_required)
    raw = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", index))
    tensors: list[tuple[str, torch.Tensor]] = []
    try:
        raw.set_(storage)  # [buffer_bytes] uint8: the sender's buffer
        tensors.extend(views(raw, update.specs))
        yield tensors
    finally:
        torch.cuda.synchronize(index)  # every copy out of it is done
        tensors.clear()  # the caller's list too: no view outlives the share
        del raw, storage  # releases this share (torch's deleter decrements its counter)


def _device_index(uuid: str) -> int | None:
    """This process's index of the GPU with that UUID, or None if it cannot see it."""
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == uuid:
            return index
    return None
