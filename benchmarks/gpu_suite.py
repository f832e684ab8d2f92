"""The whole GPU benchmark suite in one command, one JSON file.

    python benchmarks/gpu_suite.py --output-json gpu_results.json
    python benchmarks/gpu_suite.py --parts kernel decode --output-json a.json   # a subset
    python benchmarks/gpu_suite.py --merge a.json b.json --output-json gpu_results.json
    python benchmarks/gpu_suite.py --smoke --output-json smoke.json             # CPU check

Parts (names for --parts; a kind such as `decode` selects all of its parts):

    tests                        the tests that need a GPU or compile the kernels for it
                                 (pytest: TEST_FILES), their counts and failures
    kernel                       kernel_bench.py's full grid: decode paged attention's
                                 bandwidth against copy bandwidth and torch SDPA
    fused                        fused_bench.py: the decoder's fused kernels against the
                                 torch ops they replace, GPU time per call in a graph
    decode-<model>[-eager]       decode_roofline.py: batch-1 decode against the memory
                                 roofline, with CUDA graphs and with --enforce-eager
    throughput-<model>           throughput.py's workload: 256 requests, prompt and output
                                 lengths uniform in 100..1024, ignore_eos, dummy bf16
                                 weights, pagellm against transformers' generate (batches
                                 of 64, on the GPU) in the same run

for the models of benchmarks/configs (qwen2.5-0.5b, qwen2.5-1.5b). Every part runs in a
fresh subprocess, so each starts with the GPU's memory free and a crash or a hang (killed
after --part-timeout) costs only that part; the JSON is rewritten after every part, so a
command killed from outside keeps what finished. Each part's entry holds its own results
(with date, device and versions), the command that ran it, its exit status, its seconds
and, when it failed, the tail of its output.

Times on the H200 (2026-11-26/27, first-run Triton compiles included): tests 100-136 s,
kernel 12-19 s, fused 6 s, decode 39-44 s with CUDA graphs and 61 s eager (Qwen2.5-1.5B),
throughput 179 s (Qwen2.5-0.5B, mostly transformers). The whole
suite is over 10 minutes, more than one device command may take and most of a session's
15 minutes of device time, so `--deadline` bounds the command: each part is cut at what
is left of it, and parts with under MIN_PART_S left are skipped (and say so), so the
command always ends in time with the JSON of what finished. docs/benchmarks-log.md,
"The next GPU session", has the session's plan (which parts, in which order).

--smoke runs every part in its CPU form (kernel_bench and decode_roofline --smoke; the
throughput parts on the demo model with a handful of tiny requests): numbers are
meaningless, the wiring is proven.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benchmark scripts
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import decode_roofline
import fused_bench
import kernel_bench
import torch
from throughput import make_workload, run_pagellm, run_transformers

from pagellm.demo.model import resolve_model
from pagellm.protocol.engine_args import EngineArgs

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MODELS = {"qwen2.5-0.5b": HERE / "configs" / "qwen2.5-0.5b",
          "qwen2.5-1.5b": HERE / "configs" / "qwen2.5-1.5b"}
KINDS = ("tests", "kernel", "fused", "decode", "throughput")
# The correctness checks a GPU session runs first: CUDA against transformers, the
# compiled kernels against their torch references, the CUDA step path, RL on CUDA.
TEST_FILES = ["tests/e2e/test_gpu.py", "tests/kernels/test_kernels_triton.py",
              "tests/executor/test_gpu_path.py", "tests/e2e/test_gpu_rl.py",
              "tests/kernels/test_kernels_reference.py", "tests/kernels/test_kernels_fused.py",
              "tests/kernels/test_triton_lora.py", "tests/kernels/test_triton_moe.py",
              "tests/kernels/test_triton_quant.py", "tests/e2e/test_quantization.py",
              "tests/kernels/test_fp8.py", "tests/e2e/test_quantized_checkpoints.py",
              "tests/weights/test_gguf.py"]
SMOKE_TEST_FILES = ["tests/e2e/test_gpu.py"]  # on the CPU: every case skips, the wiring runs
TEST_TIMEOUT_S = 120.0  # per test case (the slowest starts three engines)
MIN_PART_S = 30.0  # under this much of --deadline left, a part is skipped, not started


@dataclasses.dataclass(frozen=True)
class Part:
    name: str
    kind: str  # one of KINDS
    model: str | None = None  # a key of MODELS
    enforce_eager: bool = False


PARTS: list[Part] = [
    Part("tests", "tests"),
    Part("kernel", "kernel"),
    Part("fused", "fused"),
    *(Part(f"decode-{m}{'-eager' if eager else ''}", "decode", m, eager)
      for m in MODELS for eager in (False, True)),
    *(Part(f"throughput-{m}", "throughput", m) for m in MODELS),
]


@dataclasses.dataclass(frozen=True)
class ThroughputWorkload:
    model: str
    dtype: str
    device: str
    num_prompts: int
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    hf_batch_size: int
    num_warmup_prompts: int


def throughput_workload(model: str, smoke: bool) -> ThroughputWorkload:
    if smoke:
        return ThroughputWorkload("demo", "float32", "cpu", 4, (4, 16), (2, 8), 2, 2)
    # HF batch 64: large enough that transformers' per-step overhead is shared by many
    # requests, small enough that padding to each batch's longest request stays sane.
    return ThroughputWorkload(str(MODELS[model]), "bfloat16", "cuda", 256, (100, 1024),
                              (100, 1024), 64, 32)


# --------------------------------------------------------------------------- parts (child)


def throughput_part(model: str, smoke: bool) -> dict[str, Any]:
    from transformers import AutoConfig

    w = throughput_workload(model, smoke)
    args = resolve_model(EngineArgs(
        model=w.model, load_format="dummy", skip_tokenizer_init=True, dtype=w.dtype,
        device=w.device, max_model_len=w.input_len[1] + w.output_len[1], seed=0))
    vocab = AutoConfig.from_pretrained(args.model).get_text_config().vocab_size
    work = make_workload(w.num_prompts, w.input_len, w.output_len, vocab, seed=0)
    warmup = make_workload(w.num_warmup_prompts, w.input_len, w.output_len, vocab, seed=1)
    pagellm = run_pagellm(args, work, warmup)
    hf = run_transformers(args, work, w.hf_batch_size, getattr(torch, w.dtype), w.device)
    return {"benchmark": "throughput", **kernel_bench.environment(torch.device(w.device)),
            "smoke": smoke, "workload": dataclasses.asdict(w),
            "engine_args": dataclasses.asdict(args),
            "prompt_tokens": sum(len(p) for p, _ in work),
            "output_tokens": sum(n for _, n in work),
            "results": [pagellm.summary(), hf.summary()],
            "ratio_output_tokens_per_s": pagellm.output_tokens_per_s / hf.output_tokens_per_s}


def tests_part(smoke: bool, output: Path) -> int:
    """Run the GPU tests in a pytest of their own and write their counts and failures
    (from its JUnit XML) to `output`; pytest's exit status."""
    files = SMOKE_TEST_FILES if smoke else TEST_FILES
    junit = output.with_suffix(".xml")
    # A hung case fails alone after TEST_TIMEOUT_S (pytest-timeout), with its stacks.
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               f"--timeout={TEST_TIMEOUT_S:.0f}", f"--junitxml={junit}", *files]
    returncode = subprocess.call(command, cwd=ROOT)
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures: list[dict[str, str]] = []
    if junit.exists():
        for case in ElementTree.parse(junit).getroot().iter("testcase"):
            name = f"{case.get('classname')}::{case.get('name')}"
            problem = next((c for c in case if c.tag in ("failure", "error")), None)
            if problem is not None:
                counts["failed" if problem.tag == "failure" else "errors"] += 1
                failures.append({"test": name, "message": (problem.get("message") or "")[:2000]})
            elif case.find("skipped") is not None:
                counts["skipped"] += 1
            else:
                counts["passed"] += 1
    device = torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")
    output.write_text(json.dumps({
        "benchmark": "tests", **kernel_bench.environment(device), "smoke": smoke,
        "files": files, "returncode": returncode, **counts, "failures": failures},
        indent=2))
    return returncode


