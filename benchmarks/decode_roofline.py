"""Batch-1 decode, end to end through `LLM.generate`, against the memory roofline.

Generating one token for one request reads every weight once (plus the request's KV
cache), so no engine can decode faster than

    roofline tokens/s = copy bandwidth / bytes read per decode step

where the copy bandwidth is what a large tensor copy reaches on this device (measured
here, see kernel_bench.py) and the bytes read per step are, for the engine's dtype:
every parameter of the model as transformers builds it from config.json (counted on the
meta device; a tied embedding counted once, as the lm_head; an untied input embedding
counts one row, the only one a step reads) plus the K/V of the average context over
the measured tokens. Target: at least 75% of the roofline. What is missing from it is
the engine's per-step cost outside the GPU's memory traffic (Python, launches, the
host sync that reads the sampled token): CUDA graphs exist to remove it, so the GPU
suite runs each model with them and with --enforce-eager.

Decode speed excludes prefill: one request of --prompt-len random token ids is
generated with max_tokens = --short-len and with --short-len + --output-len (greedy,
ignore_eos, fresh random prompts every run so the prefix cache never hits), each
--repeats times after a warm-up run; then

    decode tokens/s = output_len / (median long run - median short run)

RequestOutput carries no per-token timestamps, hence the difference of two runs.

    python benchmarks/decode_roofline.py --model benchmarks/configs/qwen2.5-1.5b
    python benchmarks/decode_roofline.py --model benchmarks/configs/qwen2.5-1.5b --enforce-eager
    python benchmarks/decode_roofline.py --smoke        # CPU, demo model, fp32, a few tokens

Weights are random (load_format="dummy"): speed does not depend on their values.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # kernel_bench, when imported
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import torch
from kernel_bench import environment, measure_copy_bandwidth, parse_with_defaults

from pagellm import LLM, SamplingParams
from pagellm.demo.model import resolve_model
from pagellm.protocol.engine_args import EngineArgs

ROOT = Path(__file__).resolve().parents[1]
TARGET_PCT_OF_ROOFLINE = 75.0

GPU_DEFAULTS: dict[str, Any] = dict(
    model=str(ROOT / "benchmarks/configs/qwen2.5-1.5b"), dtype="bfloat16", device="cuda",
    prompt_len=128, short_len=16, output_len=512, repeats=3, copy_mib=2048)
HF_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SMOKE_DEFAULTS: dict[str, Any] = dict(
    model="demo", dtype="float32", device="cpu", prompt_len=8, short_len=2, output_len=8,
    repeats=1, copy_mib=16)


def bytes_per_decode_step(model_dir: str, element_size: int, context: float,
                          quantization: str | None = None) -> dict[str, Any]:
    """Bytes one batch-1 decode step must read: the weights (see the module docstring)
    and the K/V of `context` tokens. With `quantization` (quantize on load), the
    decoder's projections count their packed bits plus a scale and a zero per group
    (fp8: a scale per output channel)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):  # shapes only: no memory, no initialisation
        model = AutoModelForCausalLM.from_config(config)
    model.tie_weights()  # transformers 5.0 leaves a model built on "meta" untied
    params = {id(p): p for p in model.parameters()}  # a tied weight appears once
    num_params = sum(p.numel() for p in params.values())
    embedding = model.get_input_embeddings().weight
    output = model.get_output_embeddings()
    tied = output is not None and output.weight is embedding
    read = num_params if tied else num_params - embedding.numel() + embedding.shape[1]
    text = config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_per_token = 2 * text.num_hidden_layers * text.num_key_value_heads * head_dim
    if getattr(text, "kv_lora_rank", None):  # DeepSeek's latent, cached once
        kv_per_token = text.num_hidden_layers * (text.kv_lora_rank + text.qk_rope_head_dim)
    weight_bytes = read * element_size
    if quantization is not None:
        from pagellm.executor.model.quantize import QUANTIZATIONS, group_size_for

        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in HF_PROJECTIONS:
                n, k = module.weight.shape
                scales = (n * 4 if quantization == "fp8"  # one fp32 scale per channel
                          else 2 * element_size * n * k // group_size_for(k))
                weight_bytes += (n * k * QUANTIZATIONS[quantization] // 8 + scales
                                 - n * k * element_size)
    kv_bytes = int(kv_per_token * context * element_size)
    return {"num_params": num_params, "tied_embeddings": tied, "weight_bytes": weight_bytes,
            "kv_bytes_per_step": kv_bytes, "bytes_per_step": weight_bytes + kv_bytes}


def timed_generate(llm: LLM, rng: random.Random, vocab: int, prompt_len: int,
                   max_tokens: int) -> float:
    """Seconds to generate `max_tokens` for one fresh random prompt."""
    prompt = {"prompt_token_ids": [rng.randrange(16, vocab) for _ in range(prompt_len)]}
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    start = time.perf_counter()
    outputs = llm.generate(prompt, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    assert len(outputs[0].outputs[0].token_ids) == max_tokens, outputs[0]
    return seconds


def print_summary(r: dict[str, Any]) -> None:
    mode = "eager" if r["enforce_eager"] else "CUDA graphs"
    speed = ("n/a (decode time below noise)" if r["decode_tokens_per_s"] is None else
             f"{r['decode_tokens_per_s']:.1f} tokens/s ({r['ms_per_token']:.2f} ms/token), "
             f"{r['pct_of_roofline']:.1f}% of")
    print(f"{r['model_name']} {r['dtype']} on {r['device']} ({mode}): {speed} the roofline "
          f"{r['roofline_tokens_per_s']:.1f} tokens/s ({r['bytes_per_step'] / 1e9:.3f} "
          f"GB/step at {r['copy_bandwidth_gbps']:.0f} GB/s); target "
          f"{r['target_pct_of_roofline']:.0f}%")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true",
                        help="CPU, demo model, fp32, a few tokens: checks the script only")
    parser.add_argument("--model", default=None,
                        help="model or config-only directory, or 'demo' (default: "
                             "benchmarks/configs/qwen2.5-1.5b; demo with --smoke)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None)
    parser.add_argument("--device", default=None)
    parser.add_argument("--enforce-eager", action="store_true",
                        help="run the engine without CUDA graphs")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="schedule step n+1 while step n runs (issue 45)")
    parser.add_argument("--quantization", choices=("int4", "int8", "fp8"), default=None,
                        help="quantize the projections on load (CUDA)")
    parser.add_argument("--prompt-len", type=int, default=None)
    parser.add_argument("--short-len", type=int, default=None,
                        help="max_tokens of the run subtracted to cancel prefill")
    parser.add_argument("--output-len", type=int, default=None,
                        help="decode tokens measured (the long run has short + this many)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--copy-mib", type=int, default=None)
    return parse_with_defaults(parser, argv, GPU_DEFAULTS, SMOKE_DEFAULTS)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Measure; return (and with --output-json write) the results."""
    ns = parse_args(argv)
    device = torch.device(ns.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("decode_roofline needs CUDA; use --smoke on a CPU machine")
    long_len = ns.short_len + ns.output_len
    engine_kwargs: dict[str, Any] = dict(
        load_format="dummy", skip_tokenizer_init=True, dtype=ns.dtype, device=ns.device,
        max_model_len=ns.prompt_len + long_len, enforce_eager=ns.enforce_eager,
        quantization=ns.quantization, async_scheduling=ns.async_scheduling)
    args = resolve_model(EngineArgs(model=ns.model, **engine_kwargs))
    # Measured before the engine starts, so that it has the device to itself.
    copy = measure_copy_bandwidth(device, ns.copy_mib * 2**20)
    element_size = torch.empty((), dtype=getattr(torch, ns.dtype)).element_size()
    traffic = bytes_per_decode_step(args.model, element_size,
                                    context=ns.prompt_len + ns.short_len + ns.output_len / 2,
                                    quantization=ns.quantization)

    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(args.model).get_text_config().vocab_size
    rng = random.Random(0)
    short_s: list[float] = []
    long_s: list[float] = []
    with LLM(**dataclasses.asdict(args)) as llm:
        timed_generate(llm, rng, vocab, ns.prompt_len, long_len)  # warm-up: every shape
        for _ in range(ns.repeats):
            short_s.append(timed_generate(llm, rng, vocab, ns.prompt_len, ns.short_len))
            long_s.append(timed_generate(llm, rng, vocab, ns.prompt_len, long_len))
    decode_s = statistics.median(long_s) - statistics.median(short_s)
    # Only noise (a smoke run's few tokens) can make the difference non-positive.
    tokens_per_s = ns.output_len / decode_s if decode_s > 0 else None
    roofline = copy["copy_bandwidth_gbps"] * 1e9 / traffic["bytes_per_step"]
    results: dict[str, Any] = {
        "benchmark": "decode_roofline", **environment(device), "smoke": ns.smoke,
        "command": shlex.join(["python", "benchmarks/decode_roofline.py",
                                *(sys.argv[1:] if argv is None else argv)]),
        "model": ns.model, "model_name": Path(args.model).name, "dtype": ns.dtype,
        "enforce_eager": ns.enforce_eager, "quantization": ns.quantization,
        "async_scheduling": ns.async_scheduling,
        "engine_args": dataclasses.asdict(args),
        "prompt_len": ns.prompt_len, "short_len": ns.short_len, "long_len": long_len,
        "repeats": ns.repeats, "short_s": short_s, "long_s": long_s,
        "decode_seconds": decode_s, "decode_tokens_per_s": tokens_per_s,
        "ms_per_token": 1e3 / tokens_per_s if tokens_per_s else None,
        **copy, **traffic, "roofline_tokens_per_s": roofline,
        "pct_of_roofline": 100 * tokens_per_s / roofline if tokens_per_s else None,
        "target_pct_of_roofline": TARGET_PCT_OF_ROOFLINE}
    print_summary(results)
    if ns.output_json:
        ns.output_json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
