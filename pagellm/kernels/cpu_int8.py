"""W8A8 int8 GEMM for the CPU, as vLLM's dynamic int8 (compressed-tensors' W8A8): weights
quantized once per output channel, activations per token at every call, and one
`torch._int_mm` (oneDNN's int8 GEMM: VNNI's int8 dot products on AVX-512 and AVX-VNNI
CPUs, AMX on Xeons) accumulating exactly in int32:

    y[t, n] = (sum_k xq[t, k] wq[n, k]) * x_scale[t] * w_scale[n]
    xq = round(x / x_scale), x_scale[t] = max_k |x[t, k]| / 127 (symmetric)

Per-token and per-channel scales keep each request's result independent of the others in
its batch. Measured against fp32's GEMM on a 2-core AVX-512 VNNI CPU (docs/benchmarks-log.md:
`benchmarks/cpu_quant_kernels.py`), 2.3-17x faster at 1 to 128 rows, the activations'
quantization included; without int8 dot-product instructions (AVX2 only) 2.5-7x slower
(`fast_on_this_cpu`), though still a quarter of fp32's memory.
"""

from __future__ import annotations

from functools import cache

import torch

from pagellm.kernels.quant import RowScaledWeight, row_scales
from pagellm.kernels.quant import dequantize_rows as dequantize_rows  # this scheme's reference


class Int8Weight(RowScaledWeight):
    """weight [N, K] int8 with a scale per output channel."""


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """t [R, K] -> (int8 [R, K], fp32 scales [R, 1]): each row's largest magnitude maps to
    127."""
    scale = row_scales(t, 127)
    return torch.round(t.float() / scale).clamp(-127, 127).to(torch.int8), scale


def quantize_weight(weight: torch.Tensor) -> Int8Weight:
    """weight [N, K] -> per-output-channel int8 (module docstring)."""
    return Int8Weight.from_rows(*quantize_rows(weight))


def int8_linear(x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None = None
                ) -> torch.Tensor:
    """x [T, K] (any float dtype) -> [T, N] in x's dtype (+ bias), quantizing x per token
    first. `_int_mm` takes the weight's transpose as a view: its kernel reads the
    [N, K] rows as they are stored (measured faster than a [K, N] copy at one row)."""
    if x.shape[0] == 0:
        return x.new_empty(0, w.out_features)
    xq, x_scale = quantize_rows(x)
    y = (torch._int_mm(xq, w.weight.t()).float() * x_scale * w.scale).to(x.dtype)
    return y if bias is None else y + bias


@cache
def fast_on_this_cpu() -> bool:
    """Whether this CPU has int8 dot-product instructions (AVX-512 VNNI, AVX-VNNI or
    AMX), with which `_int_mm` outruns fp32's GEMM (module docstring)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return False
    return bool(flags & {"avx512_vnni", "avx_vnni", "amx_int8"})
