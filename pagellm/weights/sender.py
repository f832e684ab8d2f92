"""What `LLM` and `AsyncLLM` share for weight updates: the argument they accept and
how it becomes a `WeightUpdate`: CUDA IPC shares of a device buffer when the tensors
are on a GPU and the engine's workers can open them, else a shared-memory file."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from pagellm.protocol.messages import EngineInfo
from pagellm.protocol.utility import WeightUpdate

if TYPE_CHECKING:
    import torch

# (checkpoint name, tensor) pairs; an update a trainer process already wrote; or vLLM's
# {"update_info": {"names", "dtype_names", "shapes"}} for tensors the trainer broadcasts.
WeightsArg = Iterable[tuple[str, "torch.Tensor"]] | WeightUpdate | dict[str, Any]


def cuda_ipc_receivers(info: EngineInfo, in_process: bool) -> int:
    """How many workers open a CUDA IPC update: every worker of every engine core. 0
    when CUDA IPC cannot reach them: an engine not on CUDA, or a single worker inside
    this very process (CUDA cannot open a process's own IPC handles)."""
    if not info.device.startswith("cuda") or (in_process and info.world_size == 1):
        return 0
    return info.world_size * info.data_parallel_size


@contextlib.contextmanager
def weight_update(weights: WeightsArg, cuda_receivers: int = 0) -> Iterator[WeightUpdate]:
    """The `WeightUpdate` to send; the buffer behind it lives for the call and is freed
    after it (torch is imported only here, not with the frontend). CUDA tensors go by
    CUDA IPC when `cuda_receivers` (see `cuda_ipc_receivers`) workers can open it."""
    if isinstance(weights, WeightUpdate):
        yield weights
        return
    from pagellm.weights.cuda_ipc import cuda_ipc_usable, cuda_ipc_weights
    from pagellm.weights.nccl import update_from_update_info
    from pagellm.weights.shm import check_weights, shared_weights

    if isinstance(weights, dict):
        if set(weights) != {"update_info"} or not isinstance(weights["update_info"], dict):
            raise ValueError('update_weights takes (name, tensor) pairs or '
                             '{"update_info": {"names", "dtype_names", "shapes"}}')
        yield update_from_update_info(weights["update_info"])
        return

    pairs = list(weights)
    check_weights(pairs)
    if cuda_receivers and pairs and cuda_ipc_usable(t for _, t in pairs):
        with cuda_ipc_weights(pairs, cuda_receivers) as update:
            yield update
        return
    with shared_weights(pairs) as update:
        yield update


def init_info_of(request: dict[str, Any]) -> dict[str, Any]:
    """vLLM's {"init_info": {...}} request, unwrapped."""
    if set(request) != {"init_info"} or not isinstance(request["init_info"], dict):
        raise ValueError('init_weight_transfer_engine takes {"init_info": {...}}')
    return request["init_info"]
