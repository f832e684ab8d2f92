"""The decoder's fused kernels (kernels/triton_fused.py) against the torch ops they
replace, side by side in one run: GPU time per call inside a CUDA graph.

Why inside a graph: decode steps replay CUDA graphs, where launching costs nothing and
what remains is each kernel's own time on the GPU. At batch 1 that is a few
microseconds per kernel however little it does, and the torch versions are several
kernels each (RMSNorm 9, the rotary embedding 4, SiLU-and-mul 2). Each op is captured
CALLS_PER_GRAPH times into one graph; a replay's time (CUDA events, median of --iters)
divided by that count is the time per call.

Shapes: Qwen2.5-1.5B's (hidden 1536, intermediate 8960, 12 query + 2 KV heads of 128),
bf16, at --rows tokens (1: batch-1 decode; 256: a full decode batch).

    python benchmarks/fused_bench.py --output-json fused.json      # GPU
    python benchmarks/fused_bench.py --smoke                       # CPU, interpreter

--smoke runs tiny shapes eagerly on the CPU through Triton's interpreter: its numbers
mean nothing; it proves the script works.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # kernel_bench
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import torch
import torch.nn.functional as F
from kernel_bench import environment, parse_with_defaults, select_device, time_op

CALLS_PER_GRAPH = 50
GPU_DEFAULTS: dict[str, Any] = dict(rows=[1, 16, 256], hidden=1536, intermediate=8960,
                                    heads=14, head_dim=128, dtype="bfloat16", iters=30)
SMOKE_DEFAULTS: dict[str, Any] = dict(rows=[1, 3], hidden=48, intermediate=40, heads=3,
                                      head_dim=16, dtype="float32", iters=2)


def per_call_seconds(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    """Median GPU seconds per call of fn, replayed from a graph of CALLS_PER_GRAPH calls
    (on the CPU: wall time of eager calls)."""
    if device.type != "cuda":
        return time_op(fn, device, warmup=0, iters=iters, flush_l2=False)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(iters)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events) / 1e3 / CALLS_PER_GRAPH


def ops(rows: int, ns: argparse.Namespace, device: torch.device
        ) -> dict[str, tuple[Callable[[], object], Callable[[], object]]]:
    """name -> (torch version, fused kernel) on fresh inputs of this many rows."""
    from pagellm.executor.model.layers import RMSNorm
    from pagellm.executor.model.rope import RopeSpec, RotaryEmbedding, rotate
    from pagellm.kernels import triton_fused

    dtype = getattr(torch, ns.dtype)
    gen = torch.Generator().manual_seed(rows)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device, dtype)

    norm = RMSNorm(ns.hidden, 1e-6).to(device, dtype)
    x, residual = rand(rows, ns.hidden), rand(rows, ns.hidden)
    gate_up = rand(rows, 2 * ns.intermediate)
    half = ns.intermediate
    rope = RotaryEmbedding(RopeSpec("default", 10000.0), ns.head_dim, 4096).to(device)
    rope.reset_cache()
    cos, sin = rope.cos_sin(torch.arange(rows, device=device) % 4096, dtype)
    qkv = rand(rows, ns.heads + 1, ns.head_dim)  # q and k heads, then v: a strided view
    qk = qkv[:, :ns.heads]
    return {
        "rms_norm+residual": (lambda: norm.reference(x, residual),
                              lambda: triton_fused.rms_norm(x, norm.weight, norm.eps,
                                                            residual)),
        "silu_and_mul": (lambda: F.silu(gate_up[:, :half]) * gate_up[:, half:],
                         lambda: triton_fused.silu_and_mul(gate_up)),
        "rotary": (lambda: rotate(qk, cos, sin), lambda: triton_fused.rotary(qk, cos, sin)),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true",
                        help="CPU, Triton interpreter, tiny shapes: checks the script only")
    parser.add_argument("--rows", type=int, nargs="+", default=None)
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--intermediate", type=int, default=None)
    parser.add_argument("--heads", type=int, default=None, help="query + KV heads rotated")
    parser.add_argument("--head-dim", type=int, default=None)
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None)
    parser.add_argument("--iters", type=int, default=None)
    ns = parse_with_defaults(parser, argv, GPU_DEFAULTS, SMOKE_DEFAULTS)
    device = select_device(ns.smoke)
    results: dict[str, Any] = {
        "benchmark": "fused_bench", **environment(device), "smoke": ns.smoke,
        "command": " ".join(["python", "benchmarks/fused_bench.py", *(argv or sys.argv[1:])]),
        "calls_per_graph": CALLS_PER_GRAPH, "cases": []}
    print(f"{results.get('device') or device}: {ns.dtype}, hidden {ns.hidden}, "
          f"intermediate {ns.intermediate}, {ns.heads} heads x {ns.head_dim}")
    print(f"{'op':>18} {'rows':>5} {'torch us':>9} {'fused us':>9} {'speedup':>8}")
    for rows in ns.rows:
        for name, (reference, fused) in ops(rows, ns, device).items():
            ref_out, got_out = reference(), fused()
            got = got_out[0] if isinstance(got_out, tuple) else got_out
            expected = ref_out[0] if isinstance(ref_out, tuple) else ref_out
            error = (got.float() - expected.float()).abs().max().item()
            torch_s = per_call_seconds(reference, device, ns.iters)
            fused_s = per_call_seconds(fused, device, ns.iters)
            results["cases"].append({"op": name, "rows": rows, "torch_us": torch_s * 1e6,
                                     "fused_us": fused_s * 1e6,
                                     "speedup": torch_s / fused_s, "max_abs_diff": error})
            print(f"{name:>18} {rows:>5} {torch_s * 1e6:9.2f} {fused_s * 1e6:9.2f} "
                  f"{torch_s / fused_s:7.2f}x")
    if ns.output_json:
        ns.output_json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
