"""Weight updates without pickle: through shared memory or CUDA IPC (the "ipc"
backend) or a torch.distributed group with the trainer (the "nccl" backend, below).

The sender (`LLM.update_weights`, a trainer on the same host) writes the tensors one
after another into a file under /dev/shm and sends a `WeightUpdate`: each tensor's
checkpoint name, dtype, shape and byte offset, plus the file's path and size. The
engine checks the update as a whole (`check_specs`: no name twice, no more bytes than
the model allows), maps the file (or reads it: `open_update`), checks every spec
against the file and the model before it copies anything (so a bad update leaves the
old weights serving), then copies. The sender deletes the file when the call returns.
Nothing crosses the socket but the specs.

The engine opens only regular files named `pagellm-weights-*` directly in /dev/shm or
the temp directory (the fallback when /dev/shm is too small), without following links
or waiting for a writer, with one link and its own user as owner: a client cannot make
it read anything else, or block; and a sender that truncates the file meanwhile waits,
or fails its own update, instead of killing the engine.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import re
import signal
import stat
import tempfile
import weakref
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from pagellm.executor.tensor_codec import DTYPES, nbytes
from pagellm.protocol.utility import WEIGHT_DTYPES, WeightSpec, WeightUpdate
from pagellm.protocol.validation import check_host, check_int

if TYPE_CHECKING:
    from pagellm.executor.models.decoder import Destination

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


def check_weights(pairs: list[Any]) -> None:
    """What a sender was given is `(name, tensor)` pairs of weight dtypes: a TypeError
    or ValueError naming the first that is not (before any byte is written)."""
    for i, pair in enumerate(pairs):
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise TypeError(f"weights[{i}] must be a (name, tensor) pair, got "
                            f"{type(pair).__name__}")
        name, tensor = pair
        if not isinstance(name, str):
            raise TypeError(f"weights[{i}]: the name must be a string, got "
                            f"{type(name).__name__}")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"weight {name}: expected a torch.Tensor, got "
                            f"{type(tensor).__name__}")
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weight {name}: dtype {dtype} is not a weight dtype "
                             f"({', '.join(WEIGHT_DTYPES)})")


def layout(pairs: list[tuple[str, torch.Tensor]]) -> tuple[list[WeightSpec], int]:
    """Each tensor's spec at its place in one buffer (64-byte aligned starts), and the
    buffer's size."""
    specs, offset = [], 0
    for name, tensor in pairs:
        offset = -(-offset // ALIGN) * ALIGN
        specs.append(WeightSpec(name, str(tensor.dtype).removeprefix("torch."),
                                list(tensor.shape), offset))
        offset += tensor.numel() * tensor.element_size()
    return specs, offset


@contextlib.contextmanager
def shared_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[WeightUpdate]:
    """Write `(checkpoint name, tensor)` pairs into a fresh shared-memory file; yields
    the `WeightUpdate` describing it and deletes the file afterwards."""
    pairs = list(weights)
    check_weights(pairs)
    specs, size = layout(pairs)
    fd, path = tempfile.mkstemp(prefix=PREFIX, dir=shm_dir(size))
    try:
        with os.fdopen(fd, "wb") as f:
            for spec, (_, tensor) in zip(specs, pairs, strict=True):
                if tensor.numel():
                    f.seek(spec.offset)
                    host = tensor.detach().to("cpu").contiguous()
                    f.write(host.reshape(-1).view(torch.uint8).numpy().data)
            f.truncate(size)
        yield WeightUpdate(specs, buffer=path, buffer_bytes=size)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


@contextlib.contextmanager
def open_update(update: WeightUpdate) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The update's tensors (valid inside the `with`); ValueError naming the first
    thing that is wrong.

    The sender still holds the file and could shrink it while the engine copies: a
    mapped page past the new end is a SIGBUS that kills the engine for every client.
    So the file is mapped (copy-on-write, no copy of it made) only under a read lease
    (`_hold_lease`), which makes any truncation or open for writing wait until the
    engine lets go; where no lease can be had (a writer still has the file open, a file
    system without leases) it is read whole into host memory instead, and a file that
    shrinks meanwhile is a short read: a refused update, old weights kept. Reading is
    the slower way (fresh pages to fill: twice the time, BENCHMARKS.md)."""
    if update.buffer is None:
        raise ValueError("weight update without a buffer (backend 'ipc' needs one)")
    fd, size = _open_buffer(update.buffer)
    try:
        if size != update.buffer_bytes:
            raise ValueError(f"weight buffer {update.buffer} is not a regular file of "
                             f"{update.buffer_bytes} bytes")
        if not size or not _hold_lease(fd):
            raw = torch.empty(size, dtype=torch.uint8)  # [bytes]
            _read_exactly(fd, raw, update.buffer)
            yield views(raw, update.specs)
            return
        now = os.fstat(fd).st_size  # the lease holds it from here: is it still whole?
        if now != size:
            raise _shrank(update.buffer, now, size)
        mapped = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE,  # copy-on-write: never
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)  # the sender's bytes
        try:
            raw = torch.frombuffer(mapped, dtype=torch.uint8)  # [bytes]
            tensors = views(raw, update.specs)
            yield tensors
            del tensors, raw
        finally:
            with contextlib.suppress(BufferError):  # a view escaped: the GC unmaps later
                mapped.close()
    finally:
        os.close(fd)  # and with it the lease


def _hold_lease(fd: int) -> bool:
    """Take a read lease on the open buffer file: until `fd` is closed, another
    process's truncate, or open for writing, waits (up to the kernel's
    lease-break-time, 45 s by default, after notifying us; copying an update takes well
    under that). Refused (False) while anyone has the file open for writing, and where
    the file system has no leases. The break notice comes as SIGURG, which a process
    ignores by default, instead of SIGIO, which would kill it."""
    if not hasattr(fcntl, "F_SETLEASE"):  # Linux only
        return False
    try:
        fcntl.fcntl(fd, fcntl.F_SETSIG, signal.SIGURG)
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
    except OSError:
        return False
    return True


def _open_buffer(buffer: str) -> tuple[int, int]:
    """A descriptor of the update's buffer file and its size, opened so that nothing a
    client names can make the engine read anything else, or wait: only a
    `pagellm-weights-*` file directly in one of `buffer_dirs()`; opened without following
    a link and without blocking (a FIFO would block the open until a writer came); then
    it must be a regular file with exactly one link (a hard link to another file,
    /etc/shadow, has two) owned by the engine's own user."""
    path = Path(buffer)
    if path.parent not in buffer_dirs() or not path.name.startswith(PREFIX):
        raise ValueError(f"weight buffer must be a {PREFIX}* file in "
                         f"{' or '.join(map(str, buffer_dirs()))}, got {buffer!r}")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise ValueError(f"cannot open weight buffer {buffer}: {e}") from None
    info = os.fstat(fd)
    problem = ("not a regular file" if not stat.S_ISREG(info.st_mode)
               else f"a file with {info.st_nlink} links (a buffer has exactly one)"
               if info.st_nlink != 1
               else f"owned by uid {info.st_uid}, not the engine's ({os.geteuid()})"
               if info.st_uid != os.geteuid() else None)
    if problem is not None:
        os.close(fd)
        raise ValueError(f"weight buffer {buffer} refused: {problem}")
    return fd, info.st_size


