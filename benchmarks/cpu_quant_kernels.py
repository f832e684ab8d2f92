"""Which int8/int4 GEMM does torch offer the CPU? Batch-1 (and batch-4) `x @ W^T` per
call, against torch's fp32 F.linear on the same shapes, in one run (ratios are the
claim: the machines are shared and noisy).

    python benchmarks/cpu_quant_kernels.py            # one thread, two shapes
    python benchmarks/cpu_quant_kernels.py --threads 2 --shapes 3072x576 4096x4096

Candidates: weight-only int8 (`aten._weight_int8pack_mm`, per-channel scales), weight-
only int4 (`aten._weight_int4pack_mm_for_cpu`, groups of 64), int8 x int8 (`_int_mm`),
fbgemm's dynamic W8A8 (`quantized::linear_dynamic`, per-channel int8 weights,
activations quantized per tensor at each call), and pagellm's own int4/int8 kernel
(kernels/cpu_int_gemm.py: groups of 128, activations per token and group). Each one's
error against fp32 is printed beside its time (issue 43; BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from pagellm.kernels import cpu_int_gemm
from pagellm.kernels.quant import quantize


def per_call_us(fn: Callable[[], torch.Tensor], calls: int) -> float:
    for _ in range(5):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def int_mm(x: torch.Tensor, w8t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x quantized per tensor to int8, times the int8 weight [K, N], scaled back."""
    x_scale = x.abs().amax() / 127
    return torch._int_mm(torch.round(x / x_scale).to(torch.int8), w8t).float() \
        * x_scale * scale


def candidates(w: torch.Tensor) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    n, k = w.shape
    scale = w.abs().amax(dim=1) / 127
    w8 = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    group = 64
    grouped = w.view(n, k // group, group)
    low, high = grouped.amin(-1), grouped.amax(-1)
    step = (high - low) / 15
    codes = torch.round((grouped - low[..., None]) / step[..., None]).clamp(0, 15)
    int4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        codes.to(torch.int32).view(n, k), 1)
    scales_zeros = torch.stack([step, low + 8 * step], -1).transpose(0, 1).contiguous()
    with warnings.catch_warnings():  # torch's quantized tensors are deprecated
        warnings.simplefilter("ignore")
        qw = torch.quantize_per_channel(w, scale.double(), torch.zeros(n, dtype=torch.long),
                                        0, torch.qint8)
        packed = torch.ops.quantized.linear_prepack(qw, None)
    w8t = w8.t()
    ours = {bits: cpu_int_gemm.pack(quantize(w, bits, 128 if k % 128 == 0 else 32,
                                             torch.float32)) for bits in (4, 8)}
    return {
        "fp32 F.linear": lambda x: torch.nn.functional.linear(x, w),
        "_weight_int8pack_mm": lambda x: torch.ops.aten._weight_int8pack_mm(x, w8, scale),
        "_weight_int4pack_mm_for_cpu": lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, int4, group, scales_zeros),
        "_int_mm (int8 x int8)": lambda x: int_mm(x, w8t, scale),
        "quantized::linear_dynamic": lambda x: torch.ops.quantized.linear_dynamic(
            x, packed, True),
        "pagellm int_gemm, int8": lambda x: cpu_int_gemm.int_linear(x, ours[8]),
        "pagellm int_gemm, int4": lambda x: cpu_int_gemm.int_linear(x, ours[4]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--shapes", nargs="+", default=["3072x576", "4096x4096"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--calls", type=int, default=50)
    ns = parser.parse_args()
    torch.set_num_threads(ns.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}"
          f", quantized engine {torch.backends.quantized.engine}, {ns.threads} thread(s)")
    for shape in ns.shapes:
        n, k = map(int, shape.split("x"))
        w = torch.randn(n, k) / k ** 0.5
        for rows in ns.rows:
            x = torch.randn(rows, k)
            exact = torch.nn.functional.linear(x, w)
            base = None
            for name, fn in candidates(w).items():
                us = per_call_us(lambda fn=fn, x=x: fn(x), ns.calls)
                base = base or us
                err = (fn(x).float() - exact).abs().max().item() / exact.abs().max().item()
                print(f"{n:>6} x {k:<6} rows {rows:<3} {name:<30} {us:>10.1f} us  "
                      f"{base / us:6.2f}x fp32   max error {err:.1e} of max |y|")


if __name__ == "__main__":
    main()
