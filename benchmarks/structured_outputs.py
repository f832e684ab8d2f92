"""Structured outputs: a JSON-schema workload against the same requests unconstrained,
on one engine, and what compiling a schema and masking a step cost.

One `LLM` (random weights of a real config, `load_format="dummy"`) serves both arms:
the same prompts (random token ids), greedy decoding, the same `max_tokens`.
The unconstrained arm ignores EOS; the constrained arm's schema cannot be complete
within `max_tokens` (an array with `minItems` = max_tokens), so both arms generate
exactly max_tokens tokens and stop on length (checked): the constrained outputs are
valid JSON truncated at max_tokens, which is fine for timing. The model's outputs are
random tokens; under the grammar its mask forces them into the schema (compact JSON:
`disable_any_whitespace`, else a random model may emit whitespace until max_tokens).
Prefix caching is off so that every run computes the same prefills.

Measured, arms alternated in each of --rounds rounds (medians; each round's ratio is
printed too, so a noisy shared machine shows; the ratio column is the median of them):

- batch 1: time per output token (TPOT) and time to first token (issue target: the
  constrained TPOT within 5% of the unconstrained), each round running the arms in
  both orders (ABBA, --batch1-repeats times) and taking each arm's mean;
- --concurrent requests at once: output tokens/s over the whole `generate` (target:
  within 10%), the engine's steps per run and its mean step phases over them (the
  bitmask is filled in "schedule", applied to the logits in "forward", the sampled
  tokens are taken by the matchers in "update");
- both again in this process's CPU time (all threads): less sensitive than wall time
  to other processes on the machine, though OpenMP's spinning inflates it when a core
  is taken away;
- the grammar's own time per step, wall and thread CPU: its three per-step hooks
  (fill, apply, advance) are wrapped with timers at run time in the in-process engine
  (the library is not changed);
- compile through the engine: the wall time of a 1-token constrained `generate` minus
  that of the unconstrained one just before it, for the engine's first constrained
  request (loading the tokenizer and scanning its vocabulary too), a fresh schema (a
  property renamed: a cache miss) and the same schema again (cached), with the compile
  thread's own time;
- directly, on the model's tokenizer: `xgrammar.GrammarCompiler` compile times (first,
  fresh, cached), llguidance's matcher creation, the per-step mask fill
  (`GrammarMatcher.fill_next_token_bitmask`, llguidance's `fill_next_token_bitmask`)
  along a random walk through each schema for the model's vocabulary, and the apply
  (xgrammar's kernel, and the worker's `apply_grammar_bitmask` around it) on
  --concurrent rows of logits.

The engine runs in this process by default, with the worker's thread tuner off (its
one-thread trials would land in whichever arm runs first); --multiprocess gives LLM's
default engine (no hook times, the tuner on and warmed up first).

The tokenizer: structured outputs need a Hugging Face tokenizer of the model's
vocabulary in the model directory. The configs in benchmarks/configs/ have none (and
throughput.py's "t0", "t1", ... word-level one has no token a JSON document can use),
so a byte-level BPE tokenizer of the config's vocabulary size (SmolLM2: 49152, its
special tokens at SmolLM2's ids 0-2) is trained once on the Python standard library's
source (a few seconds) and cached with the config under ~/.cache/pagellm/bench.

Schemas (--schema, one or more, each run on the same engine):
  records  an array of records {id: integer 0-999999, name: 1-24 letters and spaces
           (a pattern), kind: one of four, score: integer 0-100, active: boolean}:
           the random model cycles through every state of the record (default)
  strings  an array of strings without bounds (the issue's "array of strings"): a
           random model almost never closes a string, so it stays in string content
Compile times are for a typical schema: an order record (nested object, array of
objects, enum, formats, pattern, nullable), as an API would send it.

    python benchmarks/structured_outputs.py
    python benchmarks/structured_outputs.py --backend guidance
    python benchmarks/structured_outputs.py --schema records strings --rounds 3

--profile also runs one constrained --concurrent batch under cProfile (in-process) and
prints the functions with the most own time and the grammar's and the step's parts.
Prints a table and, with --output-json, writes the numbers.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import functools
import hashlib
import io
import json
import os
import platform
import pstats
import random
import shutil
import statistics
import sys
import sysconfig
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import numpy as np
import torch

from pagellm import LLM, SamplingParams, StructuredOutputsParams

CACHE = Path(os.environ.get("PAGELLM_BENCH_CACHE", Path.home() / ".cache/pagellm/bench"))
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # SmolLM2's ids 0, 1, 2
DEFAULT_MODEL = str(Path(__file__).resolve().parent / "configs" / "smollm2-135m")

RECORD: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999999},
        # A pattern bounds it (the engine refuses minLength/maxLength for xgrammar).
        "name": {"type": "string", "pattern": "^[A-Za-z][A-Za-z ]{0,23}$"},
        "kind": {"enum": ["book", "film", "song", "game"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 100},
        "active": {"type": "boolean"},
    },
    "required": ["id", "name", "kind", "score", "active"],
}
TYPICAL: dict[str, Any] = {
    "title": "Order",
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
        "customer": {
            "type": "object",
            "properties": {"name": {"type": "string"},
                           "email": {"type": "string", "format": "email"},
                           "phone": {"type": ["string", "null"]}},
            "required": ["name", "email"]},
        "items": {
            "type": "array", "minItems": 1,
            "items": {"type": "object",
                      "properties": {"sku": {"type": "string"},
                                     "quantity": {"type": "integer", "minimum": 1,
                                                  "maximum": 100},
                                     "price": {"type": "number", "minimum": 0}},
                      "required": ["sku", "quantity", "price"]}},
        "status": {"enum": ["pending", "paid", "shipped", "delivered", "cancelled"]},
        "gift": {"type": "boolean"},
        "created_at": {"type": "string", "format": "date-time"},
    },
    "required": ["order_id", "customer", "items", "status", "created_at"],
}


def workload_schema(name: str, min_items: int) -> dict[str, Any]:
    """A schema whose documents need more than `min_items` - 1 tokens (every item is
    at least one token), so a request with max_tokens <= min_items stops on length."""
    items = RECORD if name == "records" else {"type": "string"}
    return {"type": "object",
            "properties": {name: {"type": "array", "items": items, "minItems": min_items}},
            "required": [name]}


def typical_variant(k: int) -> dict[str, Any]:
    """The typical schema with one property renamed: a different grammar, a cache miss."""
    if k == 0:
        return TYPICAL
    schema = copy.deepcopy(TYPICAL)
    schema["properties"][f"order_id_{k}"] = schema["properties"].pop("order_id")
    schema["required"] = [f"order_id_{k}" if r == "order_id" else r
                          for r in schema["required"]]
    return schema


# --------------------------------------------------------------------------- model


def model_dir(config_dir: str) -> Path:
    """The config with a byte-level BPE tokenizer of its vocabulary size (see the
    docstring), built once and cached (by config and Python version: the corpus is this
    Python's standard library)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoConfig, PreTrainedTokenizerFast

    config_text = (Path(config_dir) / "config.json").read_text()
    version = f"py{sys.version_info.major}{sys.version_info.minor}"
    key = hashlib.sha256(f"{config_text}{version}bpe-v1".encode()).hexdigest()[:12]
    out = CACHE / f"{Path(config_dir).name}-bpe-{version}-{key}"
    if (out / "tokenizer.json").exists():
        return out
    config = AutoConfig.from_pretrained(config_dir)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.rglob("*.py")
                   if not {"site-packages", "test", "tests"} & set(p.parts))

    def corpus() -> Any:
        for path in files:
            try:
                yield path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(corpus(), trainer=trainers.BpeTrainer(
        vocab_size=config.vocab_size, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    eos = config.eos_token_id[0] if isinstance(config.eos_token_id, list) \
        else config.eos_token_id
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(config_dir) / "config.json", tmp / "config.json")
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token=SPECIAL_TOKENS[0],
        eos_token=SPECIAL_TOKENS[eos] if eos is not None and eos < 3 else SPECIAL_TOKENS[0],
    ).save_pretrained(tmp)
    try:
        tmp.rename(out)
    except OSError:  # another run made it first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


