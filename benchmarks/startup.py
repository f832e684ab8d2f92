"""Engine start-up, two source trees side by side: `LLM(model)` until it is ready, each
run a fresh process (imports included), the trees alternated so that a noisy machine
weighs on both alike.

    python benchmarks/startup.py --trees /tmp/base . --model benchmarks/configs/qwen2.5-0.5b \
        --runs 3 --llm-kwargs '{"load_format": "dummy", "dtype": "float32",
                                "max_model_len": 2048, "kv_cache_memory_bytes": 67108864}'

A tree is put first on PYTHONPATH (its `pagellm` wins over the installed one); the
engine-core process it launches inherits it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

PROBE = """
import json, sys, time
start = time.perf_counter()
from pagellm import LLM
llm = LLM(sys.argv[1], **json.loads(sys.argv[2]))
print(time.perf_counter() - start)
llm.shutdown()
"""


def start_seconds(tree: Path, model: str, llm_kwargs: str) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree.resolve()), "PAGELLM_LOG_LEVEL": "WARNING"}
    out = subprocess.run([sys.executable, "-c", PROBE, model, llm_kwargs], env=env,
                         capture_output=True, text=True, cwd="/", check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", type=Path, nargs="+", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--llm-kwargs", default="{}", help="JSON keyword arguments of LLM")
    ns = parser.parse_args(argv)
    model = str(Path(ns.model).resolve()) if Path(ns.model).exists() else ns.model
    times: dict[str, list[float]] = {str(t): [] for t in ns.trees}
    for _ in range(ns.runs):
        for tree in ns.trees:
            times[str(tree)].append(start_seconds(tree, model, ns.llm_kwargs))
    for tree, seconds in times.items():
        print(f"{tree}: median {statistics.median(seconds):.2f} s "
              f"({', '.join(f'{s:.2f}' for s in seconds)})")
    return times


if __name__ == "__main__":
    main()
