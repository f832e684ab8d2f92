"""The decoder's elementwise steps on the CPU in one C++ pass each
(csrc/cpu_elementwise.cpp), with kernels/triton_fused.py's signatures, so that
`kernels.fused_for` hands the model's layers one module or the other: RMSNorm with the
residual add before it, SiLU-and-mul, the rotary embedding.

Why: as torch ops a prompt step's RMSNorm is 5-9 passes over its [T, hidden] rows, each
allocating its output, the rotary embedding 4 and SiLU-and-mul 2; at 2048 prompt tokens
they were about a tenth of an int8 prefill's time. Each keeps the torch version's
arithmetic and roundings (the torch versions stay the references: layers.RMSNorm.reference,
rope.rotate); see the C++ file for where they can differ (a mean's summation order, an
exp within 2 ulp). fp32 and bf16 only (`fused_for` keeps other dtypes on torch's ops).
"""

from __future__ import annotations

import torch

from pagellm.kernels import cpu_ops

DTYPES = (torch.float32, torch.bfloat16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * norm(x + residual), x + residual) as layers.RMSNorm computes them.
    x, residual: [T, N]; weight: [N] -> [T, N] in weight's and x's promoted dtype, and
    the sum ([T, N], x's dtype; x itself without a residual)."""
    out, total = cpu_ops.load().add_rms_norm(x, weight, eps, residual)
    return out, total


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up for gate_up = [gate | up]: [T, 2N] -> [T, N]."""
    return cpu_ops.load().silu_and_mul(gate_up)


def rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """rope.rotate in one pass. x: [T, H, D] (D contiguous); cos, signed_sin: [T, 1, D]
    of x's dtype -> [T, H, D], contiguous."""
    return cpu_ops.load().rotary(x, cos, signed_sin)