# --------------------------------------------------------------------------- engine


def params(max_tokens: int, schema: dict[str, Any] | None) -> SamplingParams:
    if schema is None:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return SamplingParams(temperature=0.0, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(
                              json=schema, disable_any_whitespace=True))


class GrammarClock:
    """Time spent in the grammar's three per-step hooks of an in-process engine,
    wrapped at run time (the library is not changed): filling the bitmask (engine core,
    `StructuredOutputManager.bitmask`), applying it to the logits (worker,
    `apply_grammar_bitmask`), the matchers taking the sampled tokens
    (`RequestGrammar.advance`); and each grammar compile (compile thread)."""

    HOOKS = ("fill", "apply", "advance")
    KEYS = (*HOOKS, "cpu")  # cpu: the hooks' thread CPU time (no time preempted)

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(self.KEYS, 0.0)
        self.compiles: list[float] = []
        self._restore: list[Callable[[], None]] = []

    def install(self) -> None:
        from pagellm.enginecore.structured_output import manager
        from pagellm.executor.worker import model_runner

        def wrap(owner: Any, name: str, key: str | None) -> None:
            original = getattr(owner, name)
            clock = self

            def timed_call(*args: Any, **kwargs: Any) -> Any:
                t, cpu = time.perf_counter(), time.thread_time()
                try:
                    return original(*args, **kwargs)
                finally:
                    dt = time.perf_counter() - t
                    if key is None:
                        clock.compiles.append(dt)
                    else:
                        clock.seconds[key] += dt
                        clock.seconds["cpu"] += time.thread_time() - cpu

            setattr(owner, name, timed_call)
            self._restore.append(lambda: setattr(owner, name, original))

        wrap(manager.StructuredOutputManager, "bitmask", "fill")
        wrap(model_runner, "apply_grammar_bitmask", "apply")
        wrap(manager.RequestGrammar, "advance", "advance")
        wrap(manager.StructuredOutputManager, "_compile", None)

    def uninstall(self) -> None:
        while self._restore:
            self._restore.pop()()

    def take(self) -> dict[str, float]:
        taken, self.seconds = self.seconds, dict.fromkeys(self.KEYS, 0.0)
        return taken


