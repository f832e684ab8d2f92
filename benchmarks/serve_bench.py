"""Online serving benchmark: latency and throughput of the OpenAI-compatible server.

Why: offline throughput (benchmarks/throughput.py) says how fast the engine is when it
sees every request at once; a server is judged by its users' latencies under a load
that arrives over time. This script measures what vLLM's `benchmark_serving` measures,
in its terms, so numbers can be set side by side: requests arrive as a Poisson process
(exponential gaps from a seeded RNG; `--request-rate inf` sends them all at once),
optionally capped at `--max-concurrency` in flight, each a streamed
POST /v1/completions of random prompt token ids with `ignore_eos`, greedy, and
`stream_options.include_usage`, sent with the official `openai.AsyncOpenAI` client.

Per request it records the send time, the arrival time of every chunk that carries a
choice (one per engine output: a token whose text is still incomplete UTF-8 arrives as
an empty string, but it is a token), the usage chunk's completion_tokens and the end of
the stream. Reported: request, output and total token throughput; TTFT, TPOT
((e2e - ttft) / (output tokens - 1), requests of one token left out), ITL (every gap
between consecutive chunks) and end-to-end latency, as mean, median and p99 in ms.
Output tokens are counted from usage, not from chunks.

Against a running server (`pagellm serve demo`):

    python benchmarks/serve_bench.py --num-prompts 64 --request-rate 8

Or let it start and stop one (`--serve`), so one command gives numbers on a fresh machine:

    python benchmarks/serve_bench.py --serve demo \
        --serve-args "--kv-cache-memory-bytes 512MiB" --num-prompts 64 --request-rate 8 \
        --input-len 128 --output-len 64 --range-ratio 0.5 --output-json serve.json

The client shares the machine with the server: on a small CPU machine its own cost
(parsing every chunk) is part of the latencies it reports.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from openai import AsyncOpenAI

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # run from a checkout

# Test tokenizers put their special tokens at the lowest ids: random prompts skip them.
FIRST_ORDINARY_ID = 16


@dataclass
class RequestSpec:
    prompt: list[int]
    output_len: int


@dataclass
class RequestResult:
    prompt_len: int
    output_len: int  # as asked (max_tokens)
    start: float = 0.0  # perf_counter when sent (after the concurrency cap)
    end: float = 0.0  # when the stream closed
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0  # from the usage chunk
    error: str | None = None

    @property
    def success(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def e2e(self) -> float:
        return self.end - self.start


def draw_len(rng: random.Random, length: int, range_ratio: float) -> int:
    """`length` itself, or uniform in [length*(1-r), length*(1+r)] (at least 1)."""
    low = max(1, int(length * (1 - range_ratio)))
    return rng.randint(low, max(low, int(length * (1 + range_ratio))))


def make_workload(num: int, input_len: int, output_len: int, range_ratio: float,
                  vocab_size: int, seed: int) -> list[RequestSpec]:
    rng = random.Random(seed)
    specs = []
    for _ in range(num):
        n_in = draw_len(rng, input_len, range_ratio)
        n_out = draw_len(rng, output_len, range_ratio)
        prompt = [rng.randrange(FIRST_ORDINARY_ID, vocab_size) for _ in range(n_in)]
        specs.append(RequestSpec(prompt, n_out))
    return specs


def arrival_offsets(num: int, request_rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is due: a Poisson process, i.e.
    exponential gaps with mean 1/rate; all zero for an infinite rate. Offsets from one
    start, not successive sleeps, so that sleep overshoot does not lower the rate."""
    if math.isinf(request_rate):
        return [0.0] * num
    rng = random.Random(seed + 1)  # independent of the workload's draws
    offsets, t = [], 0.0
    for _ in range(num):
        offsets.append(t)
        t += rng.expovariate(request_rate)
    return offsets


async def send(client: AsyncOpenAI, model: str, spec: RequestSpec) -> RequestResult:
    result = RequestResult(len(spec.prompt), spec.output_len)
    result.start = time.perf_counter()
    try:
        stream = await client.completions.create(
            model=model, prompt=spec.prompt, max_tokens=spec.output_len, temperature=0.0,
            stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        usage = None
        async for chunk in stream:
            if chunk.choices:
                result.chunk_times.append(time.perf_counter())
            if chunk.usage is not None:
                usage = chunk.usage
        result.end = time.perf_counter()
        if usage is None:
            result.error = "the stream ended without a usage chunk"
        elif not result.chunk_times:
            result.error = "the stream carried no tokens"
        else:
            result.output_tokens = usage.completion_tokens
    except Exception as e:  # a failed request is a result, not the benchmark's end
        result.end = time.perf_counter()
        result.error = f"{type(e).__name__}: {e}"
    return result


async def run_load(client: AsyncOpenAI, model: str, specs: list[RequestSpec],
                   request_rate: float, max_concurrency: int | None, seed: int
                   ) -> tuple[list[RequestResult], float]:
    """Send every request at its arrival time; returns the results and the duration
    from the first arrival to the last completion."""
    cap = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(spec: RequestSpec) -> RequestResult:
        if cap is None:
            return await send(client, model, spec)
        async with cap:
            return await send(client, model, spec)

    start = time.perf_counter()
    tasks = []
    for spec, due in zip(specs, arrival_offsets(len(specs), request_rate, seed), strict=True):
        delay = start + due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(spec)))
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start


