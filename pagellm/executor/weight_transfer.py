"""Weight updates without pickle: through shared memory (the "ipc" backend) or a
torch.distributed group with the trainer (the "nccl" backend, below).

The sender (`LLM.update_weights`, a trainer on the same host) writes the tensors one
after another into a file under /dev/shm and sends a `WeightUpdate`: each tensor's
checkpoint name, dtype, shape and byte offset, plus the file's path and size. The
engine maps the file, checks every spec against the file and the model before it
copies anything (so a bad update leaves the old weights serving), then copies. The
sender deletes the file when the call returns. Nothing crosses the socket but the specs.

The engine opens only regular files named `pagellm-weights-*` directly in /dev/shm or
the temp directory (the fallback when /dev/shm is too small), without following links:
a client cannot make it read anything else.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import stat
import tempfile
import weakref
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import torch

from pagellm.executor.tensor_codec import DTYPES, nbytes
from pagellm.protocol.utility import WEIGHT_DTYPES, WeightSpec, WeightUpdate
from pagellm.protocol.validation import check_int

PREFIX = "pagellm-weights-"
ALIGN = 64  # each tensor starts on a 64-byte boundary (aligned views for every dtype)


def buffer_dirs() -> list[Path]:
    """Where update buffers may live, in order of preference: /dev/shm (RAM-backed),
    then the temp directory (when /dev/shm is too small, as in a default container)."""
    shm = Path("/dev/shm")
    dirs = [shm] if shm.is_dir() and os.access(shm, os.W_OK) else []
    return [*dirs, Path(tempfile.gettempdir())]


def shm_dir(needed: int = 0) -> Path:
    """The first of `buffer_dirs()` with room for `needed` bytes (and a margin)."""
    free = {}
    for directory in buffer_dirs():
        stats = os.statvfs(directory)
        free[directory] = stats.f_bavail * stats.f_frsize
        if free[directory] >= needed + needed // 16:
            return directory
    raise ValueError(f"no room for a {needed / 2**20:.0f} MiB weight buffer (free: " +
                     ", ".join(f"{d} {b / 2**20:.0f} MiB" for d, b in free.items()) +
                     "); enlarge /dev/shm (docker run --shm-size) or send fewer tensors "
                     "per update_weights call")


@contextlib.contextmanager
def shared_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[WeightUpdate]:
    """Write `(checkpoint name, tensor)` pairs into a fresh shared-memory file; yields
    the `WeightUpdate` describing it and deletes the file afterwards."""
    pairs = list(weights)
    for name, tensor in pairs:
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weight {name}: dtype {dtype} is not a weight dtype "
                             f"({', '.join(WEIGHT_DTYPES)})")
    needed = sum(-(-t.numel() * t.element_size() // ALIGN) * ALIGN for _, t in pairs)
    fd, path = tempfile.mkstemp(prefix=PREFIX, dir=shm_dir(needed))
    try:
        specs: list[WeightSpec] = []
        offset = 0
        with os.fdopen(fd, "wb") as f:
            for name, tensor in pairs:
                host = tensor.detach().to("cpu").contiguous()
                dtype = str(host.dtype).removeprefix("torch.")
                offset = -(-offset // ALIGN) * ALIGN
                f.seek(offset)
                if host.numel():
                    f.write(host.view(torch.uint8).numpy().data)
                specs.append(WeightSpec(name, dtype, list(host.shape), offset))
                offset += host.numel() * host.element_size()
            f.truncate(offset)
        yield WeightUpdate(specs, buffer=path, buffer_bytes=offset)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


@contextlib.contextmanager
def open_update(update: WeightUpdate) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The update's tensors, as read-only views of the mapped file (valid inside the
    `with`); ValueError naming the first thing that is wrong."""
    if update.buffer is None:
        raise ValueError("weight update without a buffer (backend 'ipc' needs one)")
    path = Path(update.buffer)
    if path.parent not in buffer_dirs() or not path.name.startswith(PREFIX):
        raise ValueError(f"weight buffer must be a {PREFIX}* file in "
                         f"{' or '.join(map(str, buffer_dirs()))}, got {update.buffer!r}")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise ValueError(f"cannot open weight buffer {update.buffer}: {e}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size != update.buffer_bytes:
            raise ValueError(f"weight buffer {update.buffer} is not a regular file of "
                             f"{update.buffer_bytes} bytes")
        mapped = mmap.mmap(fd, info.st_size, flags=mmap.MAP_PRIVATE,  # copy-on-write: never
                           prot=mmap.PROT_READ | mmap.PROT_WRITE) if info.st_size else None
    finally:
        os.close(fd)
    try:
        raw = torch.frombuffer(mapped, dtype=torch.uint8) if mapped is not None \
            else torch.empty(0, dtype=torch.uint8)
        tensors = [(spec.name, _view(raw, spec)) for spec in update.specs]
        yield tensors
        del tensors, raw
    finally:
        if mapped is not None:
            with contextlib.suppress(BufferError):  # a view escaped: the GC unmaps later
                mapped.close()


def _view(raw: torch.Tensor, spec: WeightSpec) -> torch.Tensor:
    end = spec.offset + _spec_bytes(spec)
    dtype = DTYPES[spec.dtype]
    if spec.offset < 0 or spec.offset % ALIGN or end > raw.numel():
        raise ValueError(f"weight {spec.name}: bytes [{spec.offset}, {end}) are outside the "
                         f"{raw.numel()}-byte buffer or unaligned")
    return raw[spec.offset:end].view(dtype).view(spec.shape)


# --- the "nccl" backend: a torch.distributed group with the trainer -------------------
#
# vLLM's names: the trainer is rank 0 of a group of `world_size` (trainer + engine
# workers); the engine's worker joins as `rank_offset + its rank`. The group is made
# from a TCPStore directly (no init_process_group: the engine's own default group, if
# any, is untouched). Gloo carries host tensors, on the CPU and, staged through host
# memory, on CUDA (NCCL proper is for a GPU session to add).

TRANSFER_TIMEOUT_S = 300.0  # joining the group and each broadcast


class TransferInit(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's `NCCLWeightTransferInitInfo`."""

    master_address: str
    master_port: int
    rank_offset: int = 1
    world_size: int

    def __post_init__(self) -> None:
        check_int("master_port", self.master_port, minimum=1, maximum=65535)
        check_int("world_size", self.world_size, minimum=2, maximum=1024)
        check_int("rank_offset", self.rank_offset, minimum=1, maximum=self.world_size - 1)


class WeightGroup:
    """One process's membership in the weight-transfer group.

    The gloo group and the TCPStore must be destroyed before the interpreter tears
    down: left to its final teardown, a store master whose peer is still connected
    aborts the process ("terminate called without an active exception"), so a
    trainer script that simply ends would exit with SIGABRT. `close()` releases them;
    a finalizer does it at exit for callers that never call it."""

    def __init__(self, init: TransferInit, rank: int,
                 timeout_s: float = TRANSFER_TIMEOUT_S) -> None:
        import datetime

        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank = rank
        store = dist.TCPStore(init.master_address, init.master_port, init.world_size,
                              is_master=rank == 0, timeout=timeout)
        group = dist.ProcessGroupGloo(store, rank, init.world_size, timeout)
        self._options = dist.BroadcastOptions()
        self._options.rootRank = 0
        # The only references to the group and the store, so the finalizer (at exit,
        # or when this object goes) really destroys them, in this order.
        self._live: list[Any] = [group, store]
        self._finalizer = weakref.finalize(self, _release, self._live)

    def broadcast(self, tensor: torch.Tensor) -> None:
        """In place: rank 0's tensor overwrites everyone else's."""
        if not self._live:
            raise RuntimeError("the weight-transfer group is closed")
        self._live[0].broadcast([tensor], self._options).wait()

    def close(self) -> None:
        """Leave the group; idempotent."""
        self._finalizer()


def _release(live: list[Any]) -> None:
    while live:  # the group before the store it was made from
        del live[0]


def trainer_init(init_info: dict[str, Any]) -> WeightGroup:
    """The trainer's side of `init_weight_transfer_engine` (run both at once: each
    waits for the other): rank 0 of the group."""
    return WeightGroup(msgspec.convert(init_info, TransferInit), rank=0)


def trainer_send_weights(weights: Iterable[tuple[str, torch.Tensor]],
                         group: WeightGroup) -> dict[str, Any]:
    """Broadcast `(checkpoint name, tensor)` pairs to the engine, which must be inside
    `update_weights(update_info)` with the returned `update_info` meanwhile. Returns
    that update_info (names, dtype_names, shapes: vLLM's fields); see
    `update_info_for` to make it before sending."""
    pairs = [(name, tensor.detach().to("cpu").contiguous()) for name, tensor in weights]
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


def specs_from_update_info(info: dict[str, Any]) -> list[WeightSpec]:
    """vLLM's update_info (three lists of equal length) as our specs."""
    names, dtypes, shapes = (info.get(k) for k in ("names", "dtype_names", "shapes"))
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
            and len(names) == len(dtypes) == len(shapes)):
        raise ValueError("update_info must hold 'names', 'dtype_names' and 'shapes', "
                         "lists of one length")
    return msgspec.convert([[n, d, s] for n, d, s in zip(names, dtypes, shapes, strict=True)],
                           list[WeightSpec])


def receive(group: WeightGroup, specs: list[WeightSpec], accept: Iterable[bool],
            limit_bytes: int) -> list[tuple[str, torch.Tensor]]:
    """Receive every spec's tensor in order (host memory). Specs not accepted are
    received too, into scratch, so the trainer's broadcasts never hang, as long as the
    whole update stays within `limit_bytes`; their tensors are left out of the result."""
    total = 0
    for spec in specs:
        total += _spec_bytes(spec)
    if total > limit_bytes:
        raise ValueError(f"weight update of {total} bytes is larger than the model "
                         f"allows ({limit_bytes}); nothing was received")
    received = []
    for spec, ok in zip(specs, accept, strict=True):
        tensor = torch.empty(spec.shape, dtype=DTYPES[spec.dtype])
        group.broadcast(tensor)
        if ok:
            received.append((spec.name, tensor))
    return received


def _spec_bytes(spec: WeightSpec) -> int:
    """The spec's size in bytes; ValueError naming the weight if it is no weight."""
    if spec.dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight {spec.name}: dtype {spec.dtype!r} is not a weight dtype "
                         f"({', '.join(WEIGHT_DTYPES)})")
    return nbytes(f"weight {spec.name}", spec.shape, DTYPES[spec.dtype])