class Engine:
    """One LLM for both arms; in-process by default, with the worker's thread tuner
    off (its 1-thread trials would land in whichever arm runs first) and the grammar
    hooks timed."""

    def __init__(self, ns: argparse.Namespace, model: Path) -> None:
        self.llm = LLM(str(model), multiprocess=ns.multiprocess, **engine_kwargs(ns))
        self.core: Any = None if ns.multiprocess else self.llm.engine_core.core  # type: ignore
        self.clock: GrammarClock | None = None
        if self.core is not None:
            self.core.executor.worker.model_runner.thread_tuner = None
            self.clock = GrammarClock()
            self.clock.install()

    def close(self) -> None:
        if self.clock is not None:
            self.clock.uninstall()
        self.llm.shutdown()

    def run(self, prompts: list[list[int]], sp: SamplingParams) -> dict[str, Any]:
        steps0 = self.core.num_steps if self.core is not None else 0
        if self.clock is not None:
            self.clock.take()
        start, cpu = time.perf_counter(), time.process_time()
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp,
                                    use_tqdm=False)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        for o in outputs:  # same work in both arms: every request stops on length
            c = o.outputs[0]
            if len(c.token_ids) != sp.max_tokens or c.finish_reason != "length":
                raise RuntimeError(f"request {o.request_id} made {len(c.token_ids)} of "
                                   f"{sp.max_tokens} tokens ({c.finish_reason}): the arms "
                                   f"would not compare")
        # This process's CPU time (all threads; an in-process engine's work): unlike the
        # wall time, it does not grow with what other processes take from the cores.
        out: dict[str, Any] = {"seconds": seconds, "cpu_s": cpu, "outputs": outputs}
        if self.core is not None and self.clock is not None:
            out["steps"] = self.core.num_steps - steps0
            out["grammar_s"] = self.clock.take()
        return out


def engine_kwargs(ns: argparse.Namespace) -> dict[str, Any]:
    return {"load_format": "dummy", "dtype": ns.dtype, "max_model_len": 2048,
            "max_num_seqs": max(ns.concurrent, 1), "enable_prefix_caching": False,
            "kv_cache_memory_bytes": ns.kv_cache_bytes, "seed": 0,
            "structured_outputs_config": {"backend": ns.backend}}


def batch1(engine: Engine, prompt: list[int], sp: SamplingParams) -> dict[str, Any]:
    r = engine.run([prompt], sp)
    out = r["outputs"][0]
    m = out.metrics
    n = len(out.outputs[0].token_ids)  # sp.max_tokens: run() checked
    tpot = (m.last_token_ts - m.first_token_ts) / (n - 1)
    row = {"tpot_ms": tpot * 1e3, "ttft_ms": m.first_token_latency * 1e3,
           "seconds": r["seconds"], "cpu_ms_per_token": r["cpu_s"] / n * 1e3,
           "text": out.outputs[0].text}
    if "grammar_s" in r:  # per step of the run (one token each after the prefill)
        row["steps"] = r["steps"]
        row["grammar_ms_per_step"] = {k: v / r["steps"] * 1e3
                                      for k, v in r["grammar_s"].items()}
    return row


def mean_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The mean of a few runs' numbers (nested dicts too); other values from the first."""
    row: dict[str, Any] = {}
    for key, value in runs[0].items():
        if isinstance(value, dict):
            row[key] = mean_row([r[key] for r in runs])
        elif isinstance(value, (int, float)):
            row[key] = statistics.fmean(r[key] for r in runs)
        else:
            row[key] = value
    return row


PHASES = ("schedule_s", "prepare_inputs_s", "forward_s", "sample_s", "update_s")


