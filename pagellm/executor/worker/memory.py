"""Freeing and restoring the engine's big allocations for sleep mode.

Sleeping must give memory back to the system, not to a cache inside this process:
on CUDA, torch's caching allocator keeps freed blocks until `empty_cache()`, and its
pinned host allocator keeps pinned pages until `empty_host_cache()` (the level-1
weight backup is pinned apart from it, at its exact size: `HostBackup`); on the CPU,
glibc keeps freed heap pages (tensors below its mmap threshold, which grows up to
32 MiB) until `malloc_trim`. `release()` does all of these, so the RSS or the device's
free memory shows the drop.

Parameters are emptied in place (`param.data` swapped for a 0-element tensor), so the
module tree, tied weights (one Parameter object) and every buffer (RoPE tables) stay
as they are: after waking, the same objects are filled again.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import functools
import os
from collections.abc import Callable

import psutil
import torch
from torch import nn

from pagellm.executor.model import host_memory


def parameters(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The tensors that hold the weights, each once (a tied weight appears under its
    first name): every parameter but the meta placeholders of projections quantized on
    load (executor/model/quantize.py), whose packed tensors stand in for them as
    `<module>.quant.<field>`. Swapping `.data` empties and refills plain tensors as it
    does parameters."""
    tensors: list[tuple[str, torch.Tensor]] = [
        (name, p) for name, p in model.named_parameters() if not p.is_meta]
    for name, module in model.named_modules():
        quant = getattr(module, "quant", None)
        if quant is not None:
            tensors += [(f"{name}.quant.{f.name}", getattr(quant, f.name))
                        for f in dataclasses.fields(quant)
                        if isinstance(getattr(quant, f.name), torch.Tensor)]
    return tensors


def parameter_bytes(model: nn.Module) -> int:
    """The model's weights at full precision (a quantized projection counts as its
    placeholder's shape and dtype: the size of the updates it takes)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


class HostBackup:
    """The level-1 copy of the weights in host memory, by parameter name.

    On the CPU the parameters' own storage (already host memory). On CUDA one buffer of
    exactly their size, page-locked with cudaHostRegister (as torch's own checkpoint
    stager does), so waking copies at full bus speed: `pin_memory=True` would go through
    torch's pinned allocator, which rounds every allocation up to a power of two (a
    136 MB MLP weight pins 256 MB: up to twice the weights in all, memory the OS can
    never swap). `free()` unpins it before it can go back to the system."""

    def __init__(self, params: list[tuple[str, torch.Tensor]]) -> None:
        self.pinned: torch.Tensor | None = None  # [bytes] uint8, registered with CUDA
        if all(p.device.type == "cpu" for _, p in params):
            self.tensors = {name: p.data for name, p in params}
            return
        buffer, self.tensors = host_views(params)
        if buffer.numel():
            _cuda_check(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(),
                                                              buffer.numel(), 0),
                        f"page-locking the {buffer.numel() / 2**20:.0f} MiB weight backup")
            self.pinned = buffer
        for name, p in params:
            self.tensors[name].copy_(p.data)

    def free(self) -> None:
        """Drop the copies; unpin first (freed registered pages stay locked)."""
        self.tensors.clear()
        if self.pinned is not None:
            _cuda_check(torch.cuda.cudart().cudaHostUnregister(self.pinned.data_ptr()),
                        "unpinning the weight backup")
            self.pinned = None


def _cuda_check(error: int, doing: str) -> None:
    """cudart's calls return a cudaError (an int enum, 0: success) rather than raise."""
    if int(error) != 0:
        raise RuntimeError(f"{doing} failed: cudaError {int(error)}")


