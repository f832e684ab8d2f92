"""A PEFT LoRA adapter read into this rank's pieces, on the host.

PEFT writes an adapter as `adapter_config.json` (r, lora_alpha, use_rslora,
target_modules, ...) and `adapter_model.safetensors`, whose tensors are named after the
base model's modules:

    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight   [r, in]
    base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight   [out, r]

The update to that projection is  y += scale * (x A^T) B^T,  scale = lora_alpha / r
(lora_alpha / sqrt(r) with rslora). Our decoder merges q/k/v into `qkv_proj` and
gate/up into `gate_up_proj` (one GEMM each), so an adapter's q, k and v updates become
*parts* of one update of `qkv_proj`: A stacks the parts' rows, B places each part's
columns in that part's output rows (zeros elsewhere), and one shrink and one expand
GEMM apply them all (`ModuleLoRA`). Phi-3's checkpoint (and so its adapters) has the
fused `qkv_proj` / `gate_up_proj` already: one part.

Under tensor parallelism each rank keeps what its slice of the base layer needs, found
by the weight map that places the base weights (`weight_map.destination`): B's rows as
the column-parallel weight's rows, A's columns as the row-parallel weight's columns;
the rest (A of a column-parallel layer, B of a row-parallel one) is whole on every rank.
The row-parallel partial products then sum in the layer's own all-reduce.

Everything a client names is distrusted: the directory must hold both files (a pickled
`adapter_model.bin` is never unpickled), the config is bounded in size and checked field
by field, and every tensor must name a projection this model has, with the shape the
model implies; anything PEFT can express that the engine does not serve (biases, DoRA,
per-module ranks, embeddings, modules_to_save) is refused by name.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from pagellm.executor.model.loader import iterate_safetensors
from pagellm.executor.model.parallel import TensorParallel
from pagellm.executor.model.spec import DecoderSpec
from pagellm.executor.model.weight_map import destination
from pagellm.protocol.validation import read_json_object

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
# Adapter tensors: `{prefix}model.layers.{i}.{block}.{proj}.lora_{A|B}.weight`, the block
# attention, the MLP or a MoE layer's shared expert(s) (DeepSeek's, Qwen2-MoE's).
_TENSOR = re.compile(r"(?:base_model\.model\.)?(model\.layers\.(\d+)\."
                     r"(self_attn|mlp|mlp\.shared_experts?|conv)\.(\w+))"
                     r"\.lora_([AB])(?:\.[\w-]+)?\.weight")
# PEFT config fields whose non-default values the engine does not serve: field -> why.
_REFUSED = {
    "target_parameters": "adapters on parameters (target_parameters: PEFT's form for a MoE "
                         "model's fused experts) are not served",
    "use_dora": "DoRA adapters are not served",
    "modules_to_save": "adapters that replace whole modules (modules_to_save) are not served",
    "rank_pattern": "per-module ranks (rank_pattern) are not served",
    "alpha_pattern": "per-module alphas (alpha_pattern) are not served",
    "fan_in_fan_out": "fan_in_fan_out adapters (GPT-2 Conv1D) are not served",
    "layers_to_transform": "adapters limited to some layers (layers_to_transform) are not "
                           "served",
}


@dataclass(frozen=True)
class Target:
    """Which of our modules a PEFT module name updates: `module` (our name, e.g.
    `qkv_proj`), as part `part` of `parts`."""

    module: str
    part: int
    parts: int
    row_parallel: bool


def targets(spec: DecoderSpec) -> dict[str, Target]:
    """PEFT's projection names in this model -> the part of ours each updates."""
    mlp = {"gate_proj": Target("gate_up_proj", 0, 2, False),
           "up_proj": Target("gate_up_proj", 1, 2, False),
           "down_proj": Target("down_proj", 0, 1, True)}
    if spec.mla is not None:  # DeepSeek's latent attention: kv_b_proj is absorbed into
        return mlp  # the queries and o_proj's input (deepseek.py), so no adapter fits it
    attn = {"q_proj": Target("qkv_proj", 0, 3, False),
            "k_proj": Target("qkv_proj", 1, 3, False),
            "v_proj": Target("qkv_proj", 2, 3, False)}
    # Modules the checkpoint stores fused are ours (Phi-3's qkv_proj and gate_up_proj,
    # GLM-4's gate_up_proj): PEFT names them so, one part
    if "qkv_proj" in spec.fused_checkpoint:
        attn = {"qkv_proj": Target("qkv_proj", 0, 1, False)}
    if "gate_up_proj" in spec.fused_checkpoint:
        mlp = {"gate_up_proj": Target("gate_up_proj", 0, 1, False),
               "down_proj": mlp["down_proj"]}
    conv = {}
    if spec.short_conv is not None:  # LFM2's convolutions (one rank: manager.py)
        conv = {"in_proj": Target("in_proj", 0, 1, False),
                "out_proj": Target("out_proj", 0, 1, True)}
    return {**mlp, **attn, **conv, "o_proj": Target("o_proj", 0, 1, True)}