def run_part(part: Part, smoke: bool, output: Path) -> int:
    """Run one part in this process and write its results to `output`; the exit status
    for the part (non-zero: a test failed)."""
    smoke_flag = ["--smoke"] if smoke else []
    if part.kind == "tests":
        return tests_part(smoke, output)
    if part.kind == "kernel":
        kernel_bench.main([*smoke_flag, "--output-json", str(output)])
    elif part.kind == "fused":
        fused_bench.main([*smoke_flag, "--output-json", str(output)])
    elif part.kind == "decode":
        assert part.model is not None
        argv = smoke_flag if smoke else ["--model", str(MODELS[part.model])]
        if part.enforce_eager:
            argv = [*argv, "--enforce-eager"]
        decode_roofline.main([*argv, "--output-json", str(output)])
    else:
        assert part.model is not None
        results = throughput_part(part.model, smoke)
        output.write_text(json.dumps(results, indent=2))
    return 0


# --------------------------------------------------------------------------- suite (parent)


def run_in_subprocess(part: Part, smoke: bool, timeout_s: float) -> dict[str, Any]:
    """Run a part in a fresh interpreter, echoing its output; its entry in the suite's
    JSON. A part past timeout_s is killed with its whole process group (the tests
    part's pytest; an engine core would follow anyway: it watches its frontend)."""
    with tempfile.TemporaryDirectory(prefix="gpu-suite-") as tmp:
        output = Path(tmp) / "part.json"
        command = [sys.executable, str(Path(__file__).resolve()), "--run-part", part.name,
                   "--part-output", str(output), *(["--smoke"] if smoke else [])]
        tail: collections.deque[str] = collections.deque(maxlen=60)
        timed_out = threading.Event()
        start = time.perf_counter()
        proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)

        def kill_group() -> None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)

        def kill() -> None:
            timed_out.set()
            kill_group()

        timer = threading.Timer(timeout_s, kill)
        timer.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                sys.stdout.write(f"[{part.name}] {line}")
                sys.stdout.flush()
                tail.append(line)
            returncode = proc.wait()
        finally:
            timer.cancel()
            kill_group()  # whatever the part left running, too
            proc.wait()
        seconds = time.perf_counter() - start
        result = json.loads(output.read_text()) if output.exists() else None
    status = ("timeout" if timed_out.is_set() else "ok" if returncode == 0 else "failed")
    entry: dict[str, Any] = {"status": status, "returncode": returncode, "seconds": seconds,
                             "command": shlex.join(["python", "benchmarks/gpu_suite.py",
                                                    *command[2:4], *command[6:]]),
                             "result": result}
    if status != "ok":
        entry["output_tail"] = "".join(tail)
    return entry


