"""Engine start-up, two source trees side by side: `LLM(model)` until it is ready, each
run a fresh process (imports included), the trees alternated so that a noisy machine
weighs on both alike; and the engine-core process's peak anonymous resident memory
(RssAnon, sampled every 20 ms; loading a model is its peak: with `quantization=`, the
full-precision weights, if they are ever all there at once, show here. The checkpoint's
memory-mapped pages are left out: the kernel can drop them any time).

    python benchmarks/startup.py --trees /tmp/base . --model benchmarks/configs/qwen2.5-0.5b \
        --runs 3 --llm-kwargs '{"load_format": "dummy", "dtype": "float32",
                                "max_model_len": 2048, "kv_cache_memory_bytes": 67108864}'

A tree is put first on PYTHONPATH (its `pagellm` wins over the installed one); the
engine-core process it launches inherits it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

PROBE = """
import json, os, sys, threading, time
import psutil
peak, done = [0], threading.Event()

def sample():  # the children's RssAnon (kB), summed
    while not done.wait(0.02):
        total = 0
        for child in psutil.Process().children(recursive=True):
            try:
                with open(f"/proc/{child.pid}/status") as f:
                    total += next(int(line.split()[1]) for line in f
                                  if line.startswith("RssAnon:"))
            except (OSError, StopIteration):
                pass
        peak[0] = max(peak[0], total)

threading.Thread(target=sample, daemon=True).start()
start = time.perf_counter()
from pagellm import LLM
llm = LLM(sys.argv[1], **json.loads(sys.argv[2]))
seconds = time.perf_counter() - start
done.set()
llm.shutdown()
print(json.dumps([seconds, peak[0]]))
"""


def start_up(tree: Path, model: str, llm_kwargs: str) -> tuple[float, float]:
    """(seconds until ready, the engine core's peak RssAnon in GiB) of one fresh start."""
    env = {**os.environ, "PYTHONPATH": str(tree.resolve()), "PAGELLM_LOG_LEVEL": "WARNING"}
    out = subprocess.run([sys.executable, "-c", PROBE, model, llm_kwargs], env=env,
                         capture_output=True, text=True, cwd="/", check=True)
    seconds, kib = json.loads(out.stdout.strip().splitlines()[-1])
    return seconds, kib / 2**20


def main(argv: list[str] | None = None) -> dict[str, list[tuple[float, float]]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", type=Path, nargs="+", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--llm-kwargs", default="{}", help="JSON keyword arguments of LLM")
    ns = parser.parse_args(argv)
    model = str(Path(ns.model).resolve()) if Path(ns.model).exists() else ns.model
    runs: dict[str, list[tuple[float, float]]] = {str(t): [] for t in ns.trees}
    for _ in range(ns.runs):
        for tree in ns.trees:
            runs[str(tree)].append(start_up(tree, model, ns.llm_kwargs))
    for tree, results in runs.items():
        seconds = [s for s, _ in results]
        print(f"{tree}: median {statistics.median(seconds):.2f} s "
              f"({', '.join(f'{s:.2f}' for s in seconds)}); engine core peak RssAnon "
              f"{max(r for _, r in results):.2f} GiB")
    return runs


if __name__ == "__main__":
    main()
