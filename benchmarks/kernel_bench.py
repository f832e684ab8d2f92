"""Decode paged attention: achieved memory bandwidth against the device's copy bandwidth.

A decode step's attention reads every context token's K and V once and does almost no
arithmetic per byte, so the kernel is memory-bound: the honest yardstick is the
bandwidth a plain large tensor copy reaches on the same device, not the data sheet.
Target: at least 80% of the copy bandwidth on long contexts (8192 tokens and more),
where the KV reads dominate and launch and tail effects do not.

Grid: batch 1, 4, 16, 64, 256 x context 512, 2048, 8192, 32768 tokens, one query token
per request, Qwen2.5-1.5B's attention (12 query heads, 2 KV heads, head_dim 128), bf16,
block size 16. Block tables are a random permutation of the cache's blocks, so reads are
really paged. Cases whose KV cache exceeds --max-kv-gib are skipped (peak memory is
about 2.5x the KV cache: the peer's contiguous copy and a gather buffer).

    bytes moved = K and V of every context token + the queries (read) + the outputs
                  (written); block tables and split-KV partials are not counted
    bandwidth   = bytes moved / median time per call (GB/s = 1e9 bytes/s)

Timing: CUDA events around every call, after warm-up; before every call a 512 MiB buffer
is zeroed (outside the events) so that no case is served from L2 (H100 and H200: 50 MB), and
so the GPU is still busy zeroing while the host launches the next call: the host's
launch latency is not what is measured. The median over --iters calls is reported.

Peer: torch's scaled_dot_product_attention on the same data gathered into contiguous
[B, H_kv, ctx, D] K and V tensors (enable_gqa=True when torch has it, else K and V
repeated per query head beforehand). The gather is not timed: the peer gets contiguous,
already-gathered K/V, which favours it (a real paged engine would have to gather).
Every case also checks the kernel's output against the peer's (max |diff| / max |ref|
within bf16 tolerance), so a fast wrong kernel reports no number: its row says so and
the run ends with an AssertionError once the JSON is written.

    python benchmarks/kernel_bench.py --output-json kernel.json          # GPU
    python benchmarks/kernel_bench.py --smoke                            # CPU, interpreter

--smoke runs the same logic on tiny shapes (fp32, 4 heads / 2 KV heads, head_dim 16) on
the CPU through Triton's interpreter (on the GPU where there is one): its numbers mean
nothing; it proves the script works.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import torch
import torch.nn.functional as F

TARGET_PCT_OF_COPY = 80.0
L2_FLUSH_BYTES = 512 * 2**20
# max |kernel - peer| / max |peer| allowed: both round to the dtype, and the kernel feeds
# its softmax weights to the P.V product in the input dtype.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}

GPU_DEFAULTS: dict[str, Any] = dict(
    batches=[1, 4, 16, 64, 256], contexts=[512, 2048, 8192, 32768], num_heads=12,
    num_kv_heads=2, head_dim=128, dtype="bfloat16", iters=50, warmup=5, copy_mib=2048)
SMOKE_DEFAULTS: dict[str, Any] = dict(
    batches=[1, 2], contexts=[20, 40], num_heads=4, num_kv_heads=2, head_dim=16,
    dtype="float32", iters=3, warmup=1, copy_mib=16)


# --------------------------------------------------------------------------- shared helpers
# (decode_roofline.py and gpu_suite.py import these)


def environment(device: torch.device) -> dict[str, Any]:
    """Where a number was measured: date, device and library versions."""
    def version(package: str) -> str | None:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return None

    name = (torch.cuda.get_device_name(device) if device.type == "cuda"
            else platform.processor() or platform.machine())
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": name, "device_type": device.type, "machine": platform.platform(),
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "triton": version("triton"), "transformers": version("transformers")}


def time_op(fn: Callable[[], object], device: torch.device, *, warmup: int, iters: int,
            flush_l2: bool) -> float:
    """Median seconds per call of `fn` (see the module docstring for the method).

    On CUDA each call sits between two events; with flush_l2, a buffer larger than L2
    is zeroed before each call, outside the events. On the CPU: perf_counter per call.
    """
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device) if flush_l2 else None
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    torch.cuda.synchronize(device)
    for start_event, end_event in zip(starts, ends, strict=True):
        if flush is not None:
            flush.zero_()
        start_event.record()
        fn()
        end_event.record()
    torch.cuda.synchronize(device)
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)) / 1e3


def measure_copy_bandwidth(device: torch.device, num_bytes: int, iters: int = 20
                           ) -> dict[str, float]:
    """The device's practical memory bandwidth: a large tensor copy, (bytes read +
    bytes written) / time. Far larger than L2, so no flush is needed."""
    seconds = _time_copy(device, num_bytes, iters)  # its tensors are freed on return
    if device.type == "cuda":
        torch.cuda.empty_cache()  # leave the memory to what runs next (an engine, a case)
    return {"copy_bytes": num_bytes, "copy_seconds": seconds,
            "copy_bandwidth_gbps": 2 * num_bytes / seconds / 1e9}


def _time_copy(device: torch.device, num_bytes: int, iters: int) -> float:
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    return time_op(lambda: dst.copy_(src), device, warmup=3, iters=iters, flush_l2=False)


# --------------------------------------------------------------------------- the benchmark


def sdpa_supports_gqa() -> bool:
    """torch >= 2.5 takes enable_gqa (K/V with fewer heads than Q)."""
    q, kv = torch.zeros(1, 2, 1, 16), torch.zeros(1, 1, 4, 16)
    try:
        F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
    except TypeError:
        return False
    return True


def make_case(batch: int, context: int, num_heads: int, num_kv_heads: int, head_dim: int,
              block_size: int, dtype: torch.dtype, device: torch.device,
              generator: torch.Generator) -> dict[str, torch.Tensor]:
    """A decode batch over a paged cache: `batch` requests of `context` tokens each (the
    query being the last), blocks handed out in a random order."""
    blocks_per_req = -(-context // block_size)
    num_blocks = batch * blocks_per_req
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim,
                           generator=generator, device=device, dtype=dtype)
    perm = torch.randperm(num_blocks, generator=generator, device=device)
    return {
        "query": torch.randn(batch, num_heads, head_dim, generator=generator, device=device,
                             dtype=dtype),
        "kv_cache": kv_cache,
        "block_tables": perm.to(torch.int32).view(batch, blocks_per_req),
        "query_start_loc": torch.arange(batch + 1, dtype=torch.int32, device=device),
        "seq_lens": torch.full((batch,), context, dtype=torch.int32, device=device),
    }


def gather_contiguous(kv_cache: torch.Tensor, block_tables: torch.Tensor, context: int,
                      which: int) -> torch.Tensor:
    """K (which=0) or V (1) of every request as one contiguous [B, H_kv, ctx, D] tensor."""
    batch = block_tables.shape[0]
    paged = kv_cache[which][block_tables.long()]  # [B, blocks, block_size, H_kv, D]
    flat = paged.view(batch, -1, *kv_cache.shape[3:])[:, :context]  # [B, ctx, H_kv, D]
    return flat.transpose(1, 2).contiguous()


def run_case(ns: argparse.Namespace, batch: int, context: int, device: torch.device,
             dtype: torch.dtype, num_sms: int, copy_gbps: float, gqa: bool) -> dict[str, Any]:
    from pagellm.executor.model.attention import MAX_KV_SEGMENTS, num_kv_segments
    from pagellm.kernels.triton_attention import paged_attention, tile_keys

    generator = torch.Generator(device=device).manual_seed(ns.seed + batch * 100003 + context)
    case = make_case(batch, context, ns.num_heads, ns.num_kv_heads, ns.head_dim,
                     ns.block_size, dtype, device, generator)
    segments = ns.num_segments or num_kv_segments(batch, ns.num_kv_heads, 1, context, num_sms,
                                                  ns.max_segments or MAX_KV_SEGMENTS)
    scale = ns.head_dim ** -0.5
    out = torch.empty_like(case["query"])

    def kernel() -> torch.Tensor:
        return paged_attention(case["query"], case["kv_cache"], case["block_tables"],
                               case["query_start_loc"], case["seq_lens"], scale,
                               max_query_len=1, num_segments=segments, out=out,
                               tile=ns.tile)

    # The peer's inputs: contiguous, gathered once, untimed.
    q = case["query"][:, :, None, :]  # [B, H, 1, D]
    k = gather_contiguous(case["kv_cache"], case["block_tables"], context, 0)
    v = gather_contiguous(case["kv_cache"], case["block_tables"], context, 1)
    if not gqa:
        group = ns.num_heads // ns.num_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)

    def peer() -> torch.Tensor:
        if gqa:
            return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v, scale=scale)

    elem = case["kv_cache"].element_size()
    kv_bytes = batch * context * 2 * ns.num_kv_heads * ns.head_dim * elem
    io_bytes = 2 * batch * ns.num_heads * ns.head_dim * elem  # queries read, outputs written
    row: dict[str, Any] = {
        "batch": batch, "context": context, "num_segments": segments,
        "tile": ns.tile or tile_keys(ns.block_size, ns.head_dim, dtype, segments),
        "kv_cache_gib": case["kv_cache"].numel() * elem / 2**30,
        "bytes_moved": kv_bytes + io_bytes}

    reference = peer()[:, :, 0, :].float()
    got = kernel().float()
    ref_scale = reference.abs().max().item()
    row["max_rel_err"] = (got - reference).abs().max().item() / max(ref_scale, 1e-30)
    row["tolerance"] = TOLERANCE[dtype]
    row["matches_reference"] = bool(row["max_rel_err"] <= TOLERANCE[dtype])
    if not row["matches_reference"]:
        return row  # a wrong kernel reports no speed

    flush = device.type == "cuda"
    for name, fn in (("kernel", kernel), ("sdpa", peer)):
        seconds = time_op(fn, device, warmup=ns.warmup, iters=ns.iters, flush_l2=flush)
        gbps = row["bytes_moved"] / seconds / 1e9
        row[f"{name}_us"] = seconds * 1e6
        row[f"{name}_gbps"] = gbps
        row[f"{name}_pct_of_copy"] = 100 * gbps / copy_gbps
    row["speedup_vs_sdpa"] = row["sdpa_us"] / row["kernel_us"]
    return row


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true",
                        help="CPU, Triton interpreter, tiny shapes: checks the script only")
    parser.add_argument("--batches", type=int, nargs="+", default=None)
    parser.add_argument("--contexts", type=int, nargs="+", default=None)
    parser.add_argument("--num-heads", type=int, default=None)
    parser.add_argument("--num-kv-heads", type=int, default=None)
    parser.add_argument("--head-dim", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None)
    parser.add_argument("--num-segments", type=int, default=None,
                        help="force split-KV slices (default: model.attention's choice)")
    parser.add_argument("--max-segments", type=int, default=None,
                        help="cap of the default split-KV choice (default: "
                             "executor.model.attention.MAX_KV_SEGMENTS)")
    parser.add_argument("--tile", type=int, default=None,
                        help="keys per kernel loop iteration (default: tile_keys())")
    parser.add_argument("--max-kv-gib", type=float, default=40.0,
                        help="skip cases whose KV cache is larger (default: 40)")
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--copy-mib", type=int, default=None,
                        help="size of the copy that measures the device's bandwidth")
    parser.add_argument("--seed", type=int, default=0)
    return parse_with_defaults(parser, argv, GPU_DEFAULTS, SMOKE_DEFAULTS)


def parse_with_defaults(parser: argparse.ArgumentParser, argv: list[str] | None,
                        gpu: dict[str, Any], smoke: dict[str, Any]) -> argparse.Namespace:
    """Add --output-json and parse; options left unset take the GPU run's default, or
    the --smoke run's (the parser must define --smoke)."""
    parser.add_argument("--output-json", type=Path, default=None)
    ns = parser.parse_args(argv)
    for key, value in (smoke if ns.smoke else gpu).items():
        if getattr(ns, key) is None:
            setattr(ns, key, value)
    return ns


