"""Weights and KV caches in 2 MB pages on the CPU.

A batch-1 decode step streams every weight once, and on the CPU the page table, not the
memory, set its speed: with 4 KB pages the core takes a TLB miss every 4 KB of a 540 MB
sweep. SmolLM2-135M's fp32 projections and LM head (545 MB) read in 15.5-18.8 ms from
memory in 4 KB pages and in 11.2 ms from the same memory in 2 MB pages, 1.4-1.7x (the
fused decode step's GEMV, 2 cores, AMD EPYC; docs/benchmarks-log.md).

Linux hands out 2 MB pages (transparent huge pages) by default only to memory that asks
for them (`/sys/kernel/mm/transparent_hugepage/enabled` = madvise, the common setting),
and only when the request comes before the memory is first touched. So a tensor of at
least 2 MB that should live in them gets an anonymous mapping of its own, advised
MADV_HUGEPAGE before anything is written: freed with the tensor (the mapping is the
storage's buffer), and where the kernel has no 2 MB page to give (fragmented memory,
THP off) it is ordinary memory, as before. Smaller tensors keep torch's allocator.
"""

from __future__ import annotations

import contextlib
import mmap
import sys

import torch

HUGE_PAGE = 2 << 20
# Linux only: elsewhere (and where Python's mmap lacks madvise) tensors stay as they are.
SUPPORTED = sys.platform == "linux" and hasattr(mmap, "MADV_HUGEPAGE")


def empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype,
          device: torch.device | str = "cpu") -> torch.Tensor:
    """torch.empty(shape, dtype=dtype, device=device); on the CPU in 2 MB pages if at
    least one of them big (module docstring)."""
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or not SUPPORTED or nbytes < HUGE_PAGE:
        return torch.empty(shape, dtype=dtype, device=device)
    # Private: a shared anonymous mapping is shmem, whose huge pages are off by default.
    region = mmap.mmap(-1, nbytes + HUGE_PAGE,  # + slack to start on a 2 MB boundary
                       flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(region, dtype=torch.uint8)  # keeps `region` alive
    start = -whole.data_ptr() % HUGE_PAGE
    # (A kernel built without THP refuses the advice: ordinary pages then.)
    with contextlib.suppress(OSError):
        region.madvise(mmap.MADV_HUGEPAGE, 0, len(region))
    return whole[start:start + nbytes].view(dtype).view(shape)


def copy(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor's contiguous copy, in 2 MB pages where `empty` gives them."""
    out = empty(t.shape, t.dtype)
    out.copy_(t)
    return out


def empty_like(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """torch.empty_like(t, device=device) (contiguous), on the CPU through `empty`."""
    return empty(t.shape, t.dtype, device)
