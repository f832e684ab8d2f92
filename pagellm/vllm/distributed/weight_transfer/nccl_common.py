"""vLLM's `vllm.distributed.weight_transfer.nccl_common`: `trainer_init`, the trainer's
side of `init_weight_transfer_engine` (TRL's `open_trainer_endpoint`), returning what
vLLM's does: a `PyNcclCommunicator` (for `packed_nccl_broadcast_producer(group=...)`)
whose `.group` is the StatelessProcessGroup (TRL clears its `store` and `socket` on
close)."""

from __future__ import annotations

from typing import Any

from pagellm.vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
from pagellm.vllm.distributed.utils import StatelessProcessGroup
from pagellm.weights import nccl


def trainer_init(init_info: dict[str, Any]) -> PyNcclCommunicator:
    """Join the engine's weight-transfer group as rank 0 (run it while the engine runs
    `init_weight_transfer_engine` with the same init_info: each waits for the other)."""
    joined = nccl.trainer_init(init_info)
    group = StatelessProcessGroup(init_info["master_address"], init_info["master_port"],
                                  0, init_info["world_size"])
    return PyNcclCommunicator.of(group, joined)


__all__ = ["trainer_init"]
