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

An update travels one tensor per broadcast, or packed (vLLM's `packed`: many tensors
per broadcast, weights/packed.py) when the init_info said so, as TRL does for vLLM >=
0.28; vLLM < 0.28 said so in each update_info instead, which is honoured too
(`Packing.override`). Each side's group keeps the init_info's choice
(`WeightGroup.packing`): `trainer_send_weights` sends with it and the engine receives
with it, so the two sides read it from one message.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from pagellm.protocol.utility import PackingFields, WeightSpec, WeightUpdate
from pagellm.protocol.validation import check_host, check_int
from pagellm.weights.packed import (
    DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    DEFAULT_PACKED_NUM_BUFFERS,
    check_packing,
    packed_nccl_broadcast_producer,
)

TRANSFER_TIMEOUT_S = 300.0  # each broadcast (and the trainer's wait for the engine)


class TransferInit(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's `NCCLWeightTransferInitInfo`, its packing fields and defaults included."""

    master_address: str
    master_port: int
    rank_offset: int = 1
    world_size: int
    packed: bool = False
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS

    def __post_init__(self) -> None:
        check_host("master_address", self.master_address)
        check_int("master_port", self.master_port, minimum=1, maximum=65535)
        check_int("world_size", self.world_size, minimum=2, maximum=1024)
        check_int("rank_offset", self.rank_offset, minimum=1, maximum=self.world_size - 1)
        check_packing(self.packed_buffer_size_bytes, self.packed_num_buffers)


@dataclass(frozen=True)
class Packing:
    """How an update's tensors travel: one per broadcast, or packed into chunks of
    `buffer_size_bytes` (vLLM's rule, weights/packed.py)."""

    packed: bool = False
    buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS

    def override(self, fields: PackingFields | None) -> Packing:
        """This (the init_info's) with the fields an update_info named in its place:
        vLLM < 0.28 named them per update, newer vLLM at init; a client of either is
        understood, and a field named in both is the update's, the later word."""
        if fields is None:
            return self
        return Packing(
            self.packed if fields.packed is None else fields.packed,
            self.buffer_size_bytes if fields.packed_buffer_size_bytes is None
            else fields.packed_buffer_size_bytes,
            self.num_buffers if fields.packed_num_buffers is None
            else fields.packed_num_buffers)


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
        self.packing = Packing(init.packed, init.packed_buffer_size_bytes,
                               init.packed_num_buffers)  # both sides', from init_info
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

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """In place: rank 0's tensor overwrites everyone else's (on `self.device`).
        `src` is for vLLM-style callers (`group.broadcast(t, src=0)`): the trainer is
        rank 0, the only sender there is."""
        if src != 0:
            raise ValueError(f"broadcast src={src!r}: the trainer, rank 0, is the only "
                             "sender of the weight-transfer group")
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
    waits for the other): rank 0 of the group, which keeps the init_info's packing
    (`group.packing`) for `trainer_send_weights`. `device`: the trainer's GPU, if it
    has one (default: the current CUDA device when CUDA is available); the group uses
    NCCL when the engine's workers are on GPUs too."""
    if device is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return WeightGroup(msgspec.convert(init_info, TransferInit), rank=0,
                       device=None if device is None else torch.device(device))


def trainer_send_weights(weights: Iterable[tuple[str, torch.Tensor]],
                         group: WeightGroup, packed: bool | None = None) -> dict[str, Any]:
    """Broadcast `(checkpoint name, tensor)` pairs to the engine, which must be inside
    `update_weights(update_info)` with the returned `update_info` meanwhile: packed or
    not as the group's init_info said, unless `packed` says otherwise (then the
    update_info names it, as vLLM < 0.28's did, and the engine follows it). Returns
    that update_info (names, dtype_names, shapes: vLLM's fields); see
    `update_info_for` to make it before sending. Tensors move to the group's device
    one at a time (packed: one chunk at a time), never the whole model at once."""
    pairs = [(name, tensor.detach()) for name, tensor in weights]
    packing = group.packing.override(PackingFields(packed=packed))
    info = update_info_for(pairs, packed=None if packing == group.packing else packed)
    if packing.packed:
        packed_nccl_broadcast_producer(iter(pairs), group, 0, lambda item: item[1],
                                       packing.buffer_size_bytes, packing.num_buffers)
    else:
        for _, tensor in pairs:
            group.broadcast(tensor.to(group.device).contiguous())
    return info


def update_info_for(weights: Iterable[tuple[str, torch.Tensor]], packed: bool | None = None
                    ) -> dict[str, Any]:
    """vLLM's update_info for these tensors: {"names", "dtype_names", "shapes"}, and
    "packed" when given (for an update sent otherwise than the group's init_info said)."""
    pairs = list(weights)
    info: dict[str, Any] = {
        "names": [name for name, _ in pairs],
        "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in pairs],
        "shapes": [list(t.shape) for _, t in pairs]}
    if packed is not None:
        info["packed"] = packed
    return info


# vLLM < 0.28's update_info fields beyond the three lists.
_PACKING_FIELDS = frozenset(PackingFields.__struct_fields__)


def update_from_update_info(info: dict[str, Any]) -> WeightUpdate:
    """vLLM's update_info as the update the engine receives: three lists of equal
    length as our specs, and the packing fields it names (old vLLM), which the engine
    applies over its init_info's. Any other field is refused, naming it."""
    packing = {k: v for k, v in info.items() if k in _PACKING_FIELDS}
    try:
        fields = PackingFields(**packing) if packing else None
    except (TypeError, ValueError) as e:
        raise ValueError(f"update_info: {e}") from None
    return WeightUpdate(_specs(info), packing=fields)


def specs_from_update_info(info: dict[str, Any]) -> list[WeightSpec]:
    """The specs of an update_info that names no packing field: the caller builds a
    `WeightUpdate` of the specs alone, which would drop them (received one way while
    the trainer sends another: garbage loaded, or a trainer hung), so one that does is
    refused; `update_from_update_info` carries them."""
    update = update_from_update_info(info)
    if update.packing is not None:
        raise ValueError("update_info names packing fields ("
                         + ", ".join(sorted(_PACKING_FIELDS & set(info)))
                         + "): build the update with pagellm.weights.nccl."
                         "update_from_update_info, which carries them")
    return update.specs


def _specs(info: dict[str, Any]) -> list[WeightSpec]:
    """The three lists of an update_info as specs; ValueError naming a bad field."""
    unknown = sorted(str(k)[:64] for k in set(info) - {"names", "dtype_names", "shapes"}
                     - _PACKING_FIELDS)
    if unknown:
        raise ValueError(f"update_info: unknown field(s) {', '.join(unknown[:8])}")
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
