"""Engine-core overhead at many concurrent requests on a tiny model.

With a model this small the forward pass costs little, so the step is dominated by
the engine core's own bookkeeping: scheduling, preparing inputs, updating requests and
handing out outputs (everything but forward and sample). The target is under 0.5 ms per
step at 256 running requests (issue #16). Preparing inputs includes the attention
backend's per-step plan (on the CPU, the reference kernels' gather indices and masks),
reported on its own line. Also reported: how far the frontend (AsyncLLM: detokenization
and output processing for 256 streams) lags behind the engine's outputs; the target is
under 2 ms (median).

    python benchmarks/engine_overhead.py --num-requests 256 --output-len 256

`--engine-only` steps an `EngineCore` in this process instead (no frontend, no
sockets): the same workload's step timings without the frontend competing for the
machine's cores, every step while all requests run. `--frontend-only` is the other
half: an `OutputProcessor` fed one token per stream per step, as the engine core would
send them, with a waiting consumer task per stream; it reports each step's
`process_outputs` and the consumers' takes (building their outputs), medians.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from pagellm import AsyncLLM, EngineArgs, RequestOutputKind, SamplingParams
from pagellm.demo.model import ModelSpec, make_model
from pagellm.enginecore.core import EngineCore
from pagellm.frontend.input_processor import InputProcessor
from pagellm.frontend.output_collector import RequestOutputCollector
from pagellm.frontend.output_processor import OutputProcessor
from pagellm.protocol.codec import MsgpackEncoder
from pagellm.protocol.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineInfo,
    TokenLogprobs,
)
from pagellm.protocol.stats import EngineStats, StepTimings

TINY = ModelSpec(arch="llama", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                 intermediate_size=64, vocab_size=512, max_position_embeddings=2048)
KV_CACHE_BYTES = 256 * 2**20
FIELDS = ("schedule_s", "prepare_inputs_s", "forward_s", "sample_s", "update_s",
          "output_s", "attention_plan_s")


def prompt(i: int, prompt_len: int) -> list[int]:
    return [(i * 7 + j) % 500 + 3 for j in range(prompt_len)]


async def run(engine: AsyncLLM, num_requests: int, prompt_len: int, output_len: int
              ) -> tuple[list[EngineStats], list[float], float]:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    lags: list[float] = []

    async def one(i: int) -> int:
        tokens = 0
        async for out in engine.generate({"prompt_token_ids": prompt(i, prompt_len)}, params,
                                         f"r{i}"):
            tokens += len(out.outputs[0].token_ids)
        return tokens

    calls: list[asyncio.Future[EngineStats]] = []

    async def sample() -> None:
        # The lag every 10 ms (a default run lasts well under a second: sampled every
        # 0.1 s, its median was of five values, one or two from the prompts' step),
        # and every 0.1 s a stats call. A call does not wait for the one before: its
        # answer queues behind the outputs on the same socket, so waiting would
        # stretch the sampling period with the lag and bias the timings toward the
        # run's first (short-context) steps when the frontend falls behind.
        for tick in itertools.count(1):
            await asyncio.sleep(0.01)
            lags.append(engine.output_lag_s)
            if tick % 10 == 0:
                calls.append(asyncio.ensure_future(engine.get_stats()))

    sampler = asyncio.create_task(sample())
    start = time.perf_counter()
    counts = await asyncio.gather(*[one(i) for i in range(num_requests)])
    elapsed = time.perf_counter() - start
    sampler.cancel()
    assert sum(counts) == num_requests * output_len
    snapshots = [s for s in await asyncio.gather(*calls) if s.num_running_reqs == num_requests]
    return snapshots, lags, elapsed


def run_engine_only(model: Path, num_requests: int, prompt_len: int, output_len: int
                    ) -> tuple[list[StepTimings], float]:
    """Step an in-process engine core to the end; each step's timings while all
    requests run ("output": encoding the outputs; no sockets here)."""
    core = EngineCore(EngineArgs(model=str(model), max_num_seqs=num_requests,
                                 kv_cache_memory_bytes=KV_CACHE_BYTES))
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i in range(num_requests):
        core.add_request(EngineCoreRequest(f"r{i}", prompt(i, prompt_len), params, None,
                                           time.time()))
    encoder, buffer = MsgpackEncoder(), bytearray()
    steps: list[StepTimings] = []
    start = time.perf_counter()
    try:
        while core.has_work():
            running = core.scheduler.num_running
            outputs = core.step()
            t0 = time.perf_counter()
            for client_outputs in outputs.values():
                encoder.encode_into(client_outputs, buffer)
            if running == num_requests and core.scheduler.num_running == num_requests:
                timings = core.recent_steps[-1]
                timings.output_s = time.perf_counter() - t0
                steps.append(timings)
    finally:
        core.shutdown()
    return steps, time.perf_counter() - start


def run_frontend_only(model: Path, num_requests: int, prompt_len: int, output_len: int,
                      logprobs: int | None = None) -> tuple[list[float], list[float]]:
    """Per step: seconds in `process_outputs` for one token per stream, and seconds
    until every consumer has taken its output (DELTA streams, as `run`'s). With
    `logprobs`, each token comes with that many alternatives (full outputs, as the
    engine core sends them then)."""
    from transformers import AutoTokenizer  # here: the other modes do not need it

    info = EngineInfo(model="tiny", max_model_len=TINY.max_position_embeddings,
                      vocab_size=TINY.vocab_size, block_size=16, num_kv_blocks=1,
                      max_num_batched_tokens=8192, device="cpu", dtype="float32",
                      max_num_seqs=num_requests)
    tokenizer = AutoTokenizer.from_pretrained(model)
    inputs, processor = InputProcessor(tokenizer, info), OutputProcessor(tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA, logprobs=logprobs)
    streams = [inputs.process_inputs(f"r{i}", {"prompt_token_ids": prompt(i, prompt_len)},
                                     params) for i in range(num_requests)]
    engine_ids = [s.engine_requests[0].request_id for s in streams]
    collectors = [processor.add_stream(s) for s in streams]
    processing: list[float] = []
    taking: list[float] = []

    async def consume(collector: RequestOutputCollector) -> int:
        tokens = 0
        while tokens < output_len:
            output = await collector.get()
            assert not isinstance(output, BaseException), output
            completion = output.outputs[0]
            tokens += len(completion.token_ids)
            if logprobs is not None:  # every token's alternatives arrived, decoded
                assert completion.logprobs is not None
                assert [len(p) for p in completion.logprobs] == \
                    [logprobs + 1] * len(completion.token_ids)
                assert all(lp.decoded_token is not None for p in completion.logprobs
                           for lp in p.values())
        return tokens

    async def drive() -> list[int]:
        consumers = [asyncio.create_task(consume(c)) for c in collectors]
        await asyncio.sleep(0)  # every consumer waits
        for step in range(output_len):
            tokens = [(step * 13 + k) % 500 + 3 for k in range(len(engine_ids))]
            # As the engine core sends them: a first token in full, then plain columns
            # (with logprobs: every token in full, its alternatives the next ids).
            if logprobs is not None:
                message = EngineCoreOutputs([EngineCoreOutput(r, [t], new_logprobs=[
                    TokenLogprobs([t, *((t + j) % 500 + 3 for j in range(1, logprobs + 1))],
                                  [-1.0] * (logprobs + 1), list(range(1, logprobs + 2)))])
                    for r, t in zip(engine_ids, tokens, strict=True)])
            elif step:
                message = EngineCoreOutputs(token_req_ids=engine_ids, token_ids=tokens)
            else:
                message = EngineCoreOutputs([EngineCoreOutput(r, [t])
                                             for r, t in zip(engine_ids, tokens, strict=True)])
            t0 = time.perf_counter()
            processor.process_outputs(message)
            t1 = time.perf_counter()
            await asyncio.sleep(0)  # the woken consumers run and take
            processing.append(t1 - t0)
            taking.append(time.perf_counter() - t1)
        return await asyncio.gather(*consumers)

    assert asyncio.run(drive()) == [output_len] * num_requests
    return processing, taking


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=256)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--engine-only", action="store_true",
                      help="step an engine core in this process: no frontend, no sockets")
    mode.add_argument("--frontend-only", action="store_true",
                      help="feed the output processor synthetic steps: no engine")
    parser.add_argument("--logprobs", type=int, default=None,
                        help="--frontend-only: each token with this many alternatives")
    parser.add_argument("--output-json", type=Path, default=None)
    ns = parser.parse_args()
    lags: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp) / "tiny", TINY)
        if ns.frontend_only:
            processing, taking = run_frontend_only(model, ns.num_requests, ns.prompt_len,
                                                   ns.output_len, ns.logprobs)
            print(f"{ns.num_requests} DELTA streams, {ns.output_len} steps of one token each "
                  f"(frontend alone, logprobs={ns.logprobs}), per step (ms, median):")
            print(f"  process_outputs {statistics.median(processing) * 1e3:8.3f}")
            print(f"  consumers take  {statistics.median(taking) * 1e3:8.3f}")
            return
        if ns.engine_only:
            steps, elapsed = run_engine_only(model, ns.num_requests, ns.prompt_len,
                                             ns.output_len)
        else:
            engine = AsyncLLM(str(model), max_num_seqs=ns.num_requests,
                              kv_cache_memory_bytes=KV_CACHE_BYTES)
            try:
                snapshots, lags, elapsed = asyncio.run(
                    run(engine, ns.num_requests, ns.prompt_len, ns.output_len))
            finally:
                engine.shutdown()
            steps = [s.step_timings for s in snapshots]
    if not steps:
        raise SystemExit("never saw all requests running at once; use more output tokens")
    per_step = {f: statistics.median(getattr(s, f) for s in steps) * 1e3 for f in FIELDS}
    bookkeeping = sum(per_step[f] for f in ("schedule_s", "prepare_inputs_s", "update_s",
                                            "output_s"))
    total_tokens = ns.num_requests * ns.output_len
    print(f"{ns.num_requests} concurrent requests, {ns.output_len} output tokens each, "
          f"{elapsed:.1f} s, {total_tokens / elapsed:.0f} output tokens/s"
          + (" (engine core alone)" if ns.engine_only else ""))
    print("per step at full batch (ms, median of " +
          ("every step):" if ns.engine_only else "windowed means):"))
    for f in FIELDS[:-1]:
        print(f"  {f.removesuffix('_s'):<16}{per_step[f]:8.3f}")
    print(f"    of which attention plan {per_step['attention_plan_s']:6.3f}   (in prepare_inputs)")
    print(f"  bookkeeping     {bookkeeping:8.3f}   (schedule + prepare + update + output; "
          "target < 0.5 ms)")
    lag_ms = statistics.median(lags) * 1e3 if lags else float("nan")
    if not ns.engine_only:
        p90 = statistics.quantiles(lags, n=10)[-1] * 1e3 if len(lags) > 1 else lag_ms
        print(f"frontend lag behind the engine: median {lag_ms:.2f} ms, p90 {p90:.2f} ms, "
              f"{len(lags)} samples   (target < 2 ms median)")
    if ns.output_json:
        ns.output_json.write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d"), "machine": platform.platform(),
            "num_requests": ns.num_requests, "output_len": ns.output_len,
            "engine_only": ns.engine_only, "per_step_ms": per_step,
            "bookkeeping_ms": bookkeeping, "frontend_lag_ms": lag_ms,
            "output_tokens_per_s": total_tokens / elapsed}, indent=2))


if __name__ == "__main__":
    main()