def _stats_ms(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "median": None, "p99": None}
    ms = np.asarray(values) * 1000.0
    return {"mean": float(ms.mean()), "median": float(np.median(ms)),
            "p99": float(np.percentile(ms, 99))}


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    itls = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)]
    return {
        "successful_requests": len(ok),
        "failed_requests": len(results) - len(ok),
        "short_requests": sum(r.output_tokens < r.output_len for r in ok),
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "ttft_ms": _stats_ms([r.ttft for r in ok]),
        "tpot_ms": _stats_ms([(r.e2e - r.ttft) / (r.output_tokens - 1)
                              for r in ok if r.output_tokens > 1]),
        "itl_ms": _stats_ms(itls),
        "e2el_ms": _stats_ms([r.e2e for r in ok]),
        "chunks_per_output_token": sum(len(r.chunk_times) for r in ok) / max(1, output_tokens),
    }


def print_table(s: dict[str, Any], request_rate: float, max_concurrency: int | None) -> None:
    def row(name: str, value: Any) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else "n/a" if value is None \
            else str(value)
        print(f"{name:<40}{text:>10}")

    print(f"{' Serving Benchmark Result ':=^50}")
    row("Successful requests:", s["successful_requests"])
    row("Failed requests:", s["failed_requests"])
    if s["short_requests"]:
        row("Requests shorter than max_tokens:", s["short_requests"])
    row("Request rate configured (RPS):", request_rate)
    row("Maximum request concurrency:", max_concurrency or "none")
    row("Benchmark duration (s):", s["duration_s"])
    row("Total input tokens:", s["total_input_tokens"])
    row("Total generated tokens:", s["total_output_tokens"])
    row("Request throughput (req/s):", s["request_throughput"])
    row("Output token throughput (tok/s):", s["output_throughput"])
    row("Total Token throughput (tok/s):", s["total_token_throughput"])
    for key, title, name in (("ttft_ms", "Time to First Token", "TTFT"),
                             ("tpot_ms", "Time per Output Token (excl. 1st token)", "TPOT"),
                             ("itl_ms", "Inter-token Latency", "ITL"),
                             ("e2el_ms", "End-to-end Latency", "E2EL")):
        print(f"{' ' + title + ' ':-^50}")
        row(f"Mean {name} (ms):", s[key]["mean"])
        row(f"Median {name} (ms):", s[key]["median"])
        row(f"P99 {name} (ms):", s[key]["p99"])
    print("=" * 50)
    print(f"(the client itself used {s['client_cpu_fraction']:.0%} of a core)")


# -- --serve: a server of our own --------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _health_ok(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


@contextlib.contextmanager
def launched_server(model: str, serve_args: str, timeout: float) -> Iterator[str]:
    """Start `pagellm serve` on a free port, yield its base URL once /health answers
    200, and stop it with SIGTERM afterwards, which must end it with exit code 0."""
    extra = shlex.split(serve_args)
    if any(a in ("--port", "--host") or a.startswith(("--port=", "--host=")) for a in extra):
        raise SystemExit("--serve picks the host and port itself: drop them from --serve-args")
    port = _free_port()
    cmd = [sys.executable, "-m", "pagellm", "serve", model, "--port", str(port), *extra]
    log_fd, log_name = tempfile.mkstemp(prefix="serve_bench-", suffix=".log")
    log = Path(log_name)
    print(f"starting: {shlex.join(cmd)} (log: {log})", file=sys.stderr)
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log_fd, stderr=subprocess.STDOUT)
    os.close(log_fd)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while not _health_ok(base_url):
            if proc.poll() is not None:
                raise SystemExit(f"the server exited with code {proc.returncode} before it "
                                 f"was healthy; the end of its log:\n{_tail(log)}")
            if time.monotonic() > deadline:
                raise SystemExit(f"the server was not healthy after {timeout:.0f} s; the end "
                                 f"of its log:\n{_tail(log)}")
            time.sleep(0.5)
        print(f"server ready at {base_url}", file=sys.stderr)
        yield base_url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                print("the server ignored SIGTERM for 60 s and was killed", file=sys.stderr)
        if proc.returncode == 0:  # a clean run's log is noise; a failed one's is kept
            log.unlink(missing_ok=True)
    if proc.returncode != 0:  # reached only when the benchmark itself got through
        raise SystemExit(f"the server exited with code {proc.returncode} after SIGTERM; "
                         f"the end of its log ({log}):\n{_tail(log)}")
    print("server stopped (exit code 0)", file=sys.stderr)