def select_device(smoke: bool) -> torch.device:
    """CUDA; with --smoke on a machine without it, the CPU through Triton's interpreter,
    which must be chosen before the kernels' @triton.jit decorators run (their module's
    import). A smoke run in a process that already compiled the kernels for a GPU (a test
    session on a GPU machine) runs its tiny shapes on that GPU."""
    if smoke:
        if "pagellm.kernels.triton_attention" not in sys.modules and not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
        from pagellm.kernels.triton_attention import interpreter_fault, interpreting

        if interpreting():
            fault = interpreter_fault()
            if fault is not None:
                raise SystemExit(f"kernel_bench --smoke runs Triton's interpreter on the "
                                 f"CPU, which cannot run here: {fault}")
            return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("kernel_bench needs CUDA, or --smoke with TRITON_INTERPRET=1 "
                         "set before pagellm.kernels.triton_attention is imported")
    return torch.device("cuda")


def print_table(results: dict[str, Any]) -> None:
    print(f"{results['device']}: copy bandwidth {results['copy_bandwidth_gbps']:.0f} GB/s; "
          f"{results['num_heads']} heads / {results['num_kv_heads']} KV heads, head_dim "
          f"{results['head_dim']}, {results['dtype']}, block size {results['block_size']}")
    print(f"{'batch':>6}{'ctx':>7}{'segs':>5}{'KV MiB':>9}{'kernel us':>11}{'GB/s':>8}"
          f"{'%copy':>7}{'sdpa us':>10}{'GB/s':>8}{'%copy':>7}{'speedup':>9}{'rel err':>10}")
    for r in results["cases"]:
        head = (f"{r['batch']:>6}{r['context']:>7}{r['num_segments']:>5}"
                f"{r['kv_cache_gib'] * 1024:>9.1f}")
        if not r["matches_reference"]:
            print(f"{head}  WRONG OUTPUT: max rel err {r['max_rel_err']:.3g} > "
                  f"{r['tolerance']:.3g}")
            continue
        print(f"{head}{r['kernel_us']:>11.1f}{r['kernel_gbps']:>8.0f}"
              f"{r['kernel_pct_of_copy']:>7.1f}{r['sdpa_us']:>10.1f}{r['sdpa_gbps']:>8.0f}"
              f"{r['sdpa_pct_of_copy']:>7.1f}{r['speedup_vs_sdpa']:>8.2f}x"
              f"{r['max_rel_err']:>10.2e}")
    for s in results["skipped"]:
        print(f"skipped batch {s['batch']} context {s['context']}: {s['reason']}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the grid; return (and with --output-json write) the results. Raises
    AssertionError after writing if any case's output did not match the peer's."""
    ns = parse_args(argv)
    device = select_device(ns.smoke)
    dtype: torch.dtype = getattr(torch, ns.dtype)
    num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
               if device.type == "cuda" else 0)
    gqa = sdpa_supports_gqa()
    results: dict[str, Any] = {
        "benchmark": "kernel_bench", **environment(device), "smoke": ns.smoke,
        "command": shlex.join(["python", "benchmarks/kernel_bench.py",
                                *(sys.argv[1:] if argv is None else argv)]),
        "num_heads": ns.num_heads, "num_kv_heads": ns.num_kv_heads, "head_dim": ns.head_dim,
        "block_size": ns.block_size, "dtype": ns.dtype, "num_sms": num_sms,
        "sdpa_variant": "enable_gqa" if gqa else "repeat_interleave",
        "timing": {"method": "cuda events per call, median" if device.type == "cuda"
                   else "perf_counter per call, median",
                   "l2_flush_bytes": L2_FLUSH_BYTES if device.type == "cuda" else 0,
                   "warmup": ns.warmup, "iters": ns.iters},
        "target_pct_of_copy": TARGET_PCT_OF_COPY,
        **measure_copy_bandwidth(device, ns.copy_mib * 2**20),
        "cases": [], "skipped": []}
    elem = torch.empty((), dtype=dtype).element_size()
    for context in ns.contexts:
        for batch in ns.batches:
            kv_gib = (batch * -(-context // ns.block_size) * ns.block_size * 2
                      * ns.num_kv_heads * ns.head_dim * elem / 2**30)
            if kv_gib > ns.max_kv_gib:
                results["skipped"].append({"batch": batch, "context": context,
                                           "kv_cache_gib": kv_gib,
                                           "reason": f"KV cache {kv_gib:.1f} GiB > "
                                                     f"--max-kv-gib {ns.max_kv_gib}"})
                continue
            results["cases"].append(run_case(ns, batch, context, device, dtype, num_sms,
                                              results["copy_bandwidth_gbps"], gqa))
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print_table(results)
    if ns.output_json:
        ns.output_json.write_text(json.dumps(results, indent=2))
    wrong = [(r["batch"], r["context"]) for r in results["cases"] if not r["matches_reference"]]
    assert not wrong, f"kernel output differs from SDPA's in (batch, context) cases {wrong}"
    return results


if __name__ == "__main__":
    main()
