"""Weight-only int4/int8 GEMM for CUDA with the dequantization fused: y = x W^T where W
is read packed (kernels/quant.py's layout) and dequantized tile by tile in registers,
so a decode step reads 4 or 8 bits per weight instead of 16.

Each program computes a [BLOCK_M, BLOCK_N] tile of y over one slice of K. A K tile of
BLOCK_K rows lies inside one quantization group (BLOCK_K divides the group size), so it
takes one row of scales and zeros; its codes are BLOCK_K / (32 / BITS) int32 rows of
qweight, each loaded once per code it holds (the repeats hit the cache) and shifted
into place:

    w[k, n] = ((qweight[k // P, n] >> (BITS * (k % P))) & (2^BITS - 1) - zeros[g, n])
              * scales[g, n]         with P = 32 / BITS, g = k // group_size

then multiplied with the x tile by `tl.dot` in x's dtype with an fp32 accumulator
(fp32 inputs: an "ieee" dot, no TF32). With few rows (a decode step) the N tiles alone
would leave most of the GPU idle, so K is split over SPLIT_K programs that write fp32
partials [SPLIT_K, M, N], summed by one torch reduction (a fixed order: the same result
every run). Under TRITON_INTERPRET=1 (CPU tests) every load is cast to fp32 first. Tile
sizes are untuned defaults (`quant_tiles`) until a GPU session measures them. The
packed tensors' rows may be wider than N (`w_stride`): one expert's slice of stacked
experts packed as one weight (executor/model/moe.py) is read in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagellm.kernels.quant import PackedWeight
from pagellm.kernels.triton_attention import interpreting

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class QuantTiles:
    block_m: int
    block_n: int
    block_k: int  # divides the group size
    split_k: int


def quant_tiles(num_tokens: int, out_features: int, in_features: int, group_size: int
                ) -> QuantTiles:
    """Untuned defaults: 16-row tiles up to 16 rows, 64 beyond; K split so that a
    decode-sized step has about 256 programs."""
    block_m = 16 if num_tokens <= 16 else 32 if num_tokens <= 64 else 64
    block_n = 64
    block_k = min(group_size, 64)
    programs = triton.cdiv(num_tokens, block_m) * triton.cdiv(out_features, block_n)
    split_k = 1
    while (programs * split_k < 256 and split_k < 16
           and in_features // (2 * split_k) >= 4 * block_k):
        split_k *= 2
    return QuantTiles(block_m, block_n, block_k, split_k)


@triton.jit(do_not_specialize=["num_tokens"])
def _quant_matmul_kernel(
    x_ptr,  # [M, K] (rows x_stride apart, columns contiguous)
    qweight_ptr,  # [K / P, N] int32: P = 32 / BITS codes along K each (rows w_stride apart)
    scales_ptr,  # [K / G, N] (rows w_stride apart)
    zeros_ptr,  # [K / G, N] (rows w_stride apart)
    out_ptr,  # [SPLIT_K, M, N] fp32 partials (or [M, N] in y's dtype when SPLIT_K = 1)
    num_tokens,
    in_features,
    out_features,
    x_stride,
    w_stride,  # the packed tensors' row stride: N, or more for a slice of a wider weight
    k_per_split,  # a multiple of BLOCK_K
    group_size,
    BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CAST_FP32: tl.constexpr,  # compute everything in fp32 (fp32 inputs, or interpreting)
    PRECISION: tl.constexpr,  # tl.dot input precision: "ieee" for fp32 inputs (no TF32)
):
    PER_INT: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    row_mask = rows < num_tokens
    col_mask = cols < out_features
    ks = split * k_per_split + tl.arange(0, BLOCK_K)  # [BLOCK_K]
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * x_stride + ks[None, :]  # [BLOCK_M, BLOCK_K]
    q_ptrs = qweight_ptr + (ks // PER_INT).to(tl.int64)[:, None] * w_stride \
        + cols[None, :]  # [BLOCK_K, BLOCK_N]
    shifts = ((ks % PER_INT) * BITS)[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, k_per_split, BLOCK_K):
        k_start = split * k_per_split + k
        if k_start < in_features:  # the last split may hold fewer tiles
            group = (k_start // group_size).to(tl.int64)
            scale = tl.load(scales_ptr + group * w_stride + cols, mask=col_mask,
                            other=0.0).to(tl.float32)
            zero = tl.load(zeros_ptr + group * w_stride + cols, mask=col_mask,
                           other=0.0).to(tl.float32)
            codes = (tl.load(q_ptrs, mask=col_mask[None, :], other=0) >> shifts) & MASK
            w = (codes.to(tl.float32) - zero[None, :]) * scale[None, :]  # [BLOCK_K, BLOCK_N]
            xv = tl.load(x_ptrs, mask=row_mask[:, None], other=0.0)
            if CAST_FP32:
                xv = xv.to(tl.float32)
            else:
                w = w.to(x_ptr.dtype.element_ty)
            acc = tl.dot(xv, w, acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        q_ptrs += (BLOCK_K // PER_INT) * w_stride
    dest = out_ptr + (split * num_tokens + rows.to(tl.int64))[:, None] * out_features \
        + cols[None, :]
    tl.store(dest, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def _check(x: torch.Tensor, w: PackedWeight, tiles: QuantTiles) -> None:
    """Raise ValueError naming the first input that breaks quant_matmul's contract."""
    if x.dtype not in _DTYPES:
        raise ValueError(f"x must be fp32, fp16 or bf16, not {x.dtype}")
    if x.dim() != 2 or x.stride(1) != 1 or x.shape[1] != w.in_features:
        raise ValueError(f"x must be a row-major [M, {w.in_features}], got {tuple(x.shape)}")
    groups = w.in_features // w.group_size
    stride = w.qweight.stride(0)  # a slice of a wider weight's columns (an expert's) too
    for name, t in (("scales", w.scales), ("zeros", w.zeros)):
        if t.dtype != x.dtype or t.shape != (groups, w.out_features) or t.stride(1) != 1 \
                or (groups > 1 and t.stride(0) != stride):
            raise ValueError(f"{name} must be a {x.dtype} [{groups}, {w.out_features}] with "
                             f"qweight's row stride {stride}, got {t.dtype} {tuple(t.shape)} "
                             f"strides {t.stride()}")
    if w.qweight.dtype != torch.int32 or w.qweight.stride(1) != 1:
        raise ValueError(f"qweight must be int32 with contiguous rows, got {w.qweight.dtype} "
                         f"strides {w.qweight.stride()}")
    if w.group_size % tiles.block_k:
        raise ValueError(f"block_k {tiles.block_k} must divide group_size {w.group_size}")


