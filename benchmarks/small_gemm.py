"""CPU GEMMs of a linear layer: how fast each way reads the weights, and which way the
engine picks.

With few rows of x a linear layer is bound by reading W once, so the figure of merit
is GB/s of weights (with many rows it is FLOP/s: the GB/s then fall, and the ratios
between the ways still rank them). `cpu_linear.linear` computes x W^T one of five ways
(W @ x^T, oneDNN's linear on the plain weights, F.linear, oneDNN's on packed weights,
pagellm's bf16 GEMV for up to 4 rows) and picks one by CPU vendor and features, dtype,
rows and width (`cpu_linear.choose`); this sweep is where those rules come from. Each
shape runs over enough distinct weight copies (~150 MB) that W comes from memory, as in
a real model's step; the median of the repeats is reported. A star marks the fastest
way, a caret the engine's choice on this machine.

    python benchmarks/small_gemm.py
    python benchmarks/small_gemm.py --out 896 4864 --in 896 2048 4864 --rows 1 4 48
    python benchmarks/small_gemm.py --dtype bfloat16
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from pagellm.executor.model.linear import (
    ONEDNN_LINEAR,
    PACKED_WEIGHTS,
    REORDER_WEIGHT,
    THIS_CPU,
    Way,
    choose,
    gemm,
)

WORKING_SET_BYTES = 150e6
MAX_COPIES = 1024  # tiny shapes (the smoke test) need no working set


def _median_s(fn: Callable[[torch.Tensor], torch.Tensor], weights: list[torch.Tensor],
              repeats: int) -> float:
    """Seconds for `fn` over every weight copy, median of `repeats` after a warm-up."""
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        for w in weights:
            fn(w)
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _computes(way: Way, dtype: torch.dtype) -> bool:
    """Whether `way` computes `dtype` on this CPU: oneDNN's bf16 inner product on plain
    weights needs AVX-512 (on an AVX2 CPU it cannot make the primitive at all; the
    engine never takes that way for bf16: `choose`); the GEMV takes bf16 only."""
    try:
        gemm(way, torch.ones(2, 16, dtype=dtype), torch.ones(8, 16, dtype=dtype))
    except RuntimeError:
        return False
    return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=int, nargs="+", default=[576, 896, 2048, 4864],
                        help="output features (rows of W)")
    parser.add_argument("--in", dest="in_", type=int, nargs="+",
                        default=[896, 1024, 1536, 1792, 2048, 2560, 4864],
                        help="input features (columns of W)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--max-copies", type=int, default=MAX_COPIES,
                        help="weight copies per shape at most (the smoke test: a few)")
    ns = parser.parse_args(argv)
    dtype = getattr(torch, ns.dtype)
    if ONEDNN_LINEAR is None:
        raise SystemExit("this torch has no oneDNN linear on the CPU")
    ways = [w for w in Way if (w is not Way.PACKED or REORDER_WEIGHT is not None)
            and _computes(w, dtype)]
    print(f"torch {torch.__version__}, {ns.dtype}, {torch.get_num_threads()} threads, "
          f"{THIS_CPU}; weights read, GB/s: "
          f"{' / '.join(w.value for w in ways)} (* fastest, ^ the engine's choice)"
          + "".join(f"; {w.value}: not for {ns.dtype} here" for w in Way if w not in ways))
    cell = 9 * len(ways) - 2  # characters of one row count's column
    print("out x in      " + "  ".join(f"{f'{m} row' + ('s' if m > 1 else ''):{cell}}"
                                       for m in ns.rows))
    for out_features in ns.out:
        for in_features in ns.in_:
            copies = min(ns.max_copies, max(1, int(WORKING_SET_BYTES // (
                out_features * in_features * dtype.itemsize))))
            weights = [torch.randn(out_features, in_features, dtype=dtype)
                       for _ in range(copies)]
            nbytes = out_features * in_features * dtype.itemsize * copies
            if Way.PACKED in ways:  # as the loader packs a model's weights
                PACKED_WEIGHTS.pack(weights)
            cells = []
            for rows in ns.rows:
                x = torch.randn(rows, in_features, dtype=dtype)  # [M, in]
                if Way.GEMV in ways and rows > 4:
                    raise SystemExit("the bf16 GEMV takes up to 4 rows: --rows 1 2 3 4")
                # Each must compute x W^T (to the rounding of sums of `in` products)
                # before its speed means anything.
                want = (x.double() @ weights[0].double().t()).to(dtype)
                tol = 1e-6 if dtype == torch.float32 else 1e-3
                for way in ways:
                    torch.testing.assert_close(gemm(way, x, weights[0]), want,
                                               rtol=100 * tol, atol=tol * in_features)
                seconds = [_median_s(functools.partial(gemm, way, x), weights, ns.repeats)
                           for way in ways]
                best = seconds.index(min(seconds))
                chosen = ways.index(choose(rows, in_features, dtype, THIS_CPU))
                cells.append(" /".join(
                    f"{nbytes / t / 1e9:5.1f}{'*' if i == best else ' '}"
                    f"{'^' if i == chosen else ' '}" for i, t in enumerate(seconds)))
            print(f"{out_features:5d} x {in_features:5d}  " + "  ".join(cells))

if __name__ == "__main__":
    main()
