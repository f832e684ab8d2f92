"""What `LLM` and `AsyncLLM` share for weight updates: the argument they accept and
how it becomes a `WeightUpdate` in shared memory."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from pagellm.protocol.utility import WeightUpdate

if TYPE_CHECKING:
    import torch

# (checkpoint name, tensor) pairs; an update a trainer process already wrote; or vLLM's
# {"update_info": {"names", "dtype_names", "shapes"}} for tensors the trainer broadcasts.
WeightsArg = Iterable[tuple[str, "torch.Tensor"]] | WeightUpdate | dict[str, Any]


@contextlib.contextmanager
def weight_update(weights: WeightsArg) -> Iterator[WeightUpdate]:
    """The `WeightUpdate` to send; pairs are written to shared memory for the call and
    deleted after it (torch is imported only here, not with the frontend)."""
    if isinstance(weights, WeightUpdate):
        yield weights
        return
    from pagellm.executor.weight_transfer import shared_weights, specs_from_update_info

    if isinstance(weights, dict):
        if set(weights) != {"update_info"} or not isinstance(weights["update_info"], dict):
            raise ValueError('update_weights takes (name, tensor) pairs or '
                             '{"update_info": {"names", "dtype_names", "shapes"}}')
        yield WeightUpdate(specs_from_update_info(weights["update_info"]))
        return

    with shared_weights(weights) as update:
        yield update


def init_info_of(request: dict[str, Any]) -> dict[str, Any]:
    """vLLM's {"init_info": {...}} request, unwrapped."""
    if set(request) != {"init_info"} or not isinstance(request["init_info"], dict):
        raise ValueError('init_weight_transfer_engine takes {"init_info": {...}}')
    return request["init_info"]
