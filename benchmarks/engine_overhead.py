"""Engine-core overhead at many concurrent requests on a tiny model.

With a model this small the forward pass costs little, so the step is dominated by
the engine core's own bookkeeping: scheduling, preparing inputs, updating requests and
encoding outputs (everything but forward and sample). The target is under 1 ms per
step at 256 running requests. Also reported: how far the frontend (AsyncLLM:
detokenization and output processing) lags behind the engine's outputs.

    python benchmarks/engine_overhead.py --num-requests 256 --output-len 256
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from pagellm import AsyncLLM, RequestOutputKind, SamplingParams
from pagellm.executor.demo_model import ModelSpec, make_model
from pagellm.protocol.stats import EngineStats

TINY = ModelSpec(arch="llama", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                 intermediate_size=64, vocab_size=512, max_position_embeddings=2048)


async def run(engine: AsyncLLM, num_requests: int, prompt_len: int, output_len: int
              ) -> tuple[list[EngineStats], list[float], float]:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    lags: list[float] = []

    async def one(i: int) -> int:
        tokens = 0
        prompt = {"prompt_token_ids": [(i * 7 + j) % 500 + 3 for j in range(prompt_len)]}
        async for out in engine.generate(prompt, params, f"r{i}"):
            tokens += len(out.outputs[0].token_ids)
        return tokens

    snapshots: list[EngineStats] = []

    async def sample() -> None:
        while True:
            await asyncio.sleep(0.25)
            stats = await engine.get_stats()
            lags.append(engine.output_lag_s)
            if stats.num_running_reqs == num_requests:
                snapshots.append(stats)

    sampler = asyncio.create_task(sample())
    start = time.perf_counter()
    counts = await asyncio.gather(*[one(i) for i in range(num_requests)])
    elapsed = time.perf_counter() - start
    sampler.cancel()
    assert sum(counts) == num_requests * output_len
    return snapshots, lags, elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--output-json", type=Path, default=None)
    ns = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp) / "tiny", TINY)
        engine = AsyncLLM(str(model), max_num_seqs=ns.num_requests,
                          kv_cache_memory_bytes=256 * 2**20)
        try:
            snapshots, lags, elapsed = asyncio.run(
                run(engine, ns.num_requests, ns.prompt_len, ns.output_len))
        finally:
            engine.shutdown()
    if not snapshots:
        raise SystemExit("never saw all requests running at once; use more output tokens")
    fields = ("schedule_s", "prepare_inputs_s", "forward_s", "sample_s", "update_s",
              "output_encode_s")
    per_step = {f: statistics.median(getattr(s.step_timings, f) for s in snapshots) * 1e3
                for f in fields}
    bookkeeping = sum(per_step[f] for f in fields if f not in ("forward_s", "sample_s"))
    total_tokens = ns.num_requests * ns.output_len
    print(f"{ns.num_requests} concurrent requests, {ns.output_len} output tokens each, "
          f"{elapsed:.1f} s, {total_tokens / elapsed:.0f} output tokens/s")
    print("per step at full batch (ms, median of windowed means):")
    for f in fields:
        print(f"  {f.removesuffix('_s'):<16}{per_step[f]:8.3f}")
    print(f"  bookkeeping     {bookkeeping:8.3f}   (schedule + prepare + update + encode; "
          "target < 1 ms)")
    lag_ms = statistics.median(lags) * 1e3 if lags else float("nan")
    print(f"frontend lag behind the engine: median {lag_ms:.2f} ms")
    if ns.output_json:
        ns.output_json.write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d"), "machine": platform.platform(),
            "num_requests": ns.num_requests, "output_len": ns.output_len,
            "per_step_ms": per_step, "bookkeeping_ms": bookkeeping,
            "frontend_lag_ms": lag_ms, "output_tokens_per_s": total_tokens / elapsed},
            indent=2))


if __name__ == "__main__":
    main()
