"""Tensors in 2 MB pages (executor/model/host_memory.py): where they live, that they
behave as torch.empty's, and that their memory goes with them."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from pagellm.executor.model import host_memory

pytestmark = pytest.mark.own_code

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _mapping_of(address: int) -> dict[str, int] | None:
    """/proc/self/smaps' kB fields of the mapping holding `address` (None: unmapped)."""
    fields: dict[str, int] | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            if fields is not None:
                return fields
            fields = {} if lo <= address < hi else None
        elif fields is not None and line.split()[-1] == "kB":
            fields[head.rstrip(":")] = int(line.split()[1])
    return fields


@pytest.mark.skipif(not host_memory.SUPPORTED, reason="Linux's madvise only")
def test_a_big_tensor_gets_a_mapping_of_its_own_that_dies_with_it():
    t = host_memory.empty((3, 1 << 20), torch.float32)  # 12 MB
    assert t.shape == (3, 1 << 20) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % host_memory.HUGE_PAGE == 0
    t.fill_(2.0)
    assert float(t.sum()) == 2.0 * t.numel()
    address = t.data_ptr()
    mapping = _mapping_of(address)
    assert mapping is not None and mapping["Rss"] >= 12 * 1024
    if THP.exists() and "[never]" not in THP.read_text():
        assert mapping["AnonHugePages"] >= 10 * 1024  # all but the unaligned ends
    del t
    gc.collect()
    assert _mapping_of(address) is None  # unmapped, not kept by an allocator


def test_small_tensors_and_other_devices_take_torch_empty():
    small = host_memory.empty((16, 16), torch.bfloat16)
    assert small.shape == (16, 16) and small.dtype == torch.bfloat16
    assert host_memory.empty((4,), torch.float32, "meta").is_meta


def test_copy_keeps_the_values():
    t = torch.randn(1024, 1024)
    c = host_memory.copy(t)
    assert torch.equal(c, t) and c.data_ptr() != t.data_ptr()


@pytest.mark.skipif(not host_memory.SUPPORTED, reason="Linux's madvise only")
def test_a_kernel_refusing_the_advice_still_gets_its_tensor(monkeypatch):
    """A kernel built without transparent huge pages answers MADV_HUGEPAGE with EINVAL
    (here: an advice no kernel knows): the weights load in ordinary pages."""
    import mmap

    monkeypatch.setattr(mmap, "MADV_HUGEPAGE", 12345)
    t = host_memory.empty((1 << 20,), torch.float32)
    t.fill_(1.0)
    assert float(t.sum()) == t.numel()