READ_CHUNK = 64 * 2**20  # bytes per read call (each a separate system call)


def _read_exactly(fd: int, raw: torch.Tensor, buffer: str) -> None:
    """Fill `raw` ([bytes] uint8) from the start of `fd`; ValueError if the file ends
    first (its sender shrank it after the size check)."""
    view = raw.numpy().data.cast("B")
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:done + READ_CHUNK]], done)
        if got == 0:
            raise _shrank(buffer, done, len(view))
        done += got


def _shrank(buffer: str, now: int, size: int) -> ValueError:
    return ValueError(f"weight buffer {buffer} shrank to {now} of {size} bytes while it "
                      "was opened: update refused, old weights kept")


def pack(pairs: list[tuple[str, torch.Tensor]], specs: list[WeightSpec],
         buffer: torch.Tensor) -> None:
    """Copy each tensor to its spec's place in `buffer` ([bytes] uint8, any device)."""
    for spec, (_, tensor) in zip(specs, pairs, strict=True):
        _view(buffer, spec).copy_(tensor.detach())


def views(raw: torch.Tensor, specs: list[WeightSpec]) -> list[tuple[str, torch.Tensor]]:
    """Each spec's tensor as a view of `raw` ([bytes] uint8); ValueError naming the
    first spec that does not lie inside it, aligned."""
    return [(spec.name, _view(raw, spec)) for spec in specs]


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
# any, is untouched). Its backend is agreed through that store: NCCL when every member
# holds a GPU of its own (device to device, no host copy), otherwise gloo over host
# tensors (on the CPU, or staged through host memory; also when the trainer and a
# worker share a GPU, which NCCL refuses: the "ipc" backend is the fast path there).

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