def concurrent(engine: Engine, prompts: list[list[int]], sp: SamplingParams
               ) -> dict[str, Any]:
    r = engine.run(prompts, sp)
    if engine.core is not None:  # the mean over this run's steps
        from pagellm.enginecore.core import mean_timings

        timings = mean_timings(deque(list(engine.core.recent_steps)[-r["steps"]:]))
    else:  # the engine's mean over its last 64 steps (earlier runs' too)
        timings = engine.llm.get_stats().step_timings
    tokens = sum(len(o.outputs[0].token_ids) for o in r["outputs"])
    row = {"tok_s": tokens / r["seconds"], "seconds": r["seconds"],
           "tok_per_cpu_s": tokens / r["cpu_s"],
           "step_ms": {p: getattr(timings, p) * 1e3 for p in PHASES}}
    if "grammar_s" in r:
        row["steps"] = r["steps"]
        row["step_wall_ms"] = r["seconds"] / r["steps"] * 1e3
        row["grammar_ms_per_step"] = {k: v / r["steps"] * 1e3
                                      for k, v in r["grammar_s"].items()}
    return row


def engine_compile(engine: Engine, prompt: list[int], rounds: int) -> dict[str, Any]:
    """Compile through the engine: a 1-token generate, constrained minus the
    unconstrained one run just before it (each pair's difference, then medians): the
    engine's first constrained request (the typical schema), fresh schemas, the same
    schemas again. With an in-process engine, also the compile thread's own time."""

    def pair(schema: dict[str, Any]) -> tuple[float, float]:
        base = engine.run([prompt], params(1, None))["seconds"]
        return base, engine.run([prompt], params(1, schema))["seconds"] - base

    compiles = engine.clock.compiles if engine.clock is not None else []
    base, first = pair(TYPICAL)
    first_compile = compiles[-1] if compiles else None
    bases: list[float] = [base]
    fresh: list[float] = []
    cached: list[float] = []
    fresh_compile: list[float] = []
    cached_compile: list[float] = []
    for k in range(1, rounds + 1):
        schema = typical_variant(k)
        for into, into_compile in ((fresh, fresh_compile), (cached, cached_compile)):
            n = len(compiles)
            b, d = pair(schema)
            bases.append(b)
            into.append(d)
            into_compile.extend(compiles[n:])
    ms = lambda xs: [x * 1e3 for x in xs]  # noqa: E731
    out = {"unconstrained_ms": statistics.median(bases) * 1e3,
           "unconstrained_runs_ms": ms(bases), "first_ms": first * 1e3,
           "fresh_ms": statistics.median(fresh) * 1e3, "fresh_runs_ms": ms(fresh),
           "cached_ms": statistics.median(cached) * 1e3, "cached_runs_ms": ms(cached)}
    if first_compile is not None:
        out["thread"] = {"first_ms": first_compile * 1e3,
                         "fresh_ms": statistics.median(fresh_compile) * 1e3,
                         "cached_ms": statistics.median(cached_compile) * 1e3}
    return out


def measure_engine(ns: argparse.Namespace, model: Path, vocab: int) -> dict[str, Any]:
    rng = random.Random(0)
    prompts = [[rng.randrange(16, vocab) for _ in range(ns.prompt_len)]
               for _ in range(ns.concurrent)]
    results: dict[str, Any] = {"schemas": {}}
    engine = Engine(ns, model)
    try:
        # Warm-up, unconstrained only: the compile section needs the engine's first
        # constrained request to be the typical schema's. A multiprocess engine's
        # thread tuner runs its trials (24 steps of each size) here.
        warm = 30 if ns.multiprocess else 4
        engine.run(prompts, params(warm, None))
        engine.run(prompts[:1], params(warm, None))
        results["compile"] = engine_compile(engine, prompts[0][:4], ns.rounds)
        for name in ns.schema:
            schema = workload_schema(name, max(ns.batch1_tokens, ns.concurrent_tokens))
            engine.run(prompts, params(4, schema))  # compiled once, cached from here on
            rows: dict[str, list[Any]] = {"b1_u": [], "b1_c": [], "cc_u": [], "cc_c": []}
            for r in range(ns.rounds):
                arms = [("u", None), ("c", schema)]
                order = arms if r % 2 == 0 else arms[::-1]
                # Batch 1 is cheap: both orders (ABBA), --batch1-repeats times a round,
                # each arm's mean (a single pair's ratio varies by +-10% here).
                b1: dict[str, list[dict[str, Any]]] = {"u": [], "c": []}
                for arm, s in (order + order[::-1]) * ns.batch1_repeats:
                    b1[arm].append(batch1(engine, prompts[0], params(ns.batch1_tokens, s)))
                for arm, runs in b1.items():
                    rows[f"b1_{arm}"].append(mean_row(runs))
                for arm, s in order:
                    rows[f"cc_{arm}"].append(concurrent(engine, prompts,
                                                        params(ns.concurrent_tokens, s)))
                print(f"  [{name} round {r + 1}] batch 1 TPOT "
                      f"{rows['b1_u'][-1]['tpot_ms']:.2f} / {rows['b1_c'][-1]['tpot_ms']:.2f}"
                      f" ms, {ns.concurrent} requests {rows['cc_u'][-1]['tok_s']:.1f} / "
                      f"{rows['cc_c'][-1]['tok_s']:.1f} tok/s (unconstrained / constrained)",
                      flush=True)
            results["schemas"][name] = rows
    finally:
        engine.close()
    return results


