"""Where a batch-1 decode step's GPU time goes: torch.profiler around decode steps.

decode_roofline.py says how far batch-1 decode is from the memory roofline; this says
why. One engine runs in this process (multiprocess=False, so the profiler sees its
kernels), one request of --prompt-len random tokens is generated with --short-len and
with --short-len + --output-len tokens, each under the profiler, and the difference of
the two profiles (kernels by name: launches and GPU time) is what --output-len decode
steps cost, prefill cancelled. Printed per decode step: kernel launches, GPU busy time
and wall time, and the kernels that take the most of it.

    python benchmarks/profile_decode.py --model benchmarks/configs/qwen2.5-1.5b
    python benchmarks/profile_decode.py --model benchmarks/configs/qwen2.5-1.5b --enforce-eager
    python benchmarks/profile_decode.py --smoke        # CPU, demo model: checks the script

With CUDA graphs the kernels of a replayed graph are still reported one by one (CUPTI
traces graph nodes), so the two modes compare launch for launch.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import random
import shlex
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # kernel_bench
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import torch
from kernel_bench import environment, parse_with_defaults
from torch.profiler import ProfilerActivity, profile

from pagellm import LLM, SamplingParams
from pagellm.demo.model import resolve_model
from pagellm.protocol.engine_args import EngineArgs

ROOT = Path(__file__).resolve().parents[1]
GPU_DEFAULTS: dict[str, Any] = dict(
    model=str(ROOT / "benchmarks/configs/qwen2.5-1.5b"), dtype="bfloat16", device="cuda",
    prompt_len=128, short_len=8, output_len=64, top=25)
SMOKE_DEFAULTS: dict[str, Any] = dict(
    model="demo", dtype="float32", device="cpu", prompt_len=8, short_len=2, output_len=4,
    top=10)


@dataclasses.dataclass
class Profile:
    wall_s: float
    # kernel name -> [launches, device microseconds]
    kernels: dict[str, list[float]]


# The CPU ops a CPU profile counts: torch's, oneDNN's and pagellm's C++ ones (the int kernel, the
# fused decode step: executor/worker/cpu_decode.py).
CPU_OPS = ("aten::", "mkldnn::", "pagellm_cpu::")


def profiled_generate(llm: LLM, rng: random.Random, vocab: int, prompt_len: int,
                      max_tokens: int, device: torch.device) -> Profile:
    """Profile one greedy generate of `max_tokens` for a fresh random prompt."""
    prompt = {"prompt_token_ids": [rng.randrange(16, vocab) for _ in range(prompt_len)]}
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        llm.generate(prompt, params, use_tqdm=False)
        wall = time.perf_counter() - start
    kernels: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        on_device = event.device_type == torch.autograd.DeviceType.CUDA
        if on_device != cuda or (not cuda and not event.name.startswith(CPU_OPS)):
            continue  # on the CPU: torch's and pagellm's ops stand in for kernels
        entry = kernels[event.name]
        entry[0] += 1
        entry[1] += event.device_time if cuda else event.cpu_time
    return Profile(wall, dict(kernels))


def difference(long: Profile, short: Profile, steps: int) -> dict[str, Any]:
    """Per decode step: the long profile less the short one, over `steps`."""
    rows = []
    for name, (count, us) in long.kernels.items():
        short_count, short_us = short.kernels.get(name, (0, 0.0))
        rows.append({"kernel": name, "launches_per_step": (count - short_count) / steps,
                     "us_per_step": (us - short_us) / steps})
    rows.sort(key=lambda r: -r["us_per_step"])
    return {"ms_wall_per_step": 1e3 * (long.wall_s - short.wall_s) / steps,
            "ms_kernels_per_step": sum(r["us_per_step"] for r in rows) / 1e3,
            "launches_per_step": sum(r["launches_per_step"] for r in rows),
            "kernels": rows}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Profile; return (and with --output-json write) the per-step figures."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true",
                        help="CPU, demo model, fp32, a few tokens: checks the script only")
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None)
    parser.add_argument("--device", default=None)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="steps on the executor's thread, scheduled ahead (issue 45; "
                        "torch.profiler records CPU ops of its own thread only, so on the "
                        "CPU it sees none)")
    parser.add_argument("--quantization", choices=("int4", "int8", "fp8"), default=None,
                        help="quantize the projections on load (issue 43)")
    parser.add_argument("--prompt-len", type=int, default=None)
    parser.add_argument("--short-len", type=int, default=None)
    parser.add_argument("--output-len", type=int, default=None)
    parser.add_argument("--top", type=int, default=None, help="kernels printed")
    ns = parse_with_defaults(parser, argv, GPU_DEFAULTS, SMOKE_DEFAULTS)
    device = torch.device(ns.device)
    long_len = ns.short_len + ns.output_len
    args = resolve_model(EngineArgs(
        model=ns.model, load_format="dummy", skip_tokenizer_init=True, dtype=ns.dtype,
        device=ns.device, max_model_len=ns.prompt_len + long_len,
        enforce_eager=ns.enforce_eager, async_scheduling=ns.async_scheduling,
        quantization=ns.quantization))
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(args.model).get_text_config().vocab_size
    rng = random.Random(0)
    with LLM(**dataclasses.asdict(args), multiprocess=False) as llm:
        params = SamplingParams(max_tokens=long_len, ignore_eos=True, temperature=0.0)
        llm.generate({"prompt_token_ids": [17] * ns.prompt_len}, params, use_tqdm=False)
        short = profiled_generate(llm, rng, vocab, ns.prompt_len, ns.short_len, device)
        long = profiled_generate(llm, rng, vocab, ns.prompt_len, long_len, device)
    per_step = difference(long, short, ns.output_len)
    results = {"benchmark": "profile_decode", **environment(device), "smoke": ns.smoke,
               "command": shlex.join(["python", "benchmarks/profile_decode.py",
                                      *(sys.argv[1:] if argv is None else argv)]),
               "model": args.model, "model_name": Path(args.model).name, "dtype": ns.dtype,
               "enforce_eager": ns.enforce_eager, "async_scheduling": ns.async_scheduling,
               "quantization": ns.quantization, "prompt_len": ns.prompt_len,
               "decode_steps": ns.output_len, **per_step}
    mode = "eager" if ns.enforce_eager else "CUDA graphs"
    print(f"{results['model_name']} {ns.dtype} on {device} ({mode}), per decode step: "
          f"{per_step['ms_wall_per_step']:.3f} ms wall, {per_step['ms_kernels_per_step']:.3f}"
          f" ms in kernels, {per_step['launches_per_step']:.1f} launches")
    for row in per_step["kernels"][:ns.top]:
        print(f"  {row['us_per_step']:9.1f} us {row['launches_per_step']:7.1f}x  "
              f"{row['kernel'][:110]}")
    if ns.output_json:
        ns.output_json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
