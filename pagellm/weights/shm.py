"""Weight updates without pickle through a shared-memory file (the "ipc" backend's
path when the tensors are not on a GPU; CUDA IPC handles are cuda_ipc.py, the "nccl"
backend nccl.py).

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
import signal
import stat
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from pagellm.protocol.utility import WEIGHT_DTYPES, WeightSpec, WeightUpdate
from pagellm.weights.tensor_codec import DTYPES, spec_bytes

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
    end = spec.offset + spec_bytes(spec)
    dtype = DTYPES[spec.dtype]
    if spec.offset < 0 or spec.offset % ALIGN or end > raw.numel():
        raise ValueError(f"weight {spec.name}: bytes [{spec.offset}, {end}) are outside the "
                         f"{raw.numel()}-byte buffer or unaligned")
    return raw[spec.offset:end].view(dtype).view(spec.shape)


def buffer_limit(limit_bytes: int, count: int) -> int:
    """The largest buffer file an update of `count` tensors within `limit_bytes` needs:
    its tensors one after another, each start rounded up to ALIGN (`layout`). The file
    is read whole, so a larger one would make the engine allocate what its sender
    chose."""
    return limit_bytes + ALIGN * count
