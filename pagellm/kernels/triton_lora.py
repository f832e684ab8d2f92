"""LoRA for CUDA: a mixed batch's adapter updates of one projection in two launches
(Punica's and vLLM's shrink and expand), whatever the number of adapters in the step.

The model runner orders a step's requests by adapter, so each adapter's tokens are one
run of rows, and `runs` [R, 3] int32 lists them on the device as (slot, start, end):
R is the slot count (max_loras) and unused rows are (0, 0, 0). For every run

    s[start:end, :w]  = x[start:end] @ a[slot, :w]^T           shrink, to the rank
    y[start:end]     += s[start:end, :w] @ b[slot, :, :w]^T    expand, back, in place

with w = widths[slot] (parts * rank; 0 where the adapter leaves this projection alone).
Rows in no run (the base model's requests, CUDA-graph padding) are not touched.

The grids depend on shapes alone (R x row tiles of T x column tiles), never on the runs:
a program whose tile starts past its run's end or its slot's width returns at once. So
nothing is read back to the host, and a decode step's CUDA graph records both launches
and reads each replay's runs and widths from buffers whose contents change between
replays (executor/model/lora_slots.py, executor/worker/step_inputs.py).

Shrink is a long, thin dot (an adapter's a[slot] is w x 4096 for a 4096-wide model); at
a few rows one program per column tile would leave the GPU idle, so shrink splits K
over SPLIT_K programs, each writing its own fp32 partial s[split] [SPLIT_K, T, W], which
expand sums as it reads: no atomics, no memset, the same result every run. Everything
accumulates in fp32; fp32 inputs use an "ieee" `tl.dot` (no TF32); s is rounded to the
model's dtype before expand, as torch's 16-bit GEMM rounds its output (lora_slots.py's
CPU path). Under TRITON_INTERPRET=1 every load is cast to fp32 first (the interpreter
gets bf16 arithmetic wrong). Tile sizes are untuned defaults (`lora_tiles`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagellm.kernels.triton_attention import interpreting

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class LoRATiles:
    block_m: int  # rows per program (both kernels)
    shrink_n: int  # rank columns per shrink program
    shrink_k: int
    split_k: int  # shrink programs sharing one tile's K
    expand_n: int  # output columns per expand program
    expand_k: int  # rank columns per expand iteration


def lora_tiles(num_tokens: int, in_features: int, max_width: int, dtype: torch.dtype
               ) -> LoRATiles:
    """Untuned defaults: 16-row tiles for decode-sized steps (tl.dot's least), wider for
    prompt chunks; K split 1024 wide (at most 8 ways) while there are at most 64 rows."""
    block_m = 16 if num_tokens <= 16 else 32 if num_tokens <= 128 else 64
    shrink_n = min(64, max(16, triton.next_power_of_2(max_width)))
    shrink_k = 32 if dtype == torch.float32 else 64
    split_k = max(1, min(8, in_features // 1024)) if num_tokens <= 64 else 1
    return LoRATiles(block_m, shrink_n, shrink_k, split_k, expand_n=64, expand_k=16)


@triton.jit(do_not_specialize=["num_tokens"])
def _lora_shrink_kernel(
    x_ptr,  # [T, K] (rows x_stride apart, columns contiguous)
    a_ptr,  # [S, W, K] contiguous: slot s's rows [:widths[s]] are its adapter's
    widths_ptr,  # [S] int32
    runs_ptr,  # [R, 3] int32: (slot, start row, end row)
    s_ptr,  # [SPLIT_K, T, W] fp32 out: each split's partial sum
    num_tokens,
    in_features,
    max_width,
    x_stride,
    k_per_split,  # a multiple of BLOCK_K
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CAST_FP32: tl.constexpr,  # compute everything in fp32 (fp32 inputs, or interpreting)
    PRECISION: tl.constexpr,  # tl.dot input precision: "ieee" for fp32 inputs (no TF32)
):
    run = tl.program_id(0)
    start = tl.load(runs_ptr + run * 3 + 1)
    end = tl.minimum(tl.load(runs_ptr + run * 3 + 2), num_tokens)  # never past x
    row0 = start + tl.program_id(1) * BLOCK_M
    if row0 >= end:
        return
    slot = tl.load(runs_ptr + run * 3).to(tl.int64)
    width = tl.load(widths_ptr + slot)
    col_tiles = tl.cdiv(max_width, BLOCK_N)
    col0 = (tl.program_id(2) % col_tiles) * BLOCK_N
    if col0 >= width:
        return
    split = tl.program_id(2) // col_tiles
    rows = row0 + tl.arange(0, BLOCK_M)
    row_mask = rows < end
    cols = col0 + tl.arange(0, BLOCK_N)
    col_mask = cols < width
    ks = split * k_per_split + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * x_stride + ks[None, :]  # [BLOCK_M, BLOCK_K]
    # [BLOCK_K, BLOCK_N]: column n of the tile is row n of the slot's a
    a_ptrs = a_ptr + slot * max_width * in_features + cols[None, :] * in_features + ks[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, k_per_split, BLOCK_K):
        k_mask = ks < in_features - k
        xv = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        av = tl.load(a_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        if CAST_FP32:
            xv = xv.to(tl.float32)
            av = av.to(tl.float32)
        acc = tl.dot(xv, av, acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    dest = s_ptr + (split * num_tokens + rows.to(tl.int64))[:, None] * max_width + cols[None, :]
    tl.store(dest, acc, mask=row_mask[:, None] & col_mask[None, :])


@triton.jit(do_not_specialize=["num_tokens"])
def _lora_expand_kernel(
    s_ptr,  # [SPLIT_K, T, W] fp32: shrink's partial sums
    b_ptr,  # [S, N, W] contiguous: slot s's columns [:widths[s]] are its adapter's
    widths_ptr,  # [S] int32
    runs_ptr,  # [R, 3] int32: (slot, start row, end row)
    y_ptr,  # [T, N] (rows y_stride apart, columns contiguous): updated in place
    num_tokens,
    out_features,
    max_width,
    y_stride,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CAST_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    run = tl.program_id(0)
    start = tl.load(runs_ptr + run * 3 + 1)
    end = tl.minimum(tl.load(runs_ptr + run * 3 + 2), num_tokens)  # never past x
    row0 = start + tl.program_id(1) * BLOCK_M
    if row0 >= end:
        return
    slot = tl.load(runs_ptr + run * 3).to(tl.int64)
    width = tl.load(widths_ptr + slot)
    if width == 0:
        return
    rows = row0 + tl.arange(0, BLOCK_M)
    row_mask = rows < end
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < out_features
    ks = tl.arange(0, BLOCK_K)
    s_ptrs = s_ptr + rows.to(tl.int64)[:, None] * max_width + ks[None, :]  # [BLOCK_M, BLOCK_K]
    # [BLOCK_K, BLOCK_N]: column n of the tile is row n of the slot's b
    b_ptrs = b_ptr + slot * out_features * max_width + cols[None, :].to(tl.int64) * max_width \
        + ks[:, None]
    split_stride = num_tokens.to(tl.int64) * max_width
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # Bounded by the widest slot, not this one's width: a loop bound loaded from memory
    # breaks some Triton interpreters (triton_attention.interpreter_fault); the masks
    # keep the columns past `width` out.
    for k in range(0, max_width, BLOCK_K):
        k_mask = ks < width - k
        sv = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
        for split in tl.static_range(SPLIT_K):
            sv += tl.load(s_ptrs + split * split_stride,
                          mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        bv = tl.load(b_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        if CAST_FP32:
            bv = bv.to(tl.float32)
        else:
            sv = sv.to(b_ptr.dtype.element_ty)
        acc = tl.dot(sv, bv, acc, input_precision=PRECISION)
        s_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    y_ptrs = y_ptr + rows.to(tl.int64)[:, None] * y_stride + cols[None, :]
    mask = row_mask[:, None] & col_mask[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + acc).to(y_ptr.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
           widths: torch.Tensor, runs: torch.Tensor) -> None:
    """Raise ValueError naming the first input that breaks lora_add's contract (shapes,
    dtypes and layouts only: runs and widths are never read back to the host)."""
    if x.dtype not in _DTYPES or {y.dtype, a.dtype, b.dtype} != {x.dtype}:
        raise ValueError(f"x, y, a and b must share one of fp32/fp16/bf16, got {x.dtype}, "
                         f"{y.dtype}, {a.dtype}, {b.dtype}")
    if x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0] or x.stride(1) != 1 \
            or y.stride(1) != 1:
        raise ValueError(f"x [T, K] and y [T, N] must be row-major, got {tuple(x.shape)} "
                         f"and {tuple(y.shape)}")
    slots, max_width, in_features = a.shape
    if in_features != x.shape[1] or b.shape != (slots, y.shape[1], max_width) \
            or not a.is_contiguous() or not b.is_contiguous():
        raise ValueError(f"a must be a contiguous [S, W, K] and b [S, N, W] with K = "
                         f"{x.shape[1]}, N = {y.shape[1]}, got {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
    if widths.shape != (slots,) or widths.dtype != torch.int32:
        raise ValueError(f"widths must be int32 [{slots}], got {widths.dtype} "
                         f"{tuple(widths.shape)}")
    if runs.dim() != 2 or runs.shape[1] != 3 or runs.dtype != torch.int32 \
            or not runs.is_contiguous():
        raise ValueError(f"runs must be a contiguous int32 [R, 3], got {runs.dtype} "
                         f"{tuple(runs.shape)}")


def lora_add(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             widths: torch.Tensor, runs: torch.Tensor, tiles: LoRATiles | None = None
             ) -> None:
    """y += each run's adapter update of x, in place (module docstring).

    x:      [T, K] fp32/fp16/bf16, row-major (row stride free)
    y:      [T, N] x's dtype, row-major: the base projection's output
    a:      [S, W, K] x's dtype, contiguous: every slot's shrink weights
    b:      [S, N, W] x's dtype, contiguous: every slot's expand weights
    widths: [S] int32: columns of b (rows of a) each slot uses
    runs:   [R, 3] int32, contiguous: (slot, start, end) row runs, (0, 0, 0) unused
    tiles:  tile sizes (None: `lora_tiles`), for tests and benchmarks

    Two launches fixed by the shapes; reads nothing back, so a CUDA graph can hold it.
    """
    _check(x, y, a, b, widths, runs)
    num_tokens, in_features = x.shape
    max_width = a.shape[1]
    out_features = y.shape[1]
    if num_tokens == 0 or runs.shape[0] == 0:
        return
    if tiles is None:
        tiles = lora_tiles(num_tokens, in_features, max_width, x.dtype)
    cast_fp32 = x.dtype == torch.float32 or interpreting()
    common = dict(CAST_FP32=cast_fp32, PRECISION="ieee" if cast_fp32 else None)
    k_per_split = triton.cdiv(triton.cdiv(in_features, tiles.split_k), tiles.shrink_k) \
        * tiles.shrink_k
    split_k = triton.cdiv(in_features, k_per_split)  # every split has some of K
    s = torch.empty(split_k, num_tokens, max_width, dtype=torch.float32, device=x.device)
    row_tiles = triton.cdiv(num_tokens, tiles.block_m)
    _lora_shrink_kernel[(runs.shape[0], row_tiles,
                         triton.cdiv(max_width, tiles.shrink_n) * split_k)](
        x, a, widths, runs, s, num_tokens, in_features, max_width, x.stride(0), k_per_split,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.shrink_n, BLOCK_K=tiles.shrink_k, **common)
    _lora_expand_kernel[(runs.shape[0], row_tiles, triton.cdiv(out_features, tiles.expand_n))](
        s, b, widths, runs, y, num_tokens, out_features, max_width, y.stride(0),
        SPLIT_K=split_k, BLOCK_M=tiles.block_m, BLOCK_N=tiles.expand_n,
        BLOCK_K=tiles.expand_k, **common)
