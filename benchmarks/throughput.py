"""Offline throughput: pagellm against transformers' `generate` on the same work.

N requests with prompt and output lengths drawn uniformly from the given ranges, random
prompt token ids, greedy decoding, EOS ignored so that every request produces exactly
the tokens it asked for. transformers runs the same requests the way a user would:
batches of --hf-batch-size in input order, left padding, each batch running to its
longest request; only the tokens each request asked for are counted for both.

    python benchmarks/throughput.py --model demo --num-prompts 64
    python benchmarks/throughput.py --model benchmarks/configs/qwen2.5-0.5b \
        --load-format dummy --skip-tokenizer-init --dtype float32 --num-prompts 16

Prints a table and, with --output-json, writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import torch

from pagellm import LLM, SamplingParams
from pagellm.executor.demo_model import resolve_model
from pagellm.protocol.engine_args import EngineArgs


@dataclass
class Result:
    engine: str
    seconds: float
    requests_per_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float


def make_workload(num: int, input_range: tuple[int, int], output_range: tuple[int, int],
                  vocab: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    # Skip the lowest ids: test tokenizers put their special tokens there.
    return [([rng.randrange(16, vocab) for _ in range(rng.randint(*input_range))],
             rng.randint(*output_range)) for _ in range(num)]


def result(engine: str, seconds: float, work: list[tuple[list[int], int]]) -> Result:
    prompt_tokens = sum(len(p) for p, _ in work)
    output_tokens = sum(n for _, n in work)
    return Result(engine, seconds, len(work) / seconds, output_tokens / seconds,
                  (prompt_tokens + output_tokens) / seconds)


def run_pagellm(args: EngineArgs, work: list[tuple[list[int], int]],
                warmup: list[tuple[list[int], int]] | None = None) -> Result:
    """Time `work` on a warmed-up engine. `warmup` (other prompts of the same shape: no
    prefix-cache hits) makes Triton compile for long prefills and every split-KV slice
    count before the clock starts; by default one short request warms up."""

    def submit(llm: LLM, batch: list[tuple[list[int], int]]) -> list[Any]:
        prompts = [{"prompt_token_ids": p} for p, _ in batch]
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                  for _, n in batch]
        return llm.generate(prompts, params, use_tqdm=False)

    with LLM(**asdict(args)) as llm:
        submit(llm, warmup or [(work[0][0][:8], 4)])
        start = time.perf_counter()
        outputs = submit(llm, work)
        seconds = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outputs] == [n for _, n in work]
    return result("pagellm", seconds, work)


def load_hf_model(args: EngineArgs, dtype: torch.dtype) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    if args.load_format == "dummy":
        config = AutoConfig.from_pretrained(args.model)
        torch.manual_seed(args.seed)
        return AutoModelForCausalLM.from_config(config, dtype=dtype)
    return AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)


def run_transformers(args: EngineArgs, work: list[tuple[list[int], int]], batch_size: int,
                     dtype: torch.dtype, device: str = "cpu") -> Result:
    """transformers' generate as a user batches it: input order, left padding, each
    batch running to its longest request; one untimed short generate warms up."""
    model = load_hf_model(args, dtype).to(device).eval()
    pad = 0

    def generate(batch: list[tuple[list[int], int]]) -> None:
        longest_prompt = max(len(p) for p, _ in batch)
        longest_output = max(n for _, n in batch)
        ids = torch.tensor([[pad] * (longest_prompt - len(p)) + p for p, _ in batch],
                           device=device)
        mask = torch.tensor([[0] * (longest_prompt - len(p)) + [1] * len(p)
                             for p, _ in batch], device=device)
        model.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=pad,
                       max_new_tokens=longest_output, min_new_tokens=longest_output)

    def sync() -> None:
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)

    with torch.inference_mode():
        generate([(p[:16], 4) for p, _ in work[:2]])
        sync()
        start = time.perf_counter()
        for i in range(0, len(work), batch_size):
            generate(work[i:i + batch_size])
        sync()
        seconds = time.perf_counter() - start
    return result("transformers", seconds, work)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, nargs=2, default=(32, 256),
                        metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 128),
                        metavar=("MIN", "MAX"))
    parser.add_argument("--workload-seed", type=int, default=0)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers run")
    parser.add_argument("--output-json", type=Path, default=None)
    ns = parser.parse_args(argv)
    args = resolve_model(EngineArgs.from_cli_args(ns))

    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    work = make_workload(ns.num_prompts, tuple(ns.input_len), tuple(ns.output_len), vocab,
                         ns.workload_seed)
    results = [run_pagellm(args, work)]
    if not ns.no_hf:
        dtype_name = args.dtype
        if dtype_name == "auto":
            dtype = AutoConfig.from_pretrained(args.model).dtype or torch.float32
        else:
            dtype = getattr(torch, dtype_name)
        results.append(run_transformers(args, work, ns.hf_batch_size, dtype))

    print(f"{len(work)} requests, prompt {ns.input_len[0]}-{ns.input_len[1]} tokens, "
          f"output {ns.output_len[0]}-{ns.output_len[1]} tokens, model {args.model}")
    print(f"{'engine':<14}{'seconds':>10}{'req/s':>10}{'out tok/s':>12}{'total tok/s':>13}")
    for r in results:
        print(f"{r.engine:<14}{r.seconds:>10.2f}{r.requests_per_s:>10.2f}"
              f"{r.output_tokens_per_s:>12.1f}{r.total_tokens_per_s:>13.1f}")
    if len(results) == 2:
        print(f"pagellm / transformers output tokens/s: "
              f"{results[0].output_tokens_per_s / results[1].output_tokens_per_s:.2f}x")
    if ns.output_json:
        ns.output_json.write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d"), "machine": platform.platform(),
            "cpu_threads": torch.get_num_threads(), "torch": torch.__version__,
            "engine_args": asdict(args), "num_prompts": ns.num_prompts,
            "input_len": ns.input_len, "output_len": ns.output_len,
            "hf_batch_size": ns.hf_batch_size,
            "results": [asdict(r) for r in results]}, indent=2))


if __name__ == "__main__":
    main()
