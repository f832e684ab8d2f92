"""What the RL tests share (tests/weights/: test_shm_updates.py, test_cuda_ipc.py,
test_nccl_updates.py; tests/executor/: test_sleep.py, test_collective_rpc.py;
tests/enginecore/test_pause.py; tests/frontend/server/test_dev_routes.py; the tensor-
and data-parallel tests; the GPU RL tests): greedy decoding on the engine and on
transformers, perturbed checkpoints (weights no engine had), and a trainer in a process
of its own that broadcasts weights over the "nccl" backend. Trainer scripts run with
this directory as their working directory, so they import `rl_helpers` too."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import torch
from helpers import SUPPORT

from pagellm import LLM, SamplingParams
from pagellm.executor.model.loader import iterate_safetensors, safetensors_files
from pagellm.weights.shm import buffer_dirs

GREEDY = SamplingParams(temperature=0.0, max_tokens=10)
PROMPTS = ["Hello", "The quick brown fox", "def fibonacci(n):", "a b c d e f"]


def greedy(llm: LLM, prompts: list = PROMPTS, params: SamplingParams = GREEDY
           ) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    return dict(iterate_safetensors(safetensors_files(model_dir)))


def perturbed(model_dir: Path, seed: int = 0, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """The model's checkpoint with noise added to every tensor: weights no engine had."""
    generator = torch.Generator().manual_seed(seed)
    return {name: t + scale * torch.randn(t.shape, generator=generator)
            for name, t in checkpoint(model_dir).items()}


def hf_model(model_dir: Path, weights: dict[str, torch.Tensor] | None = None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if weights is not None:
        missing, unexpected = model.load_state_dict(weights, strict=False)
        assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
        model.tie_weights()
    return model


def hf_greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=n,
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
    return out[0, len(prompt_ids):].tolist()


def rss(llm: LLM) -> int:
    return psutil.Process(llm.engine_core.engine_process.pid).memory_info().rss


def leftover_buffers() -> list[Path]:
    return sorted(p for d in buffer_dirs() for p in d.glob("pagellm-weights-*"))


def parameter_count(model_dir: Path) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return sum(p.numel() for p in model.parameters())



NCCL_TRAINER = """
import json
import sys
from pathlib import Path

from rl_helpers import perturbed

from pagellm.weights.nccl import trainer_init, trainer_send_weights, update_info_for

model_dir, init_info, bad = Path(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3] == "bad"
device = sys.argv[4] if len(sys.argv) > 4 else None  # default: trainer_init's choice
group = trainer_init(init_info, device)  # waits for the engine to join
weights = perturbed(model_dir, seed=7)
if bad:  # one tensor a row short: the engine must refuse it and still drain the rest
    name = "model.layers.1.mlp.down_proj.weight"
    weights[name] = weights[name][:-1]
weights = {name: tensor.to(group.device) for name, tensor in weights.items()}
print(json.dumps({"backend": group.backend, "update_info": update_info_for(weights.items())}),
      flush=True)
sys.stdin.readline()
trainer_send_weights(weights.items(), group)
print("sent", flush=True)
"""


class NcclTrainer:
    """NCCL_TRAINER in a process of its own, owned by a `with` block.

    The engine waits up to TRANSFER_TIMEOUT_S (300 s) for the trainer to join its
    group; a trainer that dies first (a failed import, a crash) would make the test
    wait that long. Once `guard(engine_pid)` is called, such a death kills the engine
    too, so the test fails at once (and the trainer's traceback is in its stderr)."""

    def __init__(self, model_dir: Path, init_info: dict, mode: str = "good",
                 device: str | None = None) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", NCCL_TRAINER, str(model_dir), json.dumps(init_info), mode,
             *([device] if device else [])],
            cwd=SUPPORT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._finished = threading.Event()

    def guard(self, engine_pid: int) -> None:
        def watch() -> None:
            if self.process.wait() != 0 and not self._finished.is_set():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(engine_pid, signal.SIGKILL)

        threading.Thread(target=watch, daemon=True).start()

    def joined(self) -> dict:
        """What the trainer printed once in the group: its backend and update_info."""
        return json.loads(self.process.stdout.readline())

    def send(self) -> None:
        self.process.stdin.write("go\n")
        self.process.stdin.flush()

    def sent(self) -> bool:
        return self.process.stdout.readline().strip() == "sent"

    def finish(self) -> int:
        self._finished.set()
        return self.process.wait(30)

    def push(self, llm: LLM, init_info: dict) -> None:
        """vLLM's four phases, the engine's side (`llm`) against this trainer: join,
        start, receive every tensor the trainer broadcasts, finish."""
        llm.init_weight_transfer_engine({"init_info": init_info})
        update_info = self.joined()["update_info"]
        llm.start_weight_update()
        self.send()
        assert llm.update_weights({"update_info": update_info}) == len(update_info["names"])
        llm.finish_weight_update()
        assert self.sent()

    def __enter__(self) -> NcclTrainer:
        return self

    def stop(self) -> None:
        self._finished.set()
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def __exit__(self, *exc: object) -> None:
        self.stop()
