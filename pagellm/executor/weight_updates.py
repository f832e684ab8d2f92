"""One worker's weight updates: the checks every update passes before the first byte of
it is copied or received, and the three ways one arrives (CUDA IPC handles, a
shared-memory buffer, a broadcast over the weight-transfer group). A bad update changes
nothing: every name, shape and dtype is checked first, and the old weights keep serving.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import torch

from pagellm.executor import memory
from pagellm.executor.cuda_ipc import open_cuda_ipc
from pagellm.executor.models.decoder import DecoderForCausalLM, Destination
from pagellm.executor.weight_transfer import (
    TransferInit,
    UpdateTooLarge,
    WeightGroup,
    check_specs,
    open_update,
    receive,
)
from pagellm.protocol.utility import WeightUpdate


class WeightUpdates:
    """The weight-transfer side of one worker (`Worker.updates`).

    `config` is the engine's weight_transfer_config (None: updates refused);
    `global_rank` numbers this worker among every worker of every data-parallel engine
    core (vLLM's numbering: core by core, tensor-parallel ranks within each), of
    `workers` in all."""

    def __init__(self, model: DecoderForCausalLM, device: torch.device,
                 config: dict[str, Any] | None, world_size: int, global_rank: int,
                 workers: int) -> None:
        self.model, self.device, self.config = model, device, config
        self.global_rank, self.workers = global_rank, workers
        self.group: WeightGroup | None = None
        # The most one update may carry, on every path (`check_specs`): a broadcast is
        # received even when refused, and specs may point many times at one region of a
        # buffer. Each rank holds at least 1/world_size of every tensor, so a full
        # checkpoint is at most world_size x this rank's bytes; twice that for one sent
        # in a wider dtype (float32 to a 16-bit model). Taken while awake: asleep, the
        # parameters hold no bytes.
        self.limit = 2 * world_size * memory.parameter_bytes(model)
        # And at most twice the checkpoint's tensors (room for the ones we skip: RoPE
        # tables, a tied LM head's copy).
        self.max_specs = 2 * len(model.checkpoint_keys())

    def init_engine(self, init_info: dict[str, Any]) -> None:
        """Join the trainer's group (backend "nccl"; "ipc" needs nothing). Blocks until
        the trainer joins too, at most TRANSFER_TIMEOUT_S."""
        if self.config is None:
            raise RuntimeError("weight updates need the engine started with "
                               "weight_transfer_config")
        if self.config["backend"] != "nccl":
            return
        if self.group is not None:
            raise RuntimeError("the weight-transfer engine is already initialized")
        init = msgspec.convert(init_info, TransferInit)
        # Refused by every worker alike before any joins: a rank past the group's size
        # would wait out TRANSFER_TIMEOUT_S.
        if init.rank_offset + self.workers > init.world_size:
            raise ValueError(
                f"init_info world_size={init.world_size} cannot hold this engine's "
                f"{self.workers} worker(s) from rank_offset={init.rank_offset}: it needs at "
                f"least rank_offset + data_parallel_size x tensor_parallel_size = "
                f"{init.rank_offset + self.workers}")
        self.group = WeightGroup(init, rank=init.rank_offset + self.global_rank,
                                 device=self.device)

    def apply(self, update: WeightUpdate, weights_asleep: bool) -> int:
        """Copy the update's tensors into the model; the update as a whole (`_check`)
        and every name, shape and dtype are checked before the first copy. Returns the
        number of tensors loaded."""
        if update.cuda_ipc is not None:  # opened first: refused or not, released after
            with open_cuda_ipc(update, self.global_rank) as tensors:
                self._check(update, weights_asleep)
                self._load_checked(tensors)
                return len(tensors)
        if update.buffer is not None:
            self._check(update, weights_asleep)
            with open_update(update) as tensors:
                self._load_checked(tensors)
            return len(tensors)
        if self.group is None:
            if self.config is not None and self.config["backend"] != "nccl":
                raise RuntimeError(
                    "an update_info update (names, dtypes and shapes only) is broadcast "
                    "over backend 'nccl'; this engine's backend is "
                    f"{self.config['backend']!r}: send the tensors themselves")
            raise RuntimeError("a weight update without a buffer arrives over the "
                               "weight-transfer group: init_weight_transfer_engine first")
        # Every name and shape is checked before the first broadcast arrives, so the
        # tensors can load as they come (one in memory at a time); a refused update is
        # still received, into scratch, so the trainer never hangs; but not one larger
        # than the model allows, nor one with a spec that is no weight (`receive`
        # refuses it before the first broadcast): nothing of those is received.
        try:
            self._check(update, weights_asleep)
            dests = self._destinations([(spec.name, spec.shape) for spec in update.specs])
        except UpdateTooLarge:
            raise
        except (RuntimeError, ValueError):
            receive(self.group, update.specs, None)
            raise
        loaded = receive(self.group, update.specs, dests)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return loaded

    def _check(self, update: WeightUpdate, weights_asleep: bool) -> None:
        """What every path checks first, before any byte of the update is copied or
        received: that this engine takes updates, the update's size and names
        (`check_specs`), then that the weights are awake (after the size: an update
        refused while asleep is drained, one too large never is)."""
        if self.config is None:
            raise RuntimeError("weight updates need the engine started with "
                               "weight_transfer_config={'backend': 'ipc'}")
        check_specs(update.specs, self.limit, self.max_specs)
        if weights_asleep:
            raise RuntimeError("the weights are asleep; wake_up(tags=['weights']) first")

    def _destinations(self, shapes: list[tuple[str, Sequence[int]]]) -> list[Destination]:
        """Where each `(checkpoint name, full shape)` of an update loads on this rank
        (each rank takes its slice); ValueError naming every one that does not fit, so
        that a bad update changes nothing."""
        params = dict(self.model.named_parameters())
        dests, problems = [], []
        for name, shape in shapes:
            dest = self.model.destination(name, params)
            if dest is None:
                problems.append(f"{name}: no such weight in the model")
            elif dest.tensor is not None and dest.shape != tuple(shape):
                problems.append(f"{name}: shape {tuple(shape)}, the model's is {dest.shape}")
            else:
                dests.append(dest)
        if problems:
            more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
            raise ValueError(f"weight update refused, old weights kept: "
                             f"{'; '.join(problems[:8])}{more}")
        return dests

    def _load_checked(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Copy only when every tensor fits: a bad update changes nothing."""
        dests = self._destinations([(name, tensor.shape) for name, tensor in tensors])
        for dest, (_, tensor) in zip(dests, tensors, strict=True):
            dest.load(tensor, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the sources may go away on return