@dataclass(frozen=True)
class LoRAConfig:
    """The adapter_config.json fields that shape the update."""

    rank: int
    scale: float  # lora_alpha / rank, or lora_alpha / sqrt(rank) with rslora

    @classmethod
    def from_dict(cls, raw: Any, max_rank: int) -> LoRAConfig:
        """Checks a PEFT config (as parsed JSON or PEFT's own `LoraConfig.to_dict()`)."""
        if not isinstance(raw, Mapping):
            raise ValueError("the adapter config must be a JSON object")
        peft_type = raw.get("peft_type", "LORA")
        if str(getattr(peft_type, "value", peft_type)).upper() != "LORA":
            raise ValueError(f"peft_type must be LORA, got {peft_type!r}")
        rank = raw.get("r")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"r must be a positive integer, got {rank!r}")
        if rank > max_rank:
            raise ValueError(f"the adapter's rank r={rank} is above max_lora_rank={max_rank}")
        alpha = raw.get("lora_alpha", 8)
        if isinstance(alpha, bool) or not isinstance(alpha, int | float) \
                or not math.isfinite(alpha) or alpha <= 0:
            raise ValueError(f"lora_alpha must be a positive number, got {alpha!r}")
        if raw.get("bias", "none") != "none":
            raise ValueError(f"bias={raw.get('bias')!r}: adapters with biases are not served "
                             "(bias must be 'none')")
        for name, why in _REFUSED.items():
            if raw.get(name):
                raise ValueError(f"{name}={raw[name]!r}: {why}")
        rslora = raw.get("use_rslora", False)
        if not isinstance(rslora, bool):
            raise ValueError(f"use_rslora must be true or false, got {rslora!r}")
        return cls(rank, alpha / math.sqrt(rank) if rslora else alpha / rank)


@dataclass
class ModuleLoRA:
    """One module's update on this rank: y += (x a^T) b^T (the scale is in b).
    a [parts * rank, in_features], b [out_features, parts * rank]: part p's rows of a
    and columns of b are p * rank ...; a part the adapter leaves out stays zero."""

    a: torch.Tensor
    b: torch.Tensor


@dataclass
class LoadedAdapter:
    """An adapter's updates on this rank, by our module's qualified name
    (`model.layers.3.self_attn.qkv_proj`), on the host in the model's dtype."""

    rank: int
    modules: dict[str, ModuleLoRA]


def read_directory(path: str, max_rank: int) -> tuple[LoRAConfig, dict[str, torch.Tensor]]:
    """A PEFT adapter directory's config and tensors, checked (module doc)."""
    directory = Path(path)
    if not path or not directory.is_dir():
        raise ValueError(f"LoRA adapter {path!r} is not a directory")
    config_file, weights_file = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    for file in (config_file, weights_file):
        if not file.is_file():
            extra = " (adapter_model.bin is not read: a pickle can run code)" \
                if file is weights_file and (directory / "adapter_model.bin").exists() else ""
            raise ValueError(f"LoRA adapter {path!r} has no {file.name}{extra}")
    config = LoRAConfig.from_dict(read_json_object(config_file, MAX_CONFIG_BYTES), max_rank)
    return config, dict(iterate_safetensors([weights_file]))


