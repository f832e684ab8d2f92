"""Build the model and fill its weights: safetensors (single or sharded) or dummy."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from pagellm.executor.config import ModelConfig
from pagellm.executor.models.decoder import DecoderForCausalLM
from pagellm.executor.parallel import TensorParallel


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's files: those the index names, else every *.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({model_dir / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names missing shard(s): {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir} "
                                "(use load_format='dummy' for random weights)")
    return files


def iterate_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)


def load_model(config: ModelConfig, device: torch.device, tp: TensorParallel | None = None
               ) -> DecoderForCausalLM:
    """The model (this rank's slice of it, under tensor parallelism) on `device` in
    `config.dtype`, weights loaded, in eval mode. Every rank reads the checkpoint and
    keeps its slice."""
    with torch.device("meta"):
        model = DecoderForCausalLM(config.spec, tp)
    # Cast on meta, then materialize: never a whole fp32 copy of a bf16 model.
    model = model.to(config.dtype).to_empty(device=device)
    model.model.rotary_emb.reset_cache()  # computed, not loaded: fill it on the device
    if config.load_format == "dummy":
        _init_dummy(model, config.seed)
    else:
        loaded = model.load_weights(iterate_safetensors(safetensors_files(Path(config.model))))
        missing = sorted(model.checkpoint_keys() - loaded)
        if missing:
            raise ValueError(f"checkpoint does not match the model: missing {missing[:8]}"
                             f"{'...' if len(missing) > 8 else ''}")
    return model.eval()


def _init_dummy(model: nn.Module, seed: int) -> None:
    """Random weights of the right shapes: enough for benchmarks and for RL setups that
    push real weights in later. Norms start at one so activations stay in range."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                cpu = torch.empty(param.shape, dtype=torch.float32)
                cpu.normal_(0.0, 0.02, generator=generator)
                param.copy_(cpu)
