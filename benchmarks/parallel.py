"""Tensor and data parallel: throughput and per-step communication, side by side.

For each layout (`tp1` = one device, `tp2` = two tensor-parallel ranks, `dp2` = two
engine cores, ...) in one run: output tokens per second for a fixed batch, and the
engine's mean decode-step timings: forward, the part of it spent in tensor-parallel
collectives (gloo on the CPU; on CUDA NCCL is asynchronous and this reads 0: profile
there), and dispatch (the step's round trip to the worker processes beyond their own
time).

On a 2-core machine every extra rank or core shares the same two cores, so this
measures the overhead of the layout, not a speed-up. On GPUs (one per rank) the same
command measures the real thing:

    python benchmarks/parallel.py                      # CPU: a small random model
    python benchmarks/parallel.py --model benchmarks/configs/qwen2.5-1.5b \\
        --load-format dummy --dtype bfloat16 --device cuda --layouts tp1 tp2 dp2 \\
        --num-requests 256 --output-len 256
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from pagellm import LLM, SamplingParams
from pagellm.demo.model import ModelSpec, make_model
from pagellm.executor.model.config import resolve_device

# Small enough for 2 CPU cores, large enough that a step is more than overhead.
SMALL = ModelSpec(arch="qwen2", hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=2,
                  intermediate_size=1536, vocab_size=8192, max_position_embeddings=2048)
SMOKE = ModelSpec(arch="qwen2", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  intermediate_size=128, vocab_size=512, max_position_embeddings=512)


def parse_layout(text: str) -> tuple[int, int]:
    """'tp2' -> (2, 1); 'dp2' -> (1, 2); 'tp2dp2' -> (2, 2)."""
    m = re.fullmatch(r"(?:tp(\d+))?(?:dp(\d+))?", text)
    if not m or not text:
        raise argparse.ArgumentTypeError(f"a layout is tpN, dpN or tpNdpM, got {text!r}")
    return int(m.group(1) or 1), int(m.group(2) or 1)


def run_layout(model: str, tp: int, dp: int, ns: argparse.Namespace) -> dict[str, Any]:
    params = SamplingParams(temperature=0.0, max_tokens=ns.output_len, ignore_eos=True)
    prompts = [{"prompt_token_ids": [(i * 31 + j) % 500 + 3 for j in range(ns.prompt_len)]}
               for i in range(ns.num_requests)]
    with LLM(model, tensor_parallel_size=tp, data_parallel_size=dp, device=ns.device,
             dtype=ns.dtype, load_format=ns.load_format, max_model_len=ns.max_model_len,
             max_num_seqs=ns.num_requests, enforce_eager=ns.enforce_eager,
             skip_tokenizer_init=True, **({"kv_cache_memory_bytes": ns.kv_cache_bytes}
                                          if ns.kv_cache_bytes else {})) as llm:
        llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        timings = llm.get_stats().step_timings  # the last steps' means: decode
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"token_ids": [o.outputs[0].token_ids for o in outputs],
            "layout": f"tp{tp}dp{dp}", "tensor_parallel_size": tp, "data_parallel_size": dp,
            "elapsed_s": elapsed, "output_tokens": tokens,
            "output_tokens_per_s": tokens / elapsed,
            "step_ms": {name: 1000 * getattr(timings, name) for name in (
                "schedule_s", "prepare_inputs_s", "forward_s", "sample_s", "collective_s",
                "dispatch_s", "update_s")}}


# One rank of `allreduce_floor`, run as `python -c` (argv: rank size port numel calls);
# rank 0 prints the seconds per call. A plain subprocess, not multiprocessing's spawn,
# whose resource tracker would outlive the ranks.
_ALLREDUCE_RANK = """
import sys, time, torch, torch.distributed as dist
rank, size, port, numel, calls = map(int, sys.argv[1:])
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=size)
x = torch.ones(numel)  # [numel] fp32
for _ in range(20):
    dist.all_reduce(x)
start = time.perf_counter()
for _ in range(calls):
    dist.all_reduce(x)
if rank == 0:
    print((time.perf_counter() - start) / calls)
dist.destroy_process_group()
"""


def allreduce_floor(size: int, numel: int, calls: int = 200) -> float:
    """Seconds per bare gloo all-reduce of `numel` floats among `size` local processes:
    what one of the model's collectives costs on this machine without any engine."""
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-c", _ALLREDUCE_RANK, str(rank), str(size),
                               str(port), str(numel), str(calls)],
                              stdout=subprocess.PIPE, text=True) for rank in range(size)]
    try:
        out, _ = procs[0].communicate(timeout=120)
        for p in procs[1:]:
            p.wait(timeout=30)
        return float(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF directory (default: a small "
                        "random model written to a temporary directory)")
    parser.add_argument("--layouts", nargs="+", type=parse_layout,
                        default=[(1, 1), (2, 1), (1, 2)])
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--kv-cache-bytes", type=int, default=64 * 2**20)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, few tokens")
    parser.add_argument("--output-json", type=Path, default=None,
                        help="write the results here")
    ns = parser.parse_args(argv)
    if ns.smoke:
        ns.num_requests, ns.prompt_len, ns.output_len = 4, 8, 8
    with tempfile.TemporaryDirectory() as tmp:
        model = ns.model or str(make_model(Path(tmp) / "model", SMOKE if ns.smoke else SMALL))
        results = [run_layout(model, tp, dp, ns) for tp, dp in ns.layouts]
        hidden = json.loads((Path(model) / "config.json").read_text())["hidden_size"]
    first = results[0]["token_ids"]
    for r in results:  # greedy: every layout must produce the first one's tokens
        r["same_tokens_as_first"] = r.pop("token_ids") == first
    report = {"benchmark": "parallel", "date": time.strftime("%Y-%m-%d"),
              "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
              "model": ns.model or "random qwen2 (benchmarks/parallel.py SMALL)",
              "num_requests": ns.num_requests, "prompt_len": ns.prompt_len,
              "output_len": ns.output_len, "results": results}
    tp_max = max(tp for tp, _ in ns.layouts)
    if tp_max > 1 and resolve_device(ns.device).type == "cpu":
        # The decode step's activations: [num_requests, hidden] fp32.
        report["allreduce_floor_us"] = 1e6 * allreduce_floor(tp_max, ns.num_requests * hidden)
        print(f"bare gloo all-reduce of [{ns.num_requests}, {hidden}] fp32 among {tp_max} "
              f"processes: {report['allreduce_floor_us']:.0f} us per call")
    base = results[0]["output_tokens_per_s"]
    print(f"{'layout':10} {'tok/s':>8} {'ratio':>6} {'forward':>8} {'collect':>8} "
          f"{'dispatch':>8}  (ms per decode step)  same tokens")
    for r in results:
        ms = r["step_ms"]
        print(f"{r['layout']:10} {r['output_tokens_per_s']:8.1f} "
              f"{r['output_tokens_per_s'] / base:6.2f} {ms['forward_s']:8.2f} "
              f"{ms['collective_s']:8.2f} {ms['dispatch_s']:8.2f}  "
              f"{r['same_tokens_as_first']}")
    if ns.output_json is not None:
        ns.output_json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
