"""Build the model and fill its weights: safetensors (single or sharded) or dummy.

The model is built on the meta device first, where it costs no memory, and its bytes
(this rank's share, in the target dtype, with the RoPE tables) are checked against the
memory free on the device before anything is allocated: a config.json claiming a huge
vocabulary or thousands of layers is refused naming its fields, instead of exhausting
memory (check_model_config bounds each field; this bounds their product). Loading
adds little to those bytes: dummy weights are drawn 16 MiB at a time, safetensors are
copied one tensor at a time from a memory map. Quantize-on-load (`quantization=`)
quantizes while loading: the packed forms are laid out on the meta model (their bytes
are what is checked), and each checkpoint tensor is quantized into its rows as it
arrives, so a model whose full-precision weights would not fit loads in int4
(quantize.py; dummy weights are drawn in full precision, then quantized). On a CPU
whose bf16 GEMMs run on packed weights (cpu_linear.packs_weights), those copies are
made here, before the engine measures what memory is left for the KV cache, if weights
and copies fit in half of this worker's share of the memory available.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pagellm.executor.model import host_memory, quantized_checkpoint
from pagellm.executor.model.config import ModelConfig
from pagellm.executor.model.decoder import DecoderForCausalLM
from pagellm.executor.model.linear import PACKED_WEIGHTS, packs_weights
from pagellm.executor.model.moe import quantize_experts
from pagellm.executor.model.parallel import TensorParallel
from pagellm.executor.model.quantize import (
    QUANTIZATIONS,
    RequantizingDestination,
    quantize_projections,
)
from pagellm.executor.model.registry import model_class

logger = logging.getLogger("pagellm")

DUMMY_CHUNK = 1 << 22  # elements drawn at once for dummy weights: 16 MiB of fp32
# Packed weight copies are made only while weights and copies take at most this share of
# the memory available before loading: the rest is for the KV cache and activations.
PACKED_MAX_SHARE = 0.5

# The config.json fields the weights' size follows, named when they do not fit.
SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim")


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


def tensor_names(model_dir: Path) -> set[str]:
    """The checkpoint's tensor names (the index's, else each file's header): what a
    quantized checkpoint stores packed is known before any tensor is read."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    names: set[str] = set()
    for file in safetensors_files(model_dir):
        with _opened(file) as f:
            names.update(f.keys())
    return names


def iterate_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Each file's tensors in turn."""
    for file in files:
        with _opened(file) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)


@contextmanager
def _opened(file: Path) -> Iterator[Any]:
    """`file` through safetensors' safe_open. A file the library cannot read (truncated
    by an interrupted download, not safetensors at all) is named: its own message says
    why ("incomplete metadata") but not which of a checkpoint's shards it means."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            yield f
    except (SafetensorError, OSError) as e:
        raise ValueError(f"cannot read the safetensors file {file}: {e}") from e


def available_memory(device: torch.device) -> int:
    """Bytes free to hold the model on `device`: CUDA's free memory, else the host's
    available memory."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    import psutil

    return int(psutil.virtual_memory().available)


def _config_sizes(config: ModelConfig) -> str:
    hf = config.hf_config
    fields = [f"{name}={getattr(hf, name)}" for name in SIZE_FIELDS
              if getattr(hf, name, None) is not None]
    return "config.json's " + ", ".join(fields)


def _meta_model(config: ModelConfig, tp: TensorParallel | None) -> DecoderForCausalLM:
    """The model in `config.dtype` on the meta device: shapes and dtypes, no memory."""
    try:
        with torch.device("meta"):
            model = model_class(config.spec)(config.spec, tp, config.max_model_len)
        # Cast on meta, then materialize: never a whole fp32 copy of a bf16 model.
        return model.to(config.dtype)
    except (RuntimeError, OverflowError) as e:  # sizes beyond any tensor's
        raise ValueError(f"{_config_sizes(config)}: the model cannot be built: {e}") from e


def _bytes_of(model: DecoderForCausalLM) -> int:
    """Parameters in their dtype (a packed projection's packed tensors, not its
    placeholder weight); buffers (the RoPE tables) in float32, as `reset_cache` makes
    them whatever the model's dtype."""
    placeholders = set(model.quantized)
    packs: list[Any] = [m.quant for m in model.quantized.values()]
    packed = [getattr(q, f.name) for q in packs for f in dataclasses.fields(q)]
    return (sum(p.numel() * p.element_size() for p in model.parameters()
                if id(p) not in placeholders)
            + sum(t.numel() * t.element_size() for t in packed if isinstance(t, torch.Tensor))
            + sum(b.numel() * 4 for b in model.buffers()))


def weight_bytes(config: ModelConfig, tp: TensorParallel | None = None) -> int:
    """Bytes of this rank's parameters in `config.dtype`, plus the RoPE tables."""
    return _bytes_of(_meta_model(config, tp))


def _check_memory(config: ModelConfig, needed: int, device: torch.device,
                  tp: TensorParallel | None) -> None:
    """Raise ValueError naming the config's sizes when the weights cannot fit."""
    free = available_memory(device)
    if needed > free:
        dtype = str(config.dtype).removeprefix("torch.")
        raise ValueError(
            f"the model's weights need {needed} bytes ({needed / 2**30:.1f} GiB) in {dtype}"
            f"{' on this rank' if tp is not None and tp.size > 1 else ''} "
            f"({_config_sizes(config)}; RoPE tables for max_model_len={config.max_model_len})"
            f", more than the {free} bytes ({free / 2**30:.1f} GiB) available on {device}")