def receive(group: WeightGroup, specs: list[WeightSpec], dests: list[Destination] | None
            ) -> int:
    """Receive every spec's tensor in order, loading each into `dests[i]` (where it
    goes in the model: the caller has checked names and shapes) as it arrives; with
    `dests` None (an update refused before anything arrived) receive them all the same,
    into scratch, so the trainer's broadcasts never hang. The caller has passed the
    specs through `check_specs` (never receive, not even into scratch, an update larger
    than the model allows). Returns the number of tensors received.

    A tensor this rank keeps whole, in the parameter's dtype, lands in the parameter
    itself. Any other lands in one scratch buffer the size of the largest such, reused,
    and is copied from there: never the whole update in memory (on a GPU, a model's
    worth), nor a fresh allocation per tensor (on the CPU, each one's pages faulted in
    and zeroed again: 2.3-2.7 s for a 2 GB update, against 0.8-1.0 s in place)."""
    sizes = [_spec_bytes(spec) for spec in specs]
    direct: list[torch.Tensor | None] = [None] * len(specs)  # the parameter, if in place
    if dests is not None:
        direct = [dest.receiver(DTYPES[spec.dtype], group.device)
                  for spec, dest in zip(specs, dests, strict=True)]
    scratch = torch.empty(  # [bytes of the largest tensor received indirectly]
        max((size for size, d in zip(sizes, direct, strict=True) if d is None), default=0),
        dtype=torch.uint8, device=group.device)
    for index, (spec, size, into) in enumerate(zip(specs, sizes, direct, strict=True)):
        tensor = into if into is not None else \
            scratch[:size].view(DTYPES[spec.dtype]).view(spec.shape)
        try:
            group.broadcast(tensor)
        except RuntimeError as e:  # the trainer died or timed out midway
            mixed = (" (the model now mixes old and new weights: push the update again)"
                     if dests is not None and (index or into is not None) else "")
            raise RuntimeError(f"weight broadcast {index + 1} of {len(specs)} ({spec.name}) "
                               f"failed{mixed}: {e}") from e
        if dests is not None and into is None:
            dests[index].load(tensor)  # blocking: the next broadcast overwrites scratch
    return len(specs)


# --- every path: the update as a whole ------------------------------------------------


MAX_NAME_CHARS = 512  # a checkpoint tensor's name (Hugging Face's are under 100)


class UpdateTooLarge(ValueError):
    """A weight update whose specs add up to more than the model allows: refused with
    nothing of it copied or received (on the "nccl" backend not even drained: receiving
    it is the cost the limit exists to refuse)."""


def check_specs(specs: list[WeightSpec], limit_bytes: int, limit_count: int) -> None:
    """The checks of an update as a whole, made on its specs alone before any byte of
    it is copied or received, whatever the path (shared-memory file, CUDA IPC, or
    broadcast): its number of tensors and total size (UpdateTooLarge beyond
    `limit_count` / `limit_bytes`; ValueError naming a spec that is no weight), then its
    names (ValueError naming the first that comes twice). Without them a few bytes of
    specs could make the engine copy, or receive, one region of the buffer any number
    of times, or look up any number of names it skips, while it serves no one."""
    if len(specs) > limit_count:
        raise UpdateTooLarge(f"weight update of {len(specs)} tensors is more than the "
                             f"model has ({limit_count} at most); refused, nothing copied "
                             f"or received")
    for spec in specs:  # before any message names one: never echo a client's megabytes
        if len(spec.name) > MAX_NAME_CHARS:
            raise ValueError(f"weight update refused: a tensor name of {len(spec.name)} "
                             f"characters ({spec.name[:40]!r}...), more than "
                             f"{MAX_NAME_CHARS}")
    total = sum(_spec_bytes(spec) for spec in specs)
    if total > limit_bytes:
        raise UpdateTooLarge(f"weight update of {total} bytes is larger than the model "
                             f"allows ({limit_bytes}); refused, nothing copied or received")
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise ValueError(f"weight update refused, old weights kept: {spec.name} "
                             f"appears more than once")
        seen.add(spec.name)


def buffer_limit(limit_bytes: int, count: int) -> int:
    """The largest buffer file an update of `count` tensors within `limit_bytes` needs:
    its tensors one after another, each start rounded up to ALIGN (`layout`). The file
    is read whole, so a larger one would make the engine allocate what its sender
    chose."""
    return limit_bytes + ALIGN * count


def _spec_bytes(spec: WeightSpec) -> int:
    """The spec's size in bytes; ValueError naming the weight if it is no weight."""
    if spec.dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight {spec.name}: dtype {spec.dtype[:24]!r} is not a weight dtype "
                         f"({', '.join(WEIGHT_DTYPES)})")
    return nbytes(f"weight {spec.name}", spec.shape, DTYPES[spec.dtype])
