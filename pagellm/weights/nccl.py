"""The "nccl" weight-transfer backend: a torch.distributed group with the trainer
(vLLM's `NCCLWeightTransferEngine`, its names and wire format). The trainer's side
(`trainer_init`, `trainer_send_weights`) and what both sides share (the group, the init
info, the update info); the engine's receiving side is the worker's
(executor/worker/weight_receiver.py).

vLLM's names: the trainer is rank 0 of a group of `world_size` (trainer + engine
workers); the engine's worker joins as `rank_offset + its rank`. The group is made
from a TCPStore directly (no init_process_group: the engine's own default group, if
any, is untouched). Its backend is agreed through that store: NCCL when every member
holds a GPU of its own (device to device, no host copy), otherwise gloo over host
tensors (on the CPU, or staged through host memory; also when the trainer and a
worker share a GPU, which NCCL refuses: the "ipc" backend is the fast path there).
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Iterable
from typing import Any

import msgspec
import torch

from pagellm.protocol.utility import WeightSpec
from pagellm.protocol.validation import check_host, check_int

TRANSFER_TIMEOUT_S = 300.0  # each broadcast (and the trainer's wait for the engine)


class TransferInit(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's `NCCLWeightTransferInitInfo`."""

    master_address: str
    master_port: int
    rank_offset: int = 1
    world_size: int

    def __post_init__(self) -> None:
        check_host("master_address", self.master_address)
        check_int("master_port", self.master_port, minimum=1, maximum=65535)
        check_int("world_size", self.world_size, minimum=2, maximum=1024)
        check_int("rank_offset", self.rank_offset, minimum=1, maximum=self.world_size - 1)


def choose_backend(members: list[str]) -> str:
    """"nccl" when every member offered a GPU (its UUID) and no two share one; else
    "gloo". `members[r]` is what rank r offered: a GPU's UUID, or "cpu"."""
    gpus = [m for m in members if m != "cpu"]
    return "nccl" if len(gpus) == len(members) == len(set(gpus)) else "gloo"


class WeightGroup:
    """One process's membership in the weight-transfer group.

    The gloo group and the TCPStore must be destroyed before the interpreter tears
    down: left to its final teardown, a store master whose peer is still connected
    aborts the process ("terminate called without an active exception"), so a
    trainer script that simply ends would exit with SIGABRT. `close()` releases them;
    a finalizer does it at exit for callers that never call it."""

    def __init__(self, init: TransferInit, rank: int, device: torch.device | None = None,
                 timeout_s: float = TRANSFER_TIMEOUT_S, join_timeout_s: float | None = None
                 ) -> None:
        """`join_timeout_s` bounds reaching the store and meeting every member (default
        `timeout_s`); `timeout_s` bounds each broadcast after that."""
        import datetime

        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank = rank
        store = dist.TCPStore(init.master_address, init.master_port, init.world_size,
                              is_master=rank == 0, timeout=datetime.timedelta(
                                  seconds=timeout_s if join_timeout_s is None
                                  else join_timeout_s))
        offer = "cpu"
        if device is not None and device.type == "cuda":
            offer = str(torch.cuda.get_device_properties(device).uuid)
        store.set(f"pagellm/weights/member/{rank}", offer)
        members = [store.get(f"pagellm/weights/member/{r}").decode()
                   for r in range(init.world_size)]
        self.backend = choose_backend(members)
        groups = dist.PrefixStore(f"pagellm/weights/{self.backend}", store)
        if self.backend == "nccl":
            assert device is not None
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            group: Any = dist.ProcessGroupNCCL(groups, rank, init.world_size, options)
            self.device = device
        else:
            group = dist.ProcessGroupGloo(groups, rank, init.world_size, timeout)
            self.device = torch.device("cpu")
        self._options = dist.BroadcastOptions()
        self._options.rootRank = 0
        # The only references to the group and the stores, so the finalizer (at exit,
        # or when this object goes) really destroys them, in this order.
        self._live: list[Any] = [group, groups, store]
        self._finalizer = weakref.finalize(self, _release, self._live)

    def broadcast(self, tensor: torch.Tensor) -> None:
        """In place: rank 0's tensor overwrites everyone else's (on `self.device`)."""
        if not self._live:
            raise RuntimeError("the weight-transfer group is closed")
        self._live[0].broadcast([tensor], self._options).wait()

    def close(self) -> None:
        """Leave the group; idempotent."""
        self._finalizer()