def _packed_bytes(model: DecoderForCausalLM, config: ModelConfig, device: torch.device,
                  host_ranks: int) -> int:
    """Bytes of the packed weight copies to make (cpu_linear): where GEMMs take them,
    if weights and copies together take at most PACKED_MAX_SHARE of this rank's share
    of the memory available (split among the `host_ranks` workers of every engine core
    on this host, which load at once); else 0 (the GEMMs run on the plain weights)."""
    if not packs_weights(config.dtype, device):
        return 0
    copies = sum(w.numel() * w.element_size() for w in model.linear_weights())
    share = available_memory(device) / host_ranks
    if _bytes_of(model) + copies > PACKED_MAX_SHARE * share:
        logger.warning("%s GEMMs on plain weights: packed copies of them (%.2f GiB) would "
                       "not fit in half of this rank's %.2f GiB of the memory available",
                       str(config.dtype).removeprefix("torch."), copies / 2**30, share / 2**30)
        return 0
    return copies


def load_model(config: ModelConfig, device: torch.device, tp: TensorParallel | None = None,
               host_ranks: int = 1, kernels: bool = False) -> DecoderForCausalLM:
    """The model (this rank's slice of it, under tensor parallelism) on `device` in
    `config.dtype`, weights loaded, in eval mode; `host_ranks` workers share this host's
    memory (packed copies are made only if they fit in this one's share). Every rank
    reads the checkpoint and keeps its slice. Its size is checked first, before anything
    is allocated (module docstring). A quantized checkpoint stays packed where the
    quantized `kernels` run (Triton's); without them a W8A8 int8 one takes the CPU's
    int8 GEMM and any other loads dequantized (quantized_checkpoint.py)."""
    model = _meta_model(config, tp)
    quant = config.checkpoint_quant
    if quant is not None:
        model.quantized = quantized_checkpoint.prepare(
            model, quant, model.checkpoint_parts, config.dtype, triton=kernels,
            names=None if config.load_format == "dummy" else tensor_names(Path(config.model)))
    elif config.quantization is not None and config.load_format != "dummy":
        model.quantized = quantize_on_load(model, config.quantization, kernels, on_meta=True)
    _check_memory(config, _bytes_of(model), device, tp)
    # (A quantized model keeps no copies of the weights it replaces.)
    copies = 0 if config.quantization or model.quantized else \
        _packed_bytes(model, config, device, host_ranks)
    # Placeholders stay on meta: a packed projection's full-precision weight never exists.
    # On the CPU the weights take 2 MB pages (host_memory.py: 1.4x faster to stream).
    model._apply(lambda t: t if id(t) in model.quantized else
                 host_memory.empty_like(t, device))
    for module in model.quantized.values():
        quantized_checkpoint.materialize(module, device)
    model.model.rotary_emb.reset_cache()  # computed, not loaded: fill it on the device
    if config.load_format == "dummy":
        if quant is not None and model.quantized:
            raise ValueError("load_format='dummy' draws full-precision weights: it cannot "
                             f"fill a {quant.method} checkpoint's packed ones")
        _init_dummy(model, config.seed)
        if config.quantization is not None:
            model.quantized = quantize_on_load(model, config.quantization, kernels)
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the replaced weights' memory
    else:
        weights: Iterable[tuple[str, Any]] = iterate_safetensors(
            safetensors_files(Path(config.model)))
        if quant is not None:
            params = dict(model.named_parameters())
            weights = quantized_checkpoint.collect(
                weights, quant, lambda name: isinstance(model.destination(name, params),
                                                        RequantizingDestination),
                lambda name: model.destination(name, params) is not None)
        loaded = model.load_weights(weights)
        missing = sorted(model.checkpoint_keys() - loaded)
        if missing:
            raise ValueError(f"checkpoint does not match the model: missing {missing[:8]}"
                             f"{'...' if len(missing) > 8 else ''}")
    if copies:
        start = time.perf_counter()
        PACKED_WEIGHTS.pack(model.linear_weights())
        logger.info("%s GEMMs on packed weights: %.2f GiB of copies made in %.1f s",
                    str(config.dtype).removeprefix("torch."), copies / 2**30,
                    time.perf_counter() - start)
    return model.eval()


def quantize_on_load(model: DecoderForCausalLM, quantization: str, triton: bool,
                     on_meta: bool = False) -> dict[int, nn.Module]:
    """`quantization` (int4, int8, fp8) of every projection and, but for fp8 (no fp8
    fused MoE kernel: fp8 experts keep the model's dtype), every MoE layer's experts:
    for the Triton kernels, or (`triton` False) the CPU's int kernel. `on_meta`: laid out
    empty on the meta model, filled as the checkpoint loads (module docstring). Returns
    the modules packed, by their placeholder's id (the model's `quantized`)."""
    quantized = quantize_projections(model, quantization, triton, on_meta)
    if quantization != "fp8":
        quantized.update(quantize_experts(model, QUANTIZATIONS[quantization], triton,
                                          on_meta))
    return quantized


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
            else:  # drawn on the CPU in fp32 (the same values on every device and
                # dtype), a chunk at a time: a whole fp32 copy of a large embedding
                # would add half again to the weights' peak
                flat = param.view(-1)
                for start in range(0, flat.numel(), DUMMY_CHUNK):
                    chunk = flat[start:start + DUMMY_CHUNK]
                    chunk.copy_(torch.empty(chunk.numel(), dtype=torch.float32).normal_(
                        0.0, 0.02, generator=generator))