# -- main ----------------------------------------------------------------------------------

async def benchmark(ns: argparse.Namespace, base_url: str) -> dict[str, Any]:
    client = AsyncOpenAI(base_url=f"{base_url}/v1", max_retries=0, timeout=3600.0,
                         api_key=ns.api_key or os.environ.get("OPENAI_API_KEY", "EMPTY"))
    async with client:
        model = ns.model or (await client.models.list()).data[0].id
        specs = make_workload(ns.num_prompts, ns.input_len, ns.output_len, ns.range_ratio,
                              ns.vocab_size, ns.seed)
        # One short request first: it checks the setup and keeps one-off costs (first
        # allocations, lazy imports in the server) out of the measured run.
        warm = await send(client, model, RequestSpec(specs[0].prompt[:16], 2))
        if not warm.success:
            raise SystemExit(f"the warm-up request failed: {warm.error}")
        print(f"model {model}: {ns.num_prompts} requests at {ns.request_rate} req/s, "
              f"max concurrency {ns.max_concurrency or 'none'}", file=sys.stderr)
        cpu = time.process_time()
        results, duration = await run_load(client, model, specs, ns.request_rate,
                                           ns.max_concurrency, ns.seed)
        cpu = time.process_time() - cpu
    summary = summarize(results, duration)
    # The client competes with the server for cores: how much of one it used.
    summary["client_cpu_fraction"] = cpu / duration
    print_table(summary, ns.request_rate, ns.max_concurrency)
    t0 = min(r.start for r in results)
    errors = [r.error for r in results if r.error is not None]
    for error in errors[:5]:
        print(f"error: {error}", file=sys.stderr)
    config = {k: v for k, v in vars(ns).items() if k not in ("output_json", "api_key")}
    config["model"] = model
    config["base_url"] = base_url
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "config": config, **summary,
            "requests": [{**{k: v for k, v in asdict(r).items()
                             if k not in ("chunk_times", "start", "end")},
                          "start_s": r.start - t0, "num_chunks": len(r.chunk_times),
                          "ttft_ms": r.ttft * 1000 if r.success else None,
                          "e2el_ms": r.e2e * 1000} for r in results]}


def _rate(text: str) -> float:
    rate = float(text)
    if not rate > 0:
        raise argparse.ArgumentTypeError("the request rate must be > 0 (or inf)")
    return rate


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None,
                   help="the served model name (default: the first of GET /v1/models)")
    p.add_argument("--api-key", default=None, help="default: $OPENAI_API_KEY or none")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--request-rate", type=_rate, default=math.inf,
                   help="requests/s of a Poisson process; inf sends all at once")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="at most this many requests in flight (default: no cap)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="0: fixed lengths; r: uniform in [len*(1-r), len*(1+r)]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=500,
                   help="prompt ids are drawn from [16, vocab-size); keep it at most the "
                   "model's vocabulary (the server does not report it)")
    p.add_argument("--output-json", type=Path, default=None)
    s = p.add_argument_group("a server of our own")
    s.add_argument("--serve", metavar="MODEL", default=None,
                   help="start `pagellm serve MODEL` on a free port, benchmark it, stop it "
                   "(--base-url is then ignored)")
    s.add_argument("--serve-args", default="",
                   help="more flags for the server, e.g. \"--kv-cache-memory-bytes 512MiB\" "
                   "(a single flag needs the = form: --serve-args=--flag)")
    s.add_argument("--serve-timeout", type=float, default=300.0,
                   help="seconds to wait for the server's /health")
    return p


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    if not 0 <= ns.range_ratio < 1:
        raise SystemExit("--range-ratio must be in [0, 1)")
    if ns.vocab_size <= FIRST_ORDINARY_ID:
        raise SystemExit(f"--vocab-size must be above {FIRST_ORDINARY_ID}")
    if ns.num_prompts < 1 or ns.input_len < 1 or ns.output_len < 1:
        raise SystemExit("--num-prompts, --input-len and --output-len must be positive")
    if ns.max_concurrency is not None and ns.max_concurrency < 1:
        raise SystemExit("--max-concurrency must be positive")
    with contextlib.ExitStack() as stack:
        base_url = ns.base_url.rstrip("/")
        if ns.serve is not None:
            base_url = stack.enter_context(
                launched_server(ns.serve, ns.serve_args, ns.serve_timeout))
        report = asyncio.run(benchmark(ns, base_url))
        if ns.output_json is not None:
            report["config"]["request_rate"] = str(ns.request_rate)  # JSON has no inf
            ns.output_json.write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
            print(f"wrote {ns.output_json}", file=sys.stderr)
    return 0 if report["failed_requests"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
