"""vLLM's `vllm.distributed.device_communicators.pynccl`: `PyNcclCommunicator`, which
OpenRLHF's trainer and its `WorkerWrap` extension broadcast weights through
(`group.broadcast(weight, src=0, stream=...)`).

Here it is pagellm's `WeightGroup` (weights/nccl.py) joined at the
`StatelessProcessGroup`'s address: NCCL when every member holds a distinct GPU, gloo over
host memory otherwise (on the CPU, or a GPU shared by trainer and engine, which NCCL
refuses). Only the broadcast from rank 0 is served: the one collective weight sync
uses; vLLM's other collectives are absent, so a call to one fails naming it."""

from __future__ import annotations

from typing import Any

import torch

from pagellm.vllm.distributed.utils import StatelessProcessGroup
from pagellm.weights.nccl import TransferInit, WeightGroup


class PyNcclCommunicator:
    """`rank` of `world_size` in the group `group` names, on `device`."""

    def __init__(self, group: StatelessProcessGroup, device: int | str | torch.device,
                 library_path: str | None = None) -> None:
        if not isinstance(group, StatelessProcessGroup):
            raise TypeError("PyNcclCommunicator takes a StatelessProcessGroup "
                            f"(StatelessProcessGroup.create), got {type(group).__name__}")
        if isinstance(device, int):
            device = torch.device("cuda", device)
        init = TransferInit(master_address=group.host, master_port=group.port,
                            world_size=group.world_size)
        self._adopt(group, WeightGroup(init, rank=group.rank, device=torch.device(device),
                                       join_timeout_s=float(group.store_timeout)))

    @classmethod
    def of(cls, group: StatelessProcessGroup, joined: WeightGroup) -> PyNcclCommunicator:
        """The communicator of a group already joined (the trainer's side of
        `init_weight_transfer_engine`, `nccl_common.trainer_init`)."""
        communicator = cls.__new__(cls)
        communicator._adopt(group, joined)
        return communicator

    def _adopt(self, group: StatelessProcessGroup, joined: WeightGroup) -> None:
        self.group, self._group = group, joined
        self.device = joined.device
        self.rank, self.world_size = group.rank, group.world_size
        self.available, self.disabled = True, False  # vLLM's flags

    def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
        """In place: rank `src`'s tensor overwrites everyone else's. Only src=0 (the
        trainer) is served. `stream`: CUDA work before the call is complete first."""
        if src != 0:
            raise ValueError(f"broadcast: only src=0 (the trainer) is served, got {src}")
        if tensor.device.type == "cuda":
            torch.cuda.current_stream(tensor.device).synchronize()
        if tensor.device == self.device:
            self._group.broadcast(tensor)
            return
        # A gloo group (the trainer and the engine share a GPU, which NCCL refuses)
        # moves host tensors: stage through host memory.
        staged = tensor.to(self.device)
        self._group.broadcast(staged)
        tensor.copy_(staged)

    def close(self) -> None:
        self._group.close()


__all__ = ["PyNcclCommunicator"]
