"""One thread against every thread, per step, for an engine core on the CPU.

Steps an in-process `EngineCore` through decode steps of `--batch` requests and
switches torch's thread count between one and `--threads` every block of steps (six
rounds, interleaved, so drift hits both alike), reporting the median of each step's
prepare + forward + sample. This is the engine alone: the model runner's
`ThreadTuner` measures the same thing as it serves, where a busy frontend also
competes for the cores (executor/worker/cpu_threads.py).

    python benchmarks/cpu_threads.py --model tiny --batch 1 16 64 256
    python benchmarks/cpu_threads.py --model demo --batch 1 8 64 256
    python benchmarks/cpu_threads.py --model benchmarks/configs/smollm2-135m --batch 1 16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from engine_overhead import TINY, prompt

from pagellm import EngineArgs, SamplingParams
from pagellm.demo.model import DEMO_SPEC, make_model
from pagellm.enginecore.core import EngineCore
from pagellm.protocol.messages import EngineCoreRequest

ROUNDS = 6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny",
                        help="tiny, demo, or a config directory (random weights)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--steps-per-block", type=int, default=None,
                        help="default: 20 for tiny and demo, 8 for others")
    ns = parser.parse_args()
    extra: dict[str, object] = {}
    if ns.model in ("tiny", "demo"):
        model = str(make_model(tempfile.mkdtemp(), TINY if ns.model == "tiny" else DEMO_SPEC))
        block = ns.steps_per_block or 20
    else:
        model, block = ns.model, ns.steps_per_block or 8
        extra = {"load_format": "dummy", "dtype": "float32", "skip_tokenizer_init": True}
    for batch in ns.batch:
        core = EngineCore(EngineArgs(model=model, max_num_seqs=batch, max_model_len=1024,
                                     **extra))
        core.executor.worker.model_runner.thread_tuner = None  # the threads are ours here
        params = SamplingParams(temperature=0.0, max_tokens=ROUNDS * 2 * block + 8,
                                ignore_eos=True)
        try:
            for i in range(batch):
                core.add_request(EngineCoreRequest(f"r{i}", prompt(i, 32), params, None,
                                                   time.time()))
            for _ in range(3):  # the prefill and the first decodes
                core.step()
            seconds: dict[int, list[float]] = {1: [], ns.threads: []}
            for _ in range(ROUNDS):
                for threads in (1, ns.threads):
                    torch.set_num_threads(threads)
                    for k in range(block):
                        core.step()
                        t = core.recent_steps[-1]
                        if k:  # the first step after a switch is not counted
                            seconds[threads].append(t.prepare_inputs_s + t.forward_s
                                                    + t.sample_s)
        finally:
            core.shutdown()
        one, every = (statistics.median(seconds[n]) * 1e3 for n in (1, ns.threads))
        print(f"{ns.model} batch {batch}: 1 thread {one:.3f} ms, {ns.threads} threads "
              f"{every:.3f} ms per step; {ns.threads} threads are {one / every:.2f}x")


if __name__ == "__main__":
    main()