# --------------------------------------------------------------------------- direct


def walk(fill: Callable[[], object], bitmask: torch.Tensor, accept: Callable[[int], bool],
         done: Callable[[], bool], reset: Callable[[], None], steps: int, vocab: int,
         seed: int = 0) -> list[float]:
    """Fill one mask, take a uniformly random allowed token, `steps` times (restarting a
    completed document); the fill times in seconds."""
    rng = np.random.default_rng(seed)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        fill()
        times.append(time.perf_counter() - t)
        bits = np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")[:vocab]
        allowed = np.flatnonzero(bits)
        if len(allowed) == 0 or done():
            reset()
            continue
        if not accept(int(rng.choice(allowed))):
            raise RuntimeError("the matcher refused a token its mask allowed")
        if done():
            reset()
    return times


def fill_stats(times: list[float]) -> dict[str, float]:
    us = np.array(times) * 1e6
    return {"mean_us": float(us.mean()), "median_us": float(np.median(us)),
            "p90_us": float(np.percentile(us, 90)), "max_us": float(us.max())}


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t = time.perf_counter()
    value = fn()
    return time.perf_counter() - t, value


def measure_direct(ns: argparse.Namespace, model: Path) -> dict[str, Any]:
    import xgrammar as xgr
    from transformers import AutoConfig, AutoTokenizer

    vocab = AutoConfig.from_pretrained(model).vocab_size
    load_s, tokenizer = timed(lambda: AutoTokenizer.from_pretrained(model))
    threads = max(1, min(4, (os.cpu_count() or 2) // 2))  # the engine's compile threads
    out: dict[str, Any] = {"vocab_size": vocab, "tokenizer_tokens": len(tokenizer),
                           "tokenizer_load_s": load_s}
    schemas = {"typical": TYPICAL} | {
        name: workload_schema(name, max(ns.batch1_tokens, ns.concurrent_tokens))
        for name in ns.schema}

    # xgrammar
    info_s, info = timed(lambda: xgr.TokenizerInfo.from_huggingface(tokenizer,
                                                                    vocab_size=vocab))
    compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=True)
    xg: dict[str, Any] = {"tokenizer_info_s": info_s, "compile_ms": {}, "fill": {}}

    def compile_xg(schema: dict[str, Any]) -> tuple[float, Any]:
        return timed(lambda: compiler.compile_json_schema(json.dumps(schema),
                                                          any_whitespace=False))

    first_s, _ = compile_xg(TYPICAL)
    cached_s, _ = compile_xg(TYPICAL)
    fresh = [compile_xg(typical_variant(100 + k))[0] for k in range(max(3, ns.rounds))]
    xg["compile_ms"]["typical"] = {"first": first_s * 1e3, "cached": cached_s * 1e3,
                                   "fresh": statistics.median(fresh) * 1e3}
    for name, schema in schemas.items():
        c_s, compiled = compile_xg(schema)
        if name != "typical":
            xg["compile_ms"][name] = {"first": c_s * 1e3,
                                      "cached": compile_xg(schema)[0] * 1e3}
        matcher = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, vocab)
        xg["fill"][name] = fill_stats(walk(
            functools.partial(matcher.fill_next_token_bitmask, bitmask, 0), bitmask,
            matcher.accept_token, matcher.is_terminated, matcher.reset, ns.walk_steps,
            vocab))
    logits = torch.randn(ns.concurrent, vocab, dtype=getattr(torch, ns.dtype))
    full = torch.full((ns.concurrent, -(-vocab // 32)), -1, dtype=torch.int32)
    full[:, ::3] = 0x55555555
    apply = []
    for _ in range(20):
        t = time.perf_counter()
        xgr.apply_token_bitmask_inplace(logits, full, indices=list(range(ns.concurrent)),
                                        vocab_size=vocab)
        apply.append(time.perf_counter() - t)
    xg["apply_ms"] = statistics.median(apply) * 1e3
    # The engine's whole apply step (the worker unpacks the rows the engine core sent,
    # builds a [S, W] bitmask, then runs the kernel above).
    from pagellm.executor.worker.grammar_mask import apply_grammar_bitmask
    from pagellm.protocol.scheduling import GrammarOutput

    sent = GrammarOutput([f"r{i}" for i in range(ns.concurrent)], full.numpy().tobytes())
    row_of = {f"r{i}": i for i in range(ns.concurrent)}
    engine_apply = []
    for _ in range(20):
        t = time.perf_counter()
        apply_grammar_bitmask(logits, sent, row_of)
        engine_apply.append(time.perf_counter() - t)
    xg["engine_apply_ms"] = statistics.median(engine_apply) * 1e3
    out["xgrammar"] = xg

    # llguidance
    import llguidance.hf
    import llguidance.torch
    from llguidance import LLMatcher

    llg_s, llg_tok = timed(lambda: llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab))
    lg: dict[str, Any] = {"tokenizer_s": llg_s, "matcher_ms": {}, "fill": {}}
    for name, schema in schemas.items():
        grammar = LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults={"whitespace_flexible": False})
        make = functools.partial(LLMatcher, llg_tok, grammar, log_level=0)
        first_s, matcher = timed(make)
        again_s, _ = timed(make)
        lg["matcher_ms"][name] = {"first": first_s * 1e3, "again": again_s * 1e3}
        bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)
        def consume(token: int, m: Any = matcher) -> bool:
            return bool(m.consume_token(token)) and not m.is_error()

        lg["fill"][name] = fill_stats(walk(
            functools.partial(llguidance.torch.fill_next_token_bitmask, matcher, bitmask, 0),
            bitmask, consume, matcher.is_stopped, matcher.reset, ns.walk_steps, vocab))
    out["guidance"] = lg
    return out


