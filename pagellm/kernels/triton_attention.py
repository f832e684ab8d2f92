"""Triton paged attention for CUDA: the launchers of the KV-cache write and of paged
attention over a mixed batch, and the probe of whether Triton's interpreter runs here.

Same contract and layouts as `kernels/reference.py` (its torch functions are these
kernels' references and the CPU path):

    kv_cache[0 = K | 1 = V, block_id, slot_in_block, kv_head, head_dim]

The @triton.jit kernels, and how they tile the work, are in triton_attention_kernels.py;
the launchers here check every input, size the tiles (`tile_shape`, `tile_keys`), and
pick the grid and the split-KV scratch. The launchers call the kernels by this module's
names for them, which tests/support/compile_kernels.py swaps for recorders.

Under TRITON_INTERPRET=1 (CPU tests) the kernels compute in fp32 (`_computes_in_fp32`):
the interpreter gets bf16 arithmetic and bf16 `tl.dot` wrong.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import torch
import triton
import triton.language as tl

from pagellm.kernels.reference import FP8, FP8_MAX, to_cache_dtype
from pagellm.kernels.triton_attention_kernels import (
    _merge_segments_kernel,
    _paged_attention_kernel,
    _write_kv_cache_kernel,
)

SUPPORTED_HEAD_SIZES = (16, 32, 64, 80, 96, 128, 256)
SUPPORTED_BLOCK_SIZES = (16, 32)
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _loop_bound_probe_kernel(ptr):  # ptr: [1 + ptr[0]] int64
    """A loop bounded by a loaded value, as the attention kernel's KV loop is."""
    n = tl.load(ptr)
    for i in range(0, n):
        tl.store(ptr + 1 + i, i)


@functools.cache
def interpreter_fault() -> str | None:
    """Why Triton's interpreter cannot run these kernels here, or None (probed once).

    Triton 3.6's interpreter turns a loaded scalar into a loop bound with int() of a
    one-element array, which numpy 2.5 refuses (deprecated since numpy 1.25; Triton 3.7
    squeezes it first): there every attention launch fails inside the interpreter with
    "only 0-dimensional arrays can be converted to Python scalars". Compiled for a GPU
    the kernels never meet it. Only meaningful under TRITON_INTERPRET=1."""
    data = torch.tensor([2, -1, -1], dtype=torch.int64)
    try:
        _loop_bound_probe_kernel[(1,)](data)
    except Exception as e:  # the interpreter wraps what failed in its own error
        return (f"Triton {triton.__version__}'s interpreter fails with numpy "
                f"{np.__version__} ({type(e).__name__}: {e}); Triton >= 3.7 or numpy < 2.5 "
                "runs it")
    if data.tolist() != [2, 0, 1]:
        return f"Triton {triton.__version__}'s interpreter ran a probe loop wrong: {data}"
    return None


# --------------------------------------------------------------------------- KV write


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Scatter the step's K/V into the paged cache (see reference.write_kv_cache).

    key, value:   [num_tokens, num_kv_heads, head_dim], head_dim contiguous
    kv_cache:     [2, num_blocks, block_size, num_kv_heads, head_dim], contiguous
    slot_mapping: [num_tokens] int64
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape, (key.shape, value.shape)
    assert key.stride(-1) == 1 and value.stride(-1) == 1, "head_dim must be contiguous"
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2 and kv_cache.is_contiguous()
    assert kv_cache.shape[3:] == (num_kv_heads, head_dim), (kv_cache.shape, key.shape)
    assert kv_cache.shape[2] in SUPPORTED_BLOCK_SIZES, kv_cache.shape
    assert slot_mapping.shape == (num_tokens,) and slot_mapping.dtype == torch.int64
    assert key.dtype in _DTYPES and kv_cache.dtype in (*_DTYPES, FP8)
    if num_tokens == 0:
        return
    if kv_cache.dtype == FP8 and interpreting():
        # The interpreter's fp32 -> e4m3 rounds wrongly where rounding up crosses a power
        # of two (31.5 -> 16): hand it values e4m3 holds exactly (torch's rounding).
        key, value = (to_cache_dtype(t, FP8).to(t.dtype) for t in (key, value))
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _write_kv_cache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        num_kv_heads,
        HEAD_DIM=head_dim, HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        DIM_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=kv_cache.shape[2],
        FP8_MAX=FP8_MAX if kv_cache.dtype == FP8 else 0.0)


# --------------------------------------------------------------------------- attention