def _release(live: list[Any]) -> None:
    while live:  # the group before the store it was made from
        del live[0]


def trainer_init(init_info: dict[str, Any], device: torch.device | str | None = None
                 ) -> WeightGroup:
    """The trainer's side of `init_weight_transfer_engine` (run both at once: each
    waits for the other): rank 0 of the group. `device`: the trainer's GPU, if it has
    one (default: the current CUDA device when CUDA is available); the group uses NCCL
    when the engine's workers are on GPUs too."""
    if device is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return WeightGroup(msgspec.convert(init_info, TransferInit), rank=0,
                       device=None if device is None else torch.device(device))


def trainer_send_weights(weights: Iterable[tuple[str, torch.Tensor]],
                         group: WeightGroup) -> dict[str, Any]:
    """Broadcast `(checkpoint name, tensor)` pairs to the engine, which must be inside
    `update_weights(update_info)` with the returned `update_info` meanwhile. Returns
    that update_info (names, dtype_names, shapes: vLLM's fields); see
    `update_info_for` to make it before sending."""
    pairs = [(name, tensor.detach().to(group.device).contiguous())
             for name, tensor in weights]
    info = update_info_for(pairs)
    for _, tensor in pairs:
        group.broadcast(tensor)
    return info


def update_info_for(weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """vLLM's update_info for these tensors: {"names", "dtype_names", "shapes"}."""
    pairs = list(weights)
    return {"names": [name for name, _ in pairs],
            "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in pairs],
            "shapes": [list(t.shape) for _, t in pairs]}


# vLLM's update_info fields beyond the three lists: packing is not spoken here (each
# tensor is its own broadcast), so only an unpacked update is accepted.
_PACKING_FIELDS = frozenset({"packed", "packed_buffer_size_bytes", "packed_num_buffers"})


def specs_from_update_info(info: dict[str, Any]) -> list[WeightSpec]:
    """vLLM's update_info (three lists of equal length) as our specs. A field this
    engine would not honour is refused, naming it: received as if unpacked, a packed
    update would load garbage or hang the trainer."""
    unknown = sorted(str(k)[:64] for k in set(info) - {"names", "dtype_names", "shapes"}
                     - _PACKING_FIELDS)
    if unknown:
        raise ValueError(f"update_info: unknown field(s) {', '.join(unknown[:8])}")
    if info.get("packed", False) is not False:
        raise ValueError("update_info: packed broadcasts are not supported; send each "
                         "tensor on its own (packed=False, as trainer_send_weights does)")
    names, dtypes, shapes = (info.get(k) for k in ("names", "dtype_names", "shapes"))
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
            and len(names) == len(dtypes) == len(shapes)):
        raise ValueError("update_info must hold 'names', 'dtype_names' and 'shapes', "
                         "lists of one length")
    try:
        return msgspec.convert(
            [[n, d, s] for n, d, s in zip(names, dtypes, shapes, strict=True)],
            list[WeightSpec])
    except msgspec.ValidationError as e:  # "... - at `$[3][2][0]`": name the field
        fields = ("names", "dtype_names", "shapes")
        where = re.sub(r"`\$\[(\d+)\]\[(\d)\]((?:\[\d+\])*)`",
                       lambda m: f"update_info.{fields[int(m[2])]}[{m[1]}]{m[3]}", str(e))
        raise ValueError(where) from None