# --------------------------------------------------------------------------- profile


def profile(ns: argparse.Namespace, model: Path, vocab: int) -> str:
    """One constrained --concurrent batch (the first schema) in an in-process engine
    under cProfile, after an unprofiled warm-up: the functions with the most own time,
    then the grammar's hooks and the step's parts by cumulative time."""
    rng = random.Random(1)
    prompts = [[rng.randrange(16, vocab) for _ in range(ns.prompt_len)]
               for _ in range(ns.concurrent)]
    schema = workload_schema(ns.schema[0], max(ns.batch1_tokens, ns.concurrent_tokens))
    engine = Engine(argparse.Namespace(**{**vars(ns), "multiprocess": False}), model)
    try:
        engine.run(prompts, params(4, schema))
        prof = cProfile.Profile()
        prof.enable()
        seconds = engine.run(prompts, params(ns.concurrent_tokens, schema))["seconds"]
        prof.disable()
    finally:
        engine.close()
    text = io.StringIO()
    text.write(f"cProfile, in-process engine, {ns.concurrent} constrained requests x "
               f"{ns.concurrent_tokens} tokens, schema {ns.schema[0]}: {seconds:.2f} s\n")
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(15)
    stats.sort_stats("cumulative").print_stats(
        r"(timed_call|fill_next_token|apply_token_bitmask|accept_token|_execute|schedule"
        r"|update_from_output|process_outputs|forward|sampler)")
    return text.getvalue()


# --------------------------------------------------------------------------- main


