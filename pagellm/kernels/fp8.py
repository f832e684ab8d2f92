"""FP8 (e4m3) W8A8 GEMM, as vLLM's dynamic `quantization="fp8"`: weights quantized once
per output channel, activations per token at every call, and one `torch._scaled_mm`
(cuBLASLt's FP8 GEMM on Hopper and Ada) applying both scales to the fp32 accumulator:

    y[t, n] = sum_k xq[t, k] wq[n, k] * x_scale[t] * w_scale[n]
    xq = x / x_scale (rounded to e4m3), x_scale[t] = max_k |x[t, k]| / 448

Per-token and per-channel scales keep each request's result independent of the others
in its batch (a per-tensor activation scale would not). torch's CPU `_scaled_mm` is a
slow reference (40-60x fp32's GEMM on an AVX2 CPU): the CPU runs this only in tests.
"""

from __future__ import annotations

import torch

from pagellm.kernels.quant import RowScaledWeight, row_scales
from pagellm.kernels.quant import dequantize_rows as dequantize_rows  # this scheme's reference

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


class Fp8Weight(RowScaledWeight):
    """weight [N, K] e4m3 with a scale per output channel."""


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """t [R, K] -> (e4m3 [R, K], fp32 scales [R, 1]): each row's largest magnitude maps
    to e4m3's largest value (448)."""
    scale = row_scales(t, FP8_MAX)
    return (t.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_weight(weight: torch.Tensor) -> Fp8Weight:
    """weight [N, K] -> per-output-channel e4m3 (module docstring)."""
    return Fp8Weight.from_rows(*quantize_rows(weight))


def fp8_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None
               ) -> torch.Tensor:
    """x [T, K] (any float dtype) -> [T, N] in x's dtype (+ bias), quantizing x per
    token first. cuBLASLt's row-wise FP8 GEMM writes bf16 only, so other dtypes on CUDA
    are computed in bf16 and cast."""
    xq, x_scale = quantize_rows(x)
    out_dtype = x.dtype if (x.dtype == torch.bfloat16 or not x.is_cuda) else torch.bfloat16
    y = torch._scaled_mm(xq, w.weight.t(), scale_a=x_scale, scale_b=w.scale,
                         out_dtype=out_dtype).to(x.dtype)
    return y if bias is None else y + bias