def tile_shape(group: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_Q): at least 16 rows (the smallest tl.dot on a GPU), as many
    whole query tokens as fit."""
    block_m = max(16, triton.next_power_of_2(group))
    return block_m, block_m // group


def tile_keys(block_size: int, head_dim: int, dtype: torch.dtype, num_segments: int = 1) -> int:
    """Keys per iteration of the attention loop: a K tile of up to 16 KB (64 keys of a
    bf16 head of 128, counted in fp32 where the kernel computes in it), 32 KB under
    split-KV (num_segments > 1) in 16-bit dtypes, at least one KV block, at most 128
    keys (registers). fp32 keeps 16 KB: at 32 KB it spills (tests/support/compile_kernels.py).

    Measured on an H200 (bf16, head 128, kernel_bench.py --tile, 2026-11-27): with one
    segment per request 64 keys beat 128 (106% against 88% of copy bandwidth at
    256 x 32k, 102 against 86 at 256 x 8k); split into segments 128 keys beat 64
    everywhere (64 x 32k, 4 segments: 85 against 76%; 16 x 32k, 16: 77 against 69;
    1 x 32k, 64: 31 against 26). A split program walks a short slice, where the larger
    tile's fewer, longer iterations keep more loads in flight."""
    dim_pad = triton.next_power_of_2(head_dim)
    element_size = 4 if _computes_in_fp32(dtype) else dtype.itemsize
    budget = 32768 if num_segments > 1 and element_size == 2 else 16384
    return max(block_size, min(128, budget // (dim_pad * element_size)))


def _computes_in_fp32(dtype: torch.dtype) -> bool:
    """The kernel casts every load to fp32 for fp32 inputs and under the interpreter
    (its bf16 arithmetic is wrong)."""
    return dtype == torch.float32 or interpreting()


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                    max_query_len: int, num_segments: int = 1,
                    out: torch.Tensor | None = None, tile: int | None = None,
                    sliding_window: int | None = None, softcap: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal paged attention for a mixed batch in one launch (see module docstring).

    query:           [num_tokens, num_heads, head_dim], head_dim contiguous
    kv_cache:        [2, num_blocks, block_size, num_kv_heads, head_dim], contiguous;
                     query's dtype, e4m3 or bf16
    block_tables:    [num_reqs, max_blocks] int32, rows contiguous
    query_start_loc: [num_reqs + 1] int32 (device)
    seq_lens:        [num_reqs] int32 (device)
    max_query_len:   the longest query (host int); num_segments > 1 (split-KV) needs 1
    tile:            keys per loop iteration (a multiple of the block size; None:
                     `tile_keys`), for benchmarks
    sliding_window:  W: a query at position p sees keys p - W < j <= p (None: j <= p);
                     blocks wholly before a program's windows are never read (the KV
                     cache manager may have freed them: their table entries name any
                     block)
    softcap:         c: scores s become c * tanh(s / c) before the mask (None: off)
    sinks:           [num_heads] attention sinks (gpt-oss: a logit per head in every
                     softmax's denominator, kernels/reference.py; None: off)
    returns          [num_tokens, num_heads, head_dim], query's dtype
    """
    num_tokens, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, kv_head_dim = kv_cache.shape
    num_reqs = seq_lens.shape[0]
    assert kv_head_dim == head_dim and head_dim in SUPPORTED_HEAD_SIZES, (head_dim,
                                                                         kv_head_dim)
    assert block_size in SUPPORTED_BLOCK_SIZES, block_size
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert query.stride(-1) == 1 and kv_cache.is_contiguous()
    # (the kernel reads keys and values in the query's dtype: an e4m3 or bf16 cache widens)
    assert query.dtype in _DTYPES and kv_cache.dtype in (query.dtype, FP8, torch.bfloat16), (
        query.dtype, kv_cache.dtype)
    assert block_tables.dtype == torch.int32 and block_tables.stride(1) == 1
    assert block_tables.shape[0] >= num_reqs
    assert query_start_loc.shape == (num_reqs + 1,) and query_start_loc.dtype == torch.int32
    assert seq_lens.dtype == torch.int32
    assert num_segments == 1 or max_query_len == 1, "split-KV is for decode-only batches"
    assert triton.next_power_of_2(num_segments) == num_segments
    assert sliding_window is None or (isinstance(sliding_window, int)
                                      and 1 <= sliding_window < 2**31), sliding_window
    assert softcap is None or softcap > 0, softcap
    if sinks is not None:
        assert sinks.shape == (num_heads,) and sinks.device == query.device, sinks.shape
        sinks = sinks.float().contiguous()
    if out is None:
        out = torch.empty_like(query)
    assert out.shape == query.shape and out.stride(-1) == 1
    if num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    block_m, block_q = tile_shape(group)
    dim_pad = triton.next_power_of_2(head_dim)
    cast_fp32 = _computes_in_fp32(query.dtype)
    if tile is None:
        tile = tile_keys(block_size, head_dim, query.dtype, num_segments)
    assert tile % block_size == 0 and triton.next_power_of_2(tile) == tile, (tile, block_size)
    if num_segments > 1:
        segm_out = torch.empty(num_tokens, num_heads, num_segments, dim_pad,
                               dtype=torch.float32, device=query.device)
        segm_max = torch.empty(num_tokens, num_heads, num_segments, dtype=torch.float32,
                               device=query.device)
        segm_sum = torch.empty_like(segm_max)
    else:
        segm_out = segm_max = segm_sum = out  # unused
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    grid = (num_tokens // block_q + num_reqs, num_kv_heads, num_segments)
    _paged_attention_kernel[grid](
        out, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        segm_out, segm_max, segm_sum, scale, num_reqs,
        # The flags below say whether these are read: unused values are never looked at.
        0 if sliding_window is None else sliding_window,
        1.0 if softcap is None else float(softcap),
        out if sinks is None else sinks,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, HEAD_DIM=head_dim, DIM_PAD=dim_pad,
        BLOCK_SIZE=block_size, TILE=tile, NUM_SEGMENTS=num_segments, CAST_FP32=cast_fp32,
        PRECISION="ieee" if cast_fp32 else None,
        USE_SLIDING_WINDOW=sliding_window is not None, USE_SOFTCAP=softcap is not None,
        USE_SINKS=sinks is not None)
    if num_segments > 1:
        _merge_segments_kernel[(num_tokens, num_heads)](
            out, segm_out, segm_max, segm_sum, out if sinks is None else sinks, num_heads,
            out.stride(0), out.stride(1), HEAD_DIM=head_dim, DIM_PAD=dim_pad,
            NUM_SEGMENTS=num_segments, USE_SINKS=sinks is not None)
    return out
