"""Weight-update speed of each backend, on a real model shape with dummy weights.

For each backend, the time of one full update of every weight, measured where the RL
driver sees it (the `update_weights` call), in GB/s of weight bytes:

- "ipc": `LLM.update_weights(pairs)`: host tensors are written into /dev/shm, the
  engine maps the file, checks every spec and copies; with `--device cuda` the tensors
  are on the GPU and go by CUDA IPC (one device buffer, device to device).
- "nccl": a trainer process broadcasts over the torch.distributed group while the
  driver is inside `update_weights({"update_info": ...})`: NCCL between distinct GPUs,
  otherwise gloo through host memory (the line says which).

Also the seconds of a level-1 and a level-2 sleep and wake. One JSON line per result.

    python benchmarks/weight_transfer.py --model benchmarks/configs/qwen2.5-0.5b
    python benchmarks/weight_transfer.py --device cuda --dtype bfloat16   # on a GPU
"""

from __future__ import annotations

import argparse
import json
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import torch

from pagellm import LLM
from pagellm.weights.nccl import update_info_for

ROOT = Path(__file__).resolve().parents[1]
TRAINER = """
import json, sys
sys.path.insert(0, sys.argv[1])
from benchmarks.weight_transfer import random_weights
from pagellm.weights.nccl import trainer_init, trainer_send_weights
group = trainer_init(json.loads(sys.argv[3]))
weights = [(n, t.to(group.device)) for n, t in random_weights(sys.argv[2], sys.argv[4])]
print(group.backend, flush=True)
for line in sys.stdin:
    trainer_send_weights(weights, group)
    print("sent", flush=True)
"""


def random_weights(model: str, dtype: str) -> list[tuple[str, torch.Tensor]]:
    """Every checkpoint tensor of `model`'s config, random, in Hugging Face's names."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model)
    with torch.device("meta"):
        shapes = {n: t.shape for n, t in AutoModelForCausalLM.from_config(config)
                  .state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)
    generator = torch.Generator().manual_seed(0)
    return [(n, (0.02 * torch.randn(s, generator=generator)).to(getattr(torch, dtype)))
            for n, s in shapes.items()]


def peak_rss_mib(llm: LLM) -> float | None:
    """The engine-core process's resident high-water mark (Linux), in MiB."""
    process = getattr(llm.engine_core, "engine_process", None)  # launched engines only
    if process is None:
        return None
    try:
        status = Path(f"/proc/{process.pid}/status").read_text()
    except OSError:
        return None
    kib = next((int(line.split()[1]) for line in status.splitlines()
                if line.startswith("VmHWM:")), None)
    return None if kib is None else round(kib / 1024, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(ROOT / "benchmarks/configs/qwen2.5-0.5b"))
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (the engine's, and "
                        "where the ipc backend's tensors are)")
    ns = parser.parse_args()
    weights = [(n, t.to(ns.device)) for n, t in random_weights(ns.model, ns.dtype)]
    nbytes = sum(t.numel() * t.element_size() for _, t in weights)
    base = {"model": Path(ns.model).name, "dtype": ns.dtype, "weight_bytes": nbytes,
            "device": ns.device,
            "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
            "date": time.strftime("%Y-%m-%d")}
    common = dict(load_format="dummy", skip_tokenizer_init=True, dtype=ns.dtype,
                  kv_cache_memory_bytes=64 * 2**20, max_model_len=2048,
                  enable_sleep_mode=True, device=ns.device)

    with LLM(ns.model, weight_transfer_config={"backend": "ipc"}, **common) as llm:
        for _ in range(ns.repeats):
            t0 = time.perf_counter()
            llm.update_weights(weights)
            seconds = time.perf_counter() - t0
            print(json.dumps({**base, "backend": "ipc", "seconds": round(seconds, 3),
                              "GB/s": round(nbytes / seconds / 1e9, 3)}), flush=True)
        for level in (1, 2):
            t0 = time.perf_counter()
            llm.sleep(level=level)
            t1 = time.perf_counter()
            llm.wake_up()
            t2 = time.perf_counter()
            print(json.dumps({**base, "sleep_level": level, "sleep_s": round(t1 - t0, 3),
                              "wake_s": round(t2 - t1, 3)}), flush=True)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_info = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
                 "world_size": 2}
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, str(ROOT), ns.model,
                                json.dumps(init_info), ns.dtype],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert trainer.stdin is not None and trainer.stdout is not None
    try:
        with LLM(ns.model, weight_transfer_config={"backend": "nccl"}, **common) as llm:
            llm.init_weight_transfer_engine({"init_info": init_info})
            backend = trainer.stdout.readline().strip()
            assert backend in ("nccl", "gloo"), backend
            info = update_info_for(weights)
            for _ in range(ns.repeats):
                llm.start_weight_update()
                trainer.stdin.write("go\n")
                trainer.stdin.flush()
                t0 = time.perf_counter()
                llm.update_weights({"update_info": info})
                seconds = time.perf_counter() - t0
                llm.finish_weight_update()
                assert trainer.stdout.readline().strip() == "sent"
                print(json.dumps({**base, "backend": f"nccl ({backend})",
                                  "seconds": round(seconds, 3),
                                  "GB/s": round(nbytes / seconds / 1e9, 3),
                                  "engine_peak_rss_mib": peak_rss_mib(llm)}), flush=True)
    finally:
        trainer.kill()
        trainer.wait()


if __name__ == "__main__":
    main()