def quant_matmul(x: torch.Tensor, w: PackedWeight, tiles: QuantTiles | None = None
                 ) -> torch.Tensor:
    """x [M, K] @ dequantize(w)^T -> [M, N] in x's dtype (module docstring).

    x:     [M, K] fp32/fp16/bf16, row-major (row stride free)
    w:     a PackedWeight with scales and zeros in x's dtype, K = w.in_features
    tiles: tile sizes (None: `quant_tiles`), for tests and benchmarks

    One launch (and a sum over the K splits when there are several), fixed by the
    shapes: a CUDA graph can hold it.
    """
    num_tokens = x.shape[0]
    if tiles is None:
        tiles = quant_tiles(num_tokens, w.out_features, w.in_features, w.group_size)
    _check(x, w, tiles)
    if num_tokens == 0:
        return x.new_empty(0, w.out_features)
    cast_fp32 = x.dtype == torch.float32 or interpreting()
    k_per_split = triton.cdiv(triton.cdiv(w.in_features, tiles.split_k), tiles.block_k) \
        * tiles.block_k
    split_k = triton.cdiv(w.in_features, k_per_split)
    out = torch.empty(split_k, num_tokens, w.out_features, device=x.device,
                      dtype=x.dtype if split_k == 1 else torch.float32)
    grid = (triton.cdiv(num_tokens, tiles.block_m), triton.cdiv(w.out_features, tiles.block_n),
            split_k)
    _quant_matmul_kernel[grid](
        x, w.qweight, w.scales, w.zeros, out, num_tokens, w.in_features, w.out_features,
        x.stride(0), w.qweight.stride(0), k_per_split, w.group_size, BITS=w.bits,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, CAST_FP32=cast_fp32,
        PRECISION="ieee" if cast_fp32 else None)
    return out[0] if split_k == 1 else out.sum(dim=0).to(x.dtype)