def median(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def ratios(us: list[dict[str, Any]], cs: list[dict[str, Any]], key: str) -> list[float]:
    return [c[key] / u[key] for u, c in zip(us, cs, strict=True)]


def grammar_ms(rows: list[dict[str, Any]]) -> dict[str, float] | None:
    """Median per step of each grammar hook over the constrained runs."""
    if not rows or "grammar_ms_per_step" not in rows[0]:
        return None
    return {k: statistics.median(r["grammar_ms_per_step"][k] for r in rows)
            for k in GrammarClock.KEYS}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="a config directory (benchmarks/configs/...): random weights")
    parser.add_argument("--backend", default="xgrammar",
                        choices=("xgrammar", "guidance", "auto"))
    parser.add_argument("--schema", nargs="+", default=["records"],
                        choices=("records", "strings"))
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--batch1-tokens", type=int, default=32)
    parser.add_argument("--batch1-repeats", type=int, default=2,
                        help="ABBA blocks of batch-1 runs per round")
    parser.add_argument("--concurrent", type=int, default=64)
    parser.add_argument("--concurrent-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--walk-steps", type=int, default=300,
                        help="mask fills timed per schema in the direct measurements")
    parser.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    parser.add_argument("--multiprocess", action="store_true",
                        help="the engine core in its own process (LLM's default): no "
                             "grammar hook times, the thread tuner on")
    parser.add_argument("--no-direct", action="store_true",
                        help="skip the direct xgrammar / llguidance measurements")
    parser.add_argument("--profile", action="store_true",
                        help="also profile one constrained batch (cProfile, in-process)")
    parser.add_argument("--output-json", type=Path, default=None)
    ns = parser.parse_args(argv)
    if ns.batch1_tokens < 2:
        parser.error("--batch1-tokens must be at least 2 (a time per output token)")

    from transformers import AutoConfig

    t0 = time.perf_counter()
    model = model_dir(ns.model)
    vocab = AutoConfig.from_pretrained(model).vocab_size
    threads = torch.get_num_threads()
    print(f"model {ns.model} (random weights, {ns.dtype}; tokenizer {model}), backend "
          f"{ns.backend}, {threads} threads, {ns.rounds} rounds, engine "
          f"{'in its own process' if ns.multiprocess else 'in-process'}", flush=True)
    load = [os.getloadavg()[0]]
    engine = measure_engine(ns, model, vocab)
    load.append(os.getloadavg()[0])
    direct = None if ns.no_direct else measure_direct(ns, model)
    prof = profile(ns, model, vocab) if ns.profile else None

    w = max(20, 6 * ns.rounds)  # the per-round column
    print(f"\n{'':<46}{'unconstr.':>10}{'constr.':>10}{'ratio':>8}  {'per round':<{w}}"
          f"target")
    summary: dict[str, Any] = {}
    for name, rows in engine["schemas"].items():
        b1u, b1c = median(rows["b1_u"], "tpot_ms"), median(rows["b1_c"], "tpot_ms")
        ccu, ccc = median(rows["cc_u"], "tok_s"), median(rows["cc_c"], "tok_s")
        per_b1 = ratios(rows["b1_u"], rows["b1_c"], "tpot_ms")
        per_cc = ratios(rows["cc_u"], rows["cc_c"], "tok_s")
        r_b1, r_cc = statistics.median(per_b1), statistics.median(per_cc)
        ok_b1, ok_cc = r_b1 <= 1.05, r_cc >= 0.90
        fmt = lambda xs: " ".join(f"{x:.3f}" for x in xs)  # noqa: E731
        summary[name] = {"tpot_ratio": r_b1, "throughput_ratio": r_cc,
                         "batch1_met": ok_b1, "concurrent_met": ok_cc}
        print(f"[{name}] batch 1 TPOT, ms/token ({ns.batch1_tokens} tokens)"
              f"{'':<9}{b1u:>10.1f}{b1c:>10.1f}{r_b1:>8.3f}  {fmt(per_b1):<{w}}"
              f"<= 1.05: {'met' if ok_b1 else 'MISSED'}")
        print(f"[{name}] batch 1 TTFT, ms{'':<27}{median(rows['b1_u'], 'ttft_ms'):>10.1f}"
              f"{median(rows['b1_c'], 'ttft_ms'):>10.1f}")
        print(f"[{name}] {ns.concurrent} requests x {ns.concurrent_tokens} tokens, out tok/s"
              f"{'':<3}{ccu:>10.1f}{ccc:>10.1f}{r_cc:>8.3f}  {fmt(per_cc):<{w}}"
              f">= 0.90: {'met' if ok_cc else 'MISSED'}")
        if not ns.multiprocess:
            cpu_b1 = ratios(rows["b1_u"], rows["b1_c"], "cpu_ms_per_token")
            cpu_cc = ratios(rows["cc_u"], rows["cc_c"], "tok_per_cpu_s")
            print(f"[{name}] batch 1 CPU ms per output token (all threads){'':<3}"
                  f"{median(rows['b1_u'], 'cpu_ms_per_token'):>10.1f}"
                  f"{median(rows['b1_c'], 'cpu_ms_per_token'):>10.1f}"
                  f"{statistics.median(cpu_b1):>8.3f}  {fmt(cpu_b1)}")
            print(f"[{name}] {ns.concurrent} requests, output tokens per CPU second{'':<1}"
                  f"{median(rows['cc_u'], 'tok_per_cpu_s'):>10.1f}"
                  f"{median(rows['cc_c'], 'tok_per_cpu_s'):>10.1f}"
                  f"{statistics.median(cpu_cc):>8.3f}  {fmt(cpu_cc)}")
            summary[name] |= {"cpu_tpot_ratio": statistics.median(cpu_b1),
                              "cpu_throughput_ratio": statistics.median(cpu_cc)}
        if "steps" in rows["cc_u"][0]:
            print(f"[{name}] engine steps per {ns.concurrent}-request run{'':<14}"
                  f"{median(rows['cc_u'], 'steps'):>10.0f}{median(rows['cc_c'], 'steps'):>10.0f}")
        for phase in PHASES:
            u = statistics.median(r["step_ms"][phase] for r in rows["cc_u"])
            c = statistics.median(r["step_ms"][phase] for r in rows["cc_c"])
            over = "last 64 steps" if ns.multiprocess else "the run's"
            print(f"[{name}]   step {phase[:-2]:<16}ms, mean of {over:<14}{u:>10.2f}"
                  f"{c:>10.2f}{c - u:>+8.2f}")
        for label, key, step_key in (("batch 1", "b1_c", "tpot_ms"),
                                     (f"{ns.concurrent} requests", "cc_c", "step_wall_ms")):
            g = grammar_ms(rows[key])
            if g is None:
                continue
            step = median(rows[key], step_key)
            total = sum(g[k] for k in GrammarClock.HOOKS)
            summary[name][f"grammar_share_{key}"] = total / step
            print(f"[{name}] grammar per step, {label}: fill {g['fill']:.3f} + apply "
                  f"{g['apply']:.3f} + advance {g['advance']:.3f} = {total:.3f} ms "
                  f"({g['cpu']:.3f} ms thread CPU) of a {step:.1f} ms step "
                  f"({total / step:.1%})")
        print(f"[{name}] a constrained output: {rows['b1_c'][0]['text'][:100]!r}")
    c = engine["compile"]
    runs = lambda xs: ", ".join(f"{x:.1f}" for x in xs)  # noqa: E731
    print(f"\ncompile through the engine, typical schema: 1-token generate minus the "
          f"unconstrained one before it ({c['unconstrained_ms']:.1f} ms, median; "
          f"{runs(c['unconstrained_runs_ms'])})")
    print(f"  first constrained request (tokenizer, vocabulary scan, compile) "
          f"{c['first_ms']:.1f} ms; fresh schema {c['fresh_ms']:.1f} ms "
          f"({runs(c['fresh_runs_ms'])}); same schema again {c['cached_ms']:.1f} ms "
          f"({runs(c['cached_runs_ms'])})")
    if "thread" in c:
        t = c["thread"]
        print(f"  the compile thread's own time: first {t['first_ms']:.1f} ms, fresh "
              f"{t['fresh_ms']:.2f} ms, cached {t['cached_ms']:.3f} ms")
    if direct is not None:
        xg, lg = direct["xgrammar"], direct["guidance"]
        print(f"\ndirect, vocabulary {direct['vocab_size']} ({direct['tokenizer_tokens']} "
              f"tokenizer tokens), tokenizer load {direct['tokenizer_load_s'] * 1e3:.0f} ms:")
        print(f"  xgrammar TokenizerInfo {xg['tokenizer_info_s'] * 1e3:.0f} ms; "
              f"llguidance tokenizer {lg['tokenizer_s'] * 1e3:.0f} ms")
        for name, ms in xg["compile_ms"].items():
            fresh = f", fresh {ms['fresh']:.1f} ms" if "fresh" in ms else ""
            print(f"  xgrammar compile {name:<8} first {ms['first']:.1f} ms{fresh}, cached "
                  f"{ms['cached']:.3f} ms")
        for name, ms in lg["matcher_ms"].items():
            print(f"  llguidance LLMatcher {name:<8} first {ms['first']:.1f} ms, again "
                  f"{ms['again']:.1f} ms")
        print(f"  mask fill per step, us ({ns.walk_steps} steps, random walk):"
              f"{'':<9}{'mean':>8}{'median':>8}{'p90':>8}{'max':>8}")
        for lib, d in (("xgrammar", xg), ("llguidance", lg)):
            for name, f in d["fill"].items():
                print(f"    {lib:<11}{name:<43}{f['mean_us']:>8.0f}{f['median_us']:>8.0f}"
                      f"{f['p90_us']:>8.0f}{f['max_us']:>8.0f}")
        print(f"  apply to {ns.concurrent} x {direct['vocab_size']} {ns.dtype} logits: "
              f"xgrammar's apply_token_bitmask_inplace {xg['apply_ms']:.2f} ms, the "
              f"worker's apply_grammar_bitmask (with it) {xg['engine_apply_ms']:.2f} ms")
    if prof is not None:
        print("\n" + prof)
    print(f"load average (1 min) before / after the engine runs: {load[0]:.2f} / "
          f"{load[1]:.2f} on {os.cpu_count()} CPUs; total {time.perf_counter() - t0:.0f} s")
    for rows in engine["schemas"].values():
        for row in rows["b1_c"] + rows["b1_u"]:
            row.pop("text", None)
    results = {"benchmark": "structured_outputs", "date": time.strftime("%Y-%m-%d"),
               "machine": platform.platform(), "threads": threads, "args": {
                   k: str(v) if isinstance(v, Path) else v for k, v in vars(ns).items()},
               "load_average": load, "summary": summary, "engine": engine,
               "direct": direct, "profile": prof}
    if ns.output_json:
        ns.output_json.write_text(json.dumps(results, indent=2, default=str))
    return results


if __name__ == "__main__":
    main()