def build(config: LoRAConfig, tensors: Iterable[tuple[str, torch.Tensor]],
          spec: DecoderSpec, tp: TensorParallel, module_shapes: Mapping[str, tuple[int, int]],
          dtype: torch.dtype) -> LoadedAdapter:
    """This rank's `LoadedAdapter` from a checked config and the adapter's tensors.
    `module_shapes`: (out_features, in_features) on this rank of each module that takes
    adapters (`qkv_proj`, `o_proj`, `gate_up_proj`, `down_proj` by qualified name)."""
    names = targets(spec)
    r = config.rank
    modules: dict[str, ModuleLoRA] = {}
    seen: dict[tuple[str, str], int] = {}  # (PEFT module, A|B) -> count
    for name, tensor in tensors:
        m = _TENSOR.fullmatch(name)
        if m is None:
            kind = "bias" if name.endswith(".bias") else "tensor"
            raise ValueError(f"adapter {kind} {name!r} is not a LoRA update of a projection "
                             "this engine serves (attention and MLP projections)")
        peft_module, layer, proj, which = m[1], int(m[2]), m[4], m[5]
        target = names.get(proj)
        ours = f"model.layers.{layer}.{m[3]}.{target.module}" if target else ""
        if target is None or layer >= spec.num_layers or ours not in module_shapes:
            raise ValueError(f"adapter tensor {name!r} targets {peft_module!r}, which this "
                             f"model ({spec.architecture}, {spec.num_layers} layers) takes no "
                             f"adapter on (served: {', '.join(sorted(names))})")
        key = (peft_module, which)
        seen[key] = seen.get(key, 0) + 1
        if seen[key] > 1:
            raise ValueError(f"adapter has two lora_{which} tensors for {peft_module!r}")
        out_features, in_features = module_shapes[ours]
        module = modules.get(ours)
        if module is None:
            module = modules[ours] = ModuleLoRA(
                torch.zeros(target.parts * r, in_features, dtype=dtype),
                torch.zeros(out_features, target.parts * r, dtype=dtype))
        columns = slice(target.part * r, (target.part + 1) * r)
        # The base weight's checkpoint name: the weight map places A or B as that weight.
        weight_name = f"{peft_module}.weight"
        if which == "A":
            if tuple(tensor.shape[:1]) != (r,):
                raise ValueError(f"{name}: shape {tuple(tensor.shape)}, expected [{r}, ...] "
                                 f"(r={r})")
            piece = module.a[columns]  # [r, in_features]
            if target.row_parallel:  # this rank's input columns
                place = destination(weight_name, _as_params(ours, piece), spec, tp, False)
                _load(place, tensor, name)
            else:
                _copy(piece, tensor, name)
        else:
            piece = module.b[:, columns]  # [out_features, r]
            if target.row_parallel:
                _copy(piece, tensor.float() * config.scale, name)
            else:  # this rank's output rows (of its part of a merged projection)
                place = destination(weight_name, _as_params(ours, piece), spec, tp, False)
                _load(place, tensor.float() * config.scale, name)
    missing = [f"{module}.lora_{'B' if which == 'A' else 'A'}" for (module, which) in seen
               if (module, "B" if which == "A" else "A") not in seen]
    if missing:
        raise ValueError(f"adapter lacks {', '.join(sorted(missing)[:4])}")
    if not modules:
        raise ValueError("adapter has no LoRA tensors")
    return LoadedAdapter(r, modules)


def _as_params(module: str, tensor: torch.Tensor) -> Mapping[str, nn.Parameter]:
    """`tensor` standing where `destination` looks for module's weight."""
    return cast(Mapping[str, nn.Parameter], {f"{module}.weight": tensor})


def _load(place: Any, tensor: torch.Tensor, name: str) -> None:
    if place is None:
        raise ValueError(f"adapter tensor {name!r} has no place in this model")
    try:
        place.load(tensor)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from e


def _copy(piece: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if tuple(tensor.shape) != tuple(piece.shape):
        raise ValueError(f"{name}: shape {tuple(tensor.shape)}, the model's is "
                         f"{tuple(piece.shape)}")
    piece.copy_(tensor)
