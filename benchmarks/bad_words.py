"""What bad words cost every step: N requests decode T tokens each, with and without K
bad words per request, greedily and with `ignore_eos` (the same tokens' worth of work
either way). The frontend tokenizes each request's bad words once (timed apart and
subtracted); what remains over the plain run is the per-step check, paid by every step
while such a request is in the batch.

    python benchmarks/bad_words.py --model demo --num-requests 16 --num-words 1024

Run it side by side against another tree with PYTHONPATH=<tree> (same machine, same
hour): the machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import random
import string
import time
from collections.abc import Sequence
from typing import Any

from pagellm import LLM, SamplingParams


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--num-words", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)

    rng = random.Random(0)
    words = ["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 12)))
             for _ in range(args.num_words)]
    with LLM(args.model, kv_cache_memory_bytes=64 * 2**20, multiprocess=False) as llm:
        vocab = llm.info.vocab_size
        prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(16)]}
                   for _ in range(args.num_requests)]
        runs: dict[str, list[float]] = {"plain": [], "bad_words": []}
        for _ in range(args.repeats):
            for label, bad in (("plain", None), ("bad_words", words)):
                params = SamplingParams(temperature=0.0, max_tokens=args.output_len,
                                        ignore_eos=True, bad_words=bad)
                start = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                runs[label].append(time.perf_counter() - start)
        start = time.perf_counter()
        for i, prompt in enumerate(prompts):
            llm.input_processor.process_inputs(f"t{i}", prompt, SamplingParams(bad_words=words))
        tokenize_s = time.perf_counter() - start
    per_step_ms = (min(runs["bad_words"]) - tokenize_s - min(runs["plain"])) \
        / args.output_len * 1000
    results = {"benchmark": "bad_words", "date": time.strftime("%Y-%m-%d"),
               "args": vars(args), "runs_s": runs, "tokenize_s": tokenize_s,
               "extra_ms_per_step": per_step_ms}
    print(f"plain {min(runs['plain']):.2f} s, with {args.num_words} bad words "
          f"{min(runs['bad_words']):.2f} s (of which tokenizing them {tokenize_s:.2f} s): "
          f"{per_step_ms:.2f} ms more per step for {args.num_requests} requests")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
