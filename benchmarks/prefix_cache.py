"""Prefix caching: what it saves on shared prefixes, and what it costs without them.

1. Shared prefix: N requests with one S-token system prompt and a short unique
   question each, all submitted at once to AsyncLLM; throughput and time to first
   token (TTFT), with and without prefix caching.
2. No sharing: N requests with distinct random prompts, with and without prefix
   caching: the cost of hashing blocks and looking them up at a 0% hit rate.

    python benchmarks/prefix_cache.py --model demo --num-requests 256 --prefix-len 1000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from pagellm import AsyncLLM, RequestOutputKind, SamplingParams
from pagellm.demo.model import resolve_model
from pagellm.protocol.engine_args import EngineArgs


async def serve(engine: AsyncLLM, prompts: list[list[int]], output_len: int
                ) -> tuple[float, list[float]]:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    start = time.perf_counter()
    ttfts: list[float] = []

    async def one(i: int, prompt: list[int]) -> None:
        first = True
        async for _ in engine.generate({"prompt_token_ids": prompt}, params, f"r{i}"):
            if first:
                ttfts.append(time.perf_counter() - start)
                first = False

    await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])
    return time.perf_counter() - start, ttfts


def run(model: str, caching: bool, prompts: list[list[int]], output_len: int,
        max_num_seqs: int) -> dict[str, float]:
    engine = AsyncLLM(model, enable_prefix_caching=caching, max_num_seqs=max_num_seqs,
                      kv_cache_memory_bytes=2 * 2**30)
    try:
        asyncio.run(serve(engine, [prompts[0][:16]], 2))  # warm up
        seconds, ttfts = asyncio.run(serve(engine, prompts, output_len))
        stats = asyncio.run(engine.get_stats())
    finally:
        engine.shutdown()
    tokens = sum(len(p) for p in prompts) + len(prompts) * output_len
    return {"seconds": seconds, "requests_per_s": len(prompts) / seconds,
            "total_tokens_per_s": tokens / seconds,
            "ttft_mean_s": statistics.mean(ttfts), "ttft_median_s": statistics.median(ttfts),
            "ttft_p99_s": sorted(ttfts)[int(0.99 * (len(ttfts) - 1))],
            "hit_rate": stats.prefix_cache_hits / max(stats.prefix_cache_queries, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prefix-len", type=int, default=1000)
    parser.add_argument("--suffix-len", type=int, default=24)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--output-json", type=Path, default=None)
    ns = parser.parse_args()
    model = resolve_model(EngineArgs(model=ns.model)).model
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model).vocab_size
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(16, vocab) for _ in range(n)]

    system = tokens(ns.prefix_len)
    shared = [system + tokens(ns.suffix_len) for _ in range(ns.num_requests)]
    distinct = [tokens(ns.prefix_len + ns.suffix_len) for _ in range(ns.num_requests)]
    results = {}
    for name, prompts in (("shared", shared), ("distinct", distinct)):
        for caching in (True, False):
            key = f"{name}/{'caching' if caching else 'no caching'}"
            results[key] = run(model, caching, prompts, ns.output_len, ns.max_num_seqs)
            r = results[key]
            print(f"{key:<24} {r['seconds']:7.2f} s  {r['requests_per_s']:7.2f} req/s  "
                  f"{r['total_tokens_per_s']:9.0f} tok/s  TTFT mean {r['ttft_mean_s']:.3f} s "
                  f"median {r['ttft_median_s']:.3f} s p99 {r['ttft_p99_s']:.3f} s  "
                  f"hits {r['hit_rate']:.1%}")
    speedup = results["shared/caching"]["total_tokens_per_s"] / \
        results["shared/no caching"]["total_tokens_per_s"]
    cost = 1 - results["distinct/caching"]["total_tokens_per_s"] / \
        results["distinct/no caching"]["total_tokens_per_s"]
    print(f"shared prefix: {speedup:.2f}x throughput with caching; "
          f"cost at 0% hits: {cost:+.1%} throughput")
    if ns.output_json:
        ns.output_json.write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d"), "machine": platform.platform(),
            "args": vars(ns) | {"output_json": str(ns.output_json)}, "results": results},
            indent=2))


if __name__ == "__main__":
    main()
