"""CPU GEMMs of a decode step with few requests: how fast each way reads the weights.

With 1-4 rows of x a linear layer is bound by reading W once, so the figure of merit
is GB/s of weights. `decoder.linear` chooses between W @ x^T (aten's GEMM with W as
the big left operand; one row padded to two) and oneDNN's unpacked fp32 linear; this
sweep is where its thresholds (`SMALL_BATCH_ROWS`, `SMALL_BATCH_ONEDNN_MIN_IN`) come
from. Each shape runs over enough distinct weight copies (~150 MB) that W comes from
memory, as in a real model's step; the median of the repeats is reported. A star
marks the shapes where oneDNN reads faster.

    python benchmarks/small_gemm.py
    python benchmarks/small_gemm.py --out 896 4864 --in 896 2048 4864
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

from pagellm.executor.models.decoder import _ONEDNN_LINEAR

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


def _w_xt(xt: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.mm(w, xt)  # [out, in] @ [in, M] -> [out, M]


def _onednn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return _ONEDNN_LINEAR(x, w, None, "none", [], "")  # [M, in] -> [M, out]


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
    ns = parser.parse_args(argv)
    if _ONEDNN_LINEAR is None:
        raise SystemExit("this torch has no oneDNN linear on the CPU")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; weights read, "
          "GB/s: W @ x^T / oneDNN")
    print("out x in      " + "  ".join(f"{m} row{'s' if m > 1 else ' '}      "
                                       for m in ns.rows))
    for out_features in ns.out:
        for in_features in ns.in_:
            copies = min(MAX_COPIES, max(1, int(WORKING_SET_BYTES // (
                out_features * in_features * 4))))
            weights = [torch.randn(out_features, in_features) for _ in range(copies)]
            nbytes = out_features * in_features * 4 * copies
            cells = []
            for rows in ns.rows:
                x = torch.randn(rows, in_features)  # [M, in]
                padded = x if rows > 1 else torch.cat((x, x))  # [max(M, 2), in]
                # Both must compute x W^T before either's speed means anything.
                torch.testing.assert_close(_w_xt(padded.t(), weights[0])[:, :rows].t(),
                                           _onednn(x, weights[0]), rtol=1e-4, atol=1e-4)
                mm = _median_s(functools.partial(_w_xt, padded.t()), weights, ns.repeats)
                dnn = _median_s(functools.partial(_onednn, x), weights, ns.repeats)
                cells.append(f"{nbytes / mm / 1e9:5.1f} / {nbytes / dnn / 1e9:5.1f}"
                             f"{'*' if dnn < mm else ' '}")
            print(f"{out_features:5d} x {in_features:5d}  " + "  ".join(cells))


if __name__ == "__main__":
    main()
