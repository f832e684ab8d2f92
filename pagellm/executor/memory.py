"""Freeing and restoring the engine's big allocations for sleep mode.

Sleeping must give memory back to the system, not to a cache inside this process:
on CUDA, torch's caching allocator keeps freed blocks until `empty_cache()`, and its
pinned host allocator keeps the level-1 weight backup's pages after waking until
`empty_host_cache()`; on the CPU, glibc keeps freed heap pages (tensors below its mmap
threshold, which grows up to 32 MiB) until `malloc_trim`. `release()` does all of
these, so the RSS or the device's free memory shows the drop.

Parameters are emptied in place (`param.data` swapped for a 0-element tensor), so the
module tree, tied weights (one Parameter object) and every buffer (RoPE tables) stay
as they are: after waking, the same objects are filled again.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable

import psutil
import torch
from torch import nn


def parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Each parameter once (a tied weight appears under its first name)."""
    return list(model.named_parameters())


def parameter_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for _, p in parameters(model))


def offload(model: nn.Module, keep: bool) -> dict[str, torch.Tensor] | None:
    """Empty every parameter's storage; with `keep`, return a host copy of each (pinned
    when they live on CUDA, so waking copies at full bus speed). Shapes stay readable
    through the returned copies or through `shapes()` taken beforehand."""
    backup: dict[str, torch.Tensor] = {}
    for name, param in parameters(model):
        if keep:
            if param.device.type == "cpu":
                backup[name] = param.data  # already host memory: keep it as it is
            else:
                host = torch.empty(param.shape, dtype=param.dtype, pin_memory=True)
                host.copy_(param.data)
                backup[name] = host
        param.data = torch.empty(0, dtype=param.dtype, device=param.device)
    return backup if keep else None


def shapes(model: nn.Module) -> dict[str, torch.Size]:
    return {name: param.shape for name, param in parameters(model)}


def restore(model: nn.Module, sizes: dict[str, torch.Size],
            backup: dict[str, torch.Tensor] | None) -> None:
    """Allocate every parameter again at its size, filled from `backup` when given
    (contents undefined otherwise: level 2 waits for new weights)."""
    for name, param in parameters(model):
        if backup is not None and backup[name].device == param.device:
            param.data = backup[name]
            continue
        param.data = torch.empty(sizes[name], dtype=param.dtype, device=param.device)
        if backup is not None:
            param.data.copy_(backup[name], non_blocking=True)
    if backup is not None and any(p.device.type == "cuda" for _, p in parameters(model)):
        torch.cuda.synchronize()  # the host copies may be freed once this returns


def release(device: torch.device) -> None:
    """Hand freed memory back to the system (see the module docstring)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        # The public name is recent; older torch has only the private hook.
        empty_host_cache = (getattr(torch.accelerator, "empty_host_cache", None)
                            or getattr(torch._C, "_host_emptyCache", None))
        if empty_host_cache is not None:
            empty_host_cache()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def keep_freed_heap() -> bool:
    """Make glibc keep freed memory for the next step instead of giving it back.

    A forward pass on the CPU allocates and frees the same activations every step
    (tens of MB at a batch of 48). glibc's defaults hand them back to the system and
    take them again: up to 32 MiB its mmap threshold adapts, but a freed heap top over
    twice that threshold is trimmed, so every step page-faults its activations in again,
    which made the decode attention's gathers four times slower than their copies.
    Fixing the mmap threshold at its 32 MiB maximum and trimming only above 256 MiB
    keeps them; sleep's `release()` still trims everything (malloc_trim ignores both).
    Returns False where there is no glibc. Process-wide: call it in an engine process."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, 32 * 2**20) and
                mallopt(_M_TRIM_THRESHOLD, 256 * 2**20))


def tune_engine_process() -> None:
    """Process-wide settings for a process pagellm owns (the engine core, a
    tensor-parallel worker), never for a user's process that embeds an in-process engine:
    both change behaviour every other library in that process relies on.

    - `keep_freed_heap()`: no page faults re-taking each step's activations.
    - Subnormal floats flushed to zero: they cost x86 cores ~100x per operation, and
      random or small weights (softmax tails, SiLU of large negatives) made a
      Qwen2.5-0.5B decode step four times slower; flushing them (below 1.2e-38) moves no
      output measurably. Called before torch's thread pool starts: its threads inherit
      the mode. Harmless on CUDA, where the host does no float work of note."""
    keep_freed_heap()
    torch.set_flush_denormal(True)


def used_bytes(device: torch.device) -> int:
    """What this process holds on `device`: allocated CUDA memory, or the RSS."""
    if device.type == "cuda":
        return int(torch.cuda.memory_reserved(device))
    return int(psutil.Process().memory_info().rss)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None elsewhere (musl, macOS)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim: Callable[[int], int] = ctypes.CDLL(name).malloc_trim
        return trim
    except (OSError, AttributeError):
        return None
