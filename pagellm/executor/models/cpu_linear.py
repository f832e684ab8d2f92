"""A linear layer on the CPU through the fastest of three GEMMs for its shape and CPU.

    x [M, in] @ W^T [in, out] -> [M, out], computed one of three ways:
      W_XT    torch.mm(W, x^T): W as the big left operand, streamed (one row of x
              padded to two: a stride-0 expand is slow there)
      ONEDNN  oneDNN's fp32 linear on the plain weights (no packed copy, so loading,
              weight updates and sleep see ordinary parameters)
      ATEN    F.linear: MKL's sgemv/sgemm for fp32, oneDNN's matmul for bf16

Which one is fastest depends on the CPU's vendor, because MKL runs its own fast
kernels only on Intel CPUs and a generic AVX2 path elsewhere (benchmarks/small_gemm.py
measures all three; BENCHMARKS.md, "CPU GEMMs", has the tables):
- AMD (EPYC with AVX-512, 2026-11-24), fp32: with 1-4 rows MKL reads W at a third to a
  half of the memory bandwidth and W_XT near it, except from 2048 input features up,
  where ONEDNN streams W faster; with more rows ONEDNN's GEMM reaches 450 GFLOP/s where
  MKL's reaches 205.
- Intel (Xeon with AMX, 2026-11-26), fp32: with 1-3 rows MKL's sgemv/sgemm reads W
  1.3-2.8x faster than W_XT (which stays at 11-14 GB/s) and 1.1-1.5x faster than
  ONEDNN; from 4 rows ONEDNN is fastest. Qwen2.5-0.5B's batch-1 decode: 2x.
- Anything else keeps the AMD rules, the first measured.
- Other dtypes (bf16, fp16), any vendor: W_XT up to 4 rows, ATEN above. On the Intel
  machine W_XT also times 1.2-1.7x faster alone at 8-256 rows in bf16, but a
  48-request run through the engine was 5-9% slower with it: not adopted.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import torch
import torch.nn.functional as F


class Way(enum.Enum):
    W_XT = "W @ x^T"
    ONEDNN = "oneDNN"
    ATEN = "F.linear"


# Rows of x up to which an fp32 GEMM off Intel runs as W @ x^T ...
SMALL_BATCH_ROWS = 4
# ... unless x is this wide: W @ x^T then reads W at 17-30 GB/s where oneDNN's unpacked
# GEMM streams it at 30-48 (K = in features from 2048 up, out features 576 to 4864,
# 1-4 rows; below it W @ x^T wins, by up to 40% at K = 896). Every MLP down projection
# of a real model is that wide.
SMALL_BATCH_ONEDNN_MIN_IN = 2048
# Rows of x up to which an fp32 GEMM on Intel runs through MKL (F.linear).
INTEL_MKL_MAX_ROWS = 3


def _onednn_linear() -> Callable[..., torch.Tensor] | None:
    """oneDNN's fp32 linear on plain (unpacked) weights, where this torch has it."""
    op = getattr(torch.ops.mkldnn, "_linear_pointwise", None) \
        if torch.backends.mkldnn.is_available() else None
    if op is None:
        return None
    try:  # present is not enough: some builds register it without a CPU kernel
        op(torch.ones(2, 2), torch.ones(2, 2), None, "none", [], "")
    except RuntimeError:
        return None
    return op


def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id ("GenuineIntel", "AuthenticAMD"); "" where unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return ""


ONEDNN_LINEAR = _onednn_linear()
# MKL's own kernels, as torch links it: only on Intel CPUs.
INTEL_MKL = torch.backends.mkl.is_available() and cpu_vendor() == "GenuineIntel"


def choose(rows: int, in_features: int, dtype: torch.dtype, intel_mkl: bool) -> Way:
    """The GEMM for x [rows, in_features] of `dtype` (the rules in the module doc)."""
    if dtype == torch.float32:
        if ONEDNN_LINEAR is None:
            return Way.W_XT if rows <= SMALL_BATCH_ROWS and not intel_mkl else Way.ATEN
        if intel_mkl:
            return Way.ATEN if rows <= INTEL_MKL_MAX_ROWS else Way.ONEDNN
        if rows <= SMALL_BATCH_ROWS and in_features < SMALL_BATCH_ONEDNN_MIN_IN:
            return Way.W_XT
        return Way.ONEDNN
    return Way.W_XT if rows <= SMALL_BATCH_ROWS else Way.ATEN


def gemm(way: Way, x: torch.Tensor, weight: torch.Tensor,
         bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, in] @ weight^T [in, out] (+ bias [out]) -> [M, out], contiguous, computed
    `way` (benchmarks/small_gemm.py times each through here)."""
    if way is Way.W_XT:
        rows = x.shape[0]
        padded = x if rows > 1 else torch.cat((x, x))  # [max(M, 2), in]
        y = torch.mm(weight, padded.t())[:, :rows].t().contiguous()  # [M, out]
        return y if bias is None else y + bias
    if way is Way.ONEDNN:
        assert ONEDNN_LINEAR is not None
        return ONEDNN_LINEAR(x.contiguous(), weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """F.linear (x: [M, in], weight: [out, in] -> [M, out]) with the CPU's fastest GEMM."""
    if x.is_cuda or x.dim() != 2 or x.shape[0] == 0 or x.dtype != weight.dtype:
        return F.linear(x, weight, bias)
    return gemm(choose(x.shape[0], x.shape[1], x.dtype, INTEL_MKL), x, weight, bias)