def headline(entry: dict[str, Any]) -> str:
    """One line per part for the summary table."""
    r = entry.get("result")
    if r is None:
        return "no result"
    if r["benchmark"] == "tests":
        failed = "; ".join(f["test"] for f in r["failures"][:3])
        return (f"{r['passed']} passed, {r['failed']} failed, {r['errors']} errors, "
                f"{r['skipped']} skipped" + (f": {failed}" if failed else ""))
    if r["benchmark"] == "kernel_bench":
        rows = [c for c in r["cases"] if c["matches_reference"]]
        long = [c for c in rows if c["context"] >= 8192] or rows
        if not long:
            return f"0/{len(r['cases'])} cases match SDPA"
        # The target means full batches; small ones cannot fill the GPU with K/V reads.
        top = max(c["batch"] for c in long)
        at_top = [c["kernel_pct_of_copy"] for c in long if c["batch"] == top]
        worst = min(c["kernel_pct_of_copy"] for c in long)
        return (f"copy {r['copy_bandwidth_gbps']:.0f} GB/s; long contexts at batch {top}: "
                f"{min(at_top):.1f}-{max(at_top):.1f}% of copy (target "
                f"{r['target_pct_of_copy']:.0f}%), any batch >= {worst:.1f}%; "
                f"{len(rows)}/{len(r['cases'])} cases match SDPA")
    if r["benchmark"] == "decode_roofline":
        if r["decode_tokens_per_s"] is None:
            return "decode time below noise"
        return (f"{r['decode_tokens_per_s']:.1f} tok/s = {r['pct_of_roofline']:.1f}% of "
                f"roofline {r['roofline_tokens_per_s']:.1f} (target "
                f"{r['target_pct_of_roofline']:.0f}%)")
    if r["benchmark"] == "fused_bench":
        first = min(c["rows"] for c in r["cases"])
        return f"{first} row(s): " + ", ".join(
            f"{c['op']} {c['torch_us']:.1f} -> {c['fused_us']:.1f} us"
            for c in r["cases"] if c["rows"] == first)
    pagellm, hf = r["results"]
    return (f"pagellm {pagellm['output_tokens_per_s']:.0f} out tok/s, transformers "
            f"{hf['output_tokens_per_s']:.0f}: {r['ratio_output_tokens_per_s']:.2f}x")