def host_views(params: list[tuple[str, torch.Tensor]]
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One host buffer ([bytes] uint8, exactly the parameters' sizes, 64-byte aligned
    starts: a weight update's layout) and a view of it shaped like each parameter."""
    from pagellm.weights.shm import layout, views

    specs, total = layout([(name, p.data) for name, p in params])
    buffer = torch.empty(total, dtype=torch.uint8)
    return buffer, dict(views(buffer, specs))


def offload(model: nn.Module, keep: bool) -> HostBackup | None:
    """Empty every parameter's storage; with `keep`, return a host copy of them
    (`HostBackup`). Shapes stay readable through the copies or through `shapes()`
    taken beforehand."""
    params = parameters(model)
    backup = HostBackup(params) if keep else None
    for _, param in params:
        param.data = torch.empty(0, dtype=param.dtype, device=param.device)
    return backup


def shapes(model: nn.Module) -> dict[str, torch.Size]:
    return {name: param.shape for name, param in parameters(model)}


def restore(model: nn.Module, sizes: dict[str, torch.Size],
            backup: HostBackup | None) -> None:
    """Allocate every parameter again at its size, filled from `backup` when given
    (contents undefined otherwise: level 2 waits for new weights); the backup is freed
    once copied."""
    copies = {} if backup is None else backup.tensors
    for name, param in parameters(model):
        if name in copies and copies[name].device == param.device:
            param.data = copies[name]
            continue
        param.data = host_memory.empty(sizes[name], param.dtype, param.device)
        if name in copies:
            param.data.copy_(copies[name], non_blocking=True)
    if copies and any(p.device.type == "cuda" for _, p in parameters(model)):
        torch.cuda.synchronize()  # every copy out of the backup is done
    if backup is not None:
        backup.free()


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


# Entries kept by the two caches of oneDNN GEMM set-ups that torch's CPU linear
# (`torch.ops.mkldnn._linear_pointwise`: executor/model/linear.py's ONEDNN and PACKED
# ways) fills, one entry per distinct (rows, in, out) shape; see `bound_gemm_caches`.
ONEDNN_PRIMITIVE_CACHE_CAPACITY = 128
IDEEP_LRU_CACHE_CAPACITY = 64


def bound_gemm_caches() -> None:
    """Bound the host memory that oneDNN's GEMM caches may take.

    Every distinct row count (a step's number of tokens) times every linear weight shape
    (qkv, o, gate_up, down, lm_head: 5 in a decoder) gets its own entry in two caches:
    oneDNN's primitive cache (ONEDNN_PRIMITIVE_CACHE_CAPACITY, default 1024 entries)
    and ideep's primitive-descriptor cache (LRU_CACHE_CAPACITY, default 1024). An entry
    is a brgemm descriptor of ~250 KB, so the defaults allow ~0.5 GB; and a serving or
    RL engine sees a new row count in nearly every step with a new mix of prompts: its
    RSS crept by MiBs per rollout for hundreds of rollouts (asleep or awake: sleep frees
    no cache). At these capacities (~50 MB in all) a step's shapes still hit (a step
    needs ~10 oneDNN entries: each inner product wraps a matmul, both cached); a miss
    costs ~0.2-0.4 ms of CPU per shape (JIT), against tens of ms per step. Both
    libraries read their variable once, at their first GEMM: so this runs before the
    model loads. A value already in the environment is kept."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_PRIMITIVE_CACHE_CAPACITY))
    os.environ.setdefault("LRU_CACHE_CAPACITY", str(IDEEP_LRU_CACHE_CAPACITY))


def tune_engine_process() -> None:
    """Process-wide settings for a process pagellm owns (the engine core, a
    tensor-parallel worker), never for a user's process that embeds an in-process engine:
    each changes behaviour every other library in that process relies on.

    - `keep_freed_heap()`: no page faults re-taking each step's activations.
    - `bound_gemm_caches()`: a bounded RSS across steps of ever new batch shapes.
    - Subnormal floats flushed to zero: they cost x86 cores ~100x per operation, and
      random or small weights (softmax tails, SiLU of large negatives) made a
      Qwen2.5-0.5B decode step four times slower; flushing them (below 1.2e-38) moves no
      output measurably. Called before torch's thread pool starts: its threads inherit
      the mode. Harmless on CUDA, where the host does no float work of note."""
    keep_freed_heap()
    bound_gemm_caches()
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
