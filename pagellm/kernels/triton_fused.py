"""Fused elementwise kernels for the decoder on CUDA: RMSNorm with the residual add
before it, SiLU-and-mul, and the rotary embedding.

Why: on the first H200 run, batch-1 decode of Qwen2.5-1.5B took 3.2 ms a token against
a 0.72 ms memory roofline, and 2.6 ms of each step was the GPU's own time (the host
waited for it), inside a CUDA graph. Written as torch ops, a decoder layer launches
about 32 kernels: each RMSNorm is 9 (add, cast, pow, mean, add, rsqrt, mul, cast, mul),
the rotary embedding 4, SiLU-and-mul 2. At batch 1 each is a few microseconds of a
nearly idle GPU, about 900 a step. These kernels make those 26 launches 5.

Each keeps the torch version's arithmetic (layers.RMSNorm, rope.apply_rotary): the
same dtype roundings in the same order, fp32 inside, so outputs match it to the last
bit where the torch version does nothing but round exact products and sums (the rotary
embedding and the residual add) and to fp32 reduction order elsewhere (the RMSNorm's
mean). The rotary kernel compiles without fp fusion (`enable_fp_fusion=False`): with
it, ptxas turns a product and the sum after it into one fused multiply-add, skipping
the product's rounding (1 bf16 ulp off torch in about one value of 10^4 on the H200).
The torch versions stay the CPU path and these kernels' test references.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [T, N]
    residual_ptr,  # [T, N] (HAS_RESIDUAL)
    out_ptr,  # [T, N]
    sum_ptr,  # [T, N] x + residual, in x's dtype (HAS_RESIDUAL)
    weight_ptr,  # [N]
    stride_x, stride_r, stride_o, stride_s,
    n, eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,  # N rounded up to a power of two: one row per program
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_s + cols, x, mask=mask)
    h = x.to(tl.float32)
    variance = tl.sum(h * h, axis=0) / n
    normed = (h * tl.rsqrt(variance + eps)).to(x_ptr.dtype.element_ty)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * norm(x + residual), x + residual) as layers.RMSNorm computes them.

    x, residual: [T, N], last dimension contiguous; weight: [N]
    returns      [T, N] in weight and x's promoted dtype, and the sum ([T, N], x's
                 dtype; x itself without a residual)
    """
    rows, n = x.shape
    assert x.stride(1) == 1 and weight.shape == (n,) and weight.is_contiguous()
    out = torch.empty(rows, n, dtype=torch.promote_types(weight.dtype, x.dtype),
                      device=x.device)
    total = x
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(1) == 1
        assert residual.dtype == x.dtype, (residual.dtype, x.dtype)
        total = torch.empty_like(x, memory_format=torch.contiguous_format)
    if rows == 0:
        return out, total
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(rows,)](
        x, residual if residual is not None else x, out, total, weight,
        x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
        total.stride(0), n, eps, HAS_RESIDUAL=residual is not None, BLOCK=block,
        num_warps=min(16, max(1, block // 256)))
    return out, total


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr,  # [T, 2 * N]: gate | up
    out_ptr,  # [T, N]
    stride_in, stride_out,
    n,
    BLOCK: tl.constexpr,  # columns per program
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_in + n + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate_up_ptr.dtype.element_ty)  # F.silu rounds
    out = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up for gate_up = [gate | up]: [T, 2N], last dim contiguous -> [T, N]."""
    rows, width = gate_up.shape
    assert width % 2 == 0 and gate_up.stride(1) == 1
    n = width // 2
    out = torch.empty(rows, n, dtype=gate_up.dtype, device=gate_up.device)
    if rows == 0:
        return out
    block = min(1024, triton.next_power_of_2(n))
    _silu_and_mul_kernel[(rows, triton.cdiv(n, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), n, BLOCK=block, num_warps=4)
    return out


@triton.jit
def _rotary_kernel(
    x_ptr,  # [T, H, D], D contiguous
    cos_ptr,  # [T, 1, D]
    sin_ptr,  # [T, 1, D] signed: first half negated (rope.RotaryEmbedding.cos_sin)
    out_ptr,  # [T, H, D], contiguous
    stride_xt, stride_xh, stride_cos, stride_sin,
    num_heads,
    HALF: tl.constexpr,  # D // 2
    HALF_PAD: tl.constexpr,  # HALF rounded up to a power of two
    HEADS_PAD: tl.constexpr,  # num_heads rounded up to a power of two
):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HALF_PAD)[None, :]
    mask = (heads < num_heads) & (dims < HALF)
    base = x_ptr + t * stride_xt + heads * stride_xh + dims
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)  # [HEADS_PAD, HALF_PAD]
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    dim_mask = dims < HALF
    cos1 = tl.load(cos_ptr + t * stride_cos + dims, mask=dim_mask).to(tl.float32)  # [1, HALF_PAD]
    cos2 = tl.load(cos_ptr + t * stride_cos + HALF + dims, mask=dim_mask).to(tl.float32)
    sin1 = tl.load(sin_ptr + t * stride_sin + dims, mask=dim_mask).to(tl.float32)
    sin2 = tl.load(sin_ptr + t * stride_sin + HALF + dims, mask=dim_mask).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    # x * cos + cat(x2, x1) * signed_sin, each product and the sum rounded as torch does
    out1 = (x1 * cos1).to(dtype).to(tl.float32) + (x2 * sin1).to(dtype).to(tl.float32)
    out2 = (x2 * cos2).to(dtype).to(tl.float32) + (x1 * sin2).to(dtype).to(tl.float32)
    dest = out_ptr + (t * num_heads + heads) * (2 * HALF) + dims
    tl.store(dest, out1.to(dtype), mask=mask)
    tl.store(dest + HALF, out2.to(dtype), mask=mask)


def rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """rope.apply_rotary in one kernel. x: [T, H, D] (D contiguous, any token and head
    strides); cos, signed_sin: [T, 1, D] in x's dtype, D contiguous -> [T, H, D],
    contiguous."""
    tokens, heads, dim = x.shape
    assert x.stride(2) == 1 and dim % 2 == 0
    assert cos.shape == signed_sin.shape == (tokens, 1, dim)
    assert cos.stride(2) == 1 and signed_sin.stride(2) == 1
    assert cos.dtype == signed_sin.dtype == x.dtype, (cos.dtype, signed_sin.dtype, x.dtype)
    out = torch.empty(tokens, heads, dim, dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    _rotary_kernel[(tokens,)](x, cos, signed_sin, out, x.stride(0), x.stride(1),
                              cos.stride(0), signed_sin.stride(0), heads, HALF=dim // 2,
                              HALF_PAD=triton.next_power_of_2(dim // 2),
                              HEADS_PAD=triton.next_power_of_2(heads), num_warps=4,
                              # Each product rounded before the sum, as torch's: with
                              # fusion ptxas makes x1 * cos1 + p one fma.rn.bf16x2, whose
                              # unrounded product was 1 bf16 ulp off torch on the H200.
                              enable_fp_fusion=False)
    return out