def select_parts(names: list[str] | None, parser: argparse.ArgumentParser) -> list[Part]:
    if not names:
        return list(PARTS)
    known = {p.name for p in PARTS} | set(KINDS)
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"unknown part(s) {unknown}; known: {sorted(known)}")
    return [p for p in PARTS if p.name in names or p.kind in names]


def merge(paths: list[Path]) -> dict[str, Any]:
    """One suite JSON from several (later files win for a part run twice)."""
    merged: dict[str, Any] | None = None
    for path in paths:
        data = json.loads(path.read_text())
        if merged is None:
            merged = {**data, "parts": {}, "merged_from": []}
        merged["merged_from"].append({"file": str(path), "command": data.get("command"),
                                      "date": data.get("date")})
        merged["parts"].update(data["parts"])
    assert merged is not None
    return merged


def write(results: dict[str, Any], path: Path | None) -> None:
    if path is not None:
        path.write_text(json.dumps(results, indent=2))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the selected parts (or merge files, or run one part as the suite's child);
    return the suite's results, as written to --output-json."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-json", type=Path, default=None)
    parser.add_argument("--parts", nargs="+", default=None,
                        help=f"parts or kinds to run (default: all): "
                             f"{', '.join(p.name for p in PARTS)}")
    parser.add_argument("--smoke", action="store_true", help="every part in its CPU form")
    parser.add_argument("--part-timeout", type=float, default=540.0,
                        help="seconds before a part is killed (default: 540)")
    parser.add_argument("--deadline", type=float, default=None, metavar="S",
                        help="seconds for the whole command: each part is cut at what is "
                             f"left, and skipped with under {MIN_PART_S:.0f} s left")
    parser.add_argument("--merge", type=Path, nargs="+", default=None, metavar="JSON",
                        help="merge suite JSON files into --output-json; runs nothing")
    parser.add_argument("--run-part", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--part-output", type=Path, default=None, help=argparse.SUPPRESS)
    args = sys.argv[1:] if argv is None else argv
    ns = parser.parse_args(args)
    if ns.run_part is not None:
        sys.exit(run_part(next(p for p in PARTS if p.name == ns.run_part), ns.smoke,
                          ns.part_output))
    if ns.merge:
        merged = merge(ns.merge)
        write(merged, ns.output_json)
        return merged

    results: dict[str, Any] = {
        "benchmark": "gpu_suite", "smoke": ns.smoke,
        "command": shlex.join(["python", "benchmarks/gpu_suite.py", *args]),
        # The device is named at the end: this process keeps off the GPU while parts run.
        **kernel_bench.environment(torch.device("cpu")), "device": None, "parts": {}}
    end = None if ns.deadline is None else time.monotonic() + ns.deadline
    for part in select_parts(ns.parts, parser):
        left = ns.part_timeout if end is None else min(ns.part_timeout,
                                                       end - time.monotonic())
        if left < MIN_PART_S:
            print(f"=== {part.name}: skipped, {max(left, 0):.0f} s of --deadline left",
                  flush=True)
            results["parts"][part.name] = {"status": "skipped", "seconds_left": left}
            write(results, ns.output_json)
            continue
        print(f"=== {part.name}", flush=True)
        entry = run_in_subprocess(part, ns.smoke, left)
        results["parts"][part.name] = entry
        write(results, ns.output_json)
    device = torch.device("cuda" if torch.cuda.is_available() and not ns.smoke else "cpu")
    results.update({k: v for k, v in kernel_bench.environment(device).items()
                    if k in ("device", "device_type", "cuda")})
    write(results, ns.output_json)
    print(f"\n{results['device']}, torch {results['torch']}, triton {results['triton']}, "
          f"transformers {results['transformers']}")
    for name, entry in results["parts"].items():
        seconds = f"{entry['seconds']:.0f}s" if "seconds" in entry else "-"
        print(f"{name:<28}{entry['status']:<9}{seconds:>6}  {headline(entry)}")
    return results


if __name__ == "__main__":
    suite = main()
    failed = [n for n, e in suite.get("parts", {}).items()
              if e["status"] != "ok"]
    sys.exit(1 if failed else 0)
