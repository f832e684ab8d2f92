"""Resolve the options that depend on the model and the machine, once, at start-up."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from pagellm.executor.model.quantized_checkpoint import (
    METHODS,
    CheckpointQuant,
    read_quantization_config,
)
from pagellm.executor.model.registry import read_spec
from pagellm.executor.model.spec import DecoderSpec
from pagellm.protocol.engine_args import EngineArgs
from pagellm.protocol.validation import load_model_config

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# kv_cache_dtype's values other than "auto" (the model's dtype), as vLLM names them.
KV_CACHE_DTYPES = {"bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn,
                   "fp8_e4m3": torch.float8_e4m3fn}


@dataclass(frozen=True, eq=False)
class ModelConfig:
    model: str
    hf_config: Any  # transformers.PretrainedConfig
    spec: DecoderSpec
    dtype: torch.dtype
    max_model_len: int
    load_format: str
    seed: int
    quantization: str | None = None  # quantize on load (quantize.py)
    checkpoint_quant: CheckpointQuant | None = None  # a quantized checkpoint's format
    kv_cache_dtype: torch.dtype | None = None  # None: the model's dtype (KV_CACHE_DTYPES)

    @property
    def cache_dtype(self) -> torch.dtype:
        """The KV cache's element type (kv_cache_dtype 'fp8': e4m3, scale 1.0;
        'bfloat16': bf16, whatever the model's dtype)."""
        return self.kv_cache_dtype or self.dtype

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"device={device!r} was asked for, but CUDA is not available")
    return torch.device(device)


def _lora_unserved(spec: DecoderSpec) -> str | None:
    """Why LoRA adapters cannot be served on this model yet (None: they can)."""
    if spec.attn_output_gate:
        return ("its query projection also computes the attention's output gate, where a "
                "q_proj adapter's update would not land as PEFT's does")
    if spec.architecture == "GraniteMoeHybridForCausalLM":
        return ("adapters of its Mamba-2 layers and its fused shared MLP "
                "(shared_mlp.input_linear) are not mapped")
    return None


def resolve_model_config(args: EngineArgs) -> ModelConfig:
    """Read config.json and settle dtype and max_model_len; errors name the problem."""
    path = Path(args.model)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory not found: {args.model}")
    hf_config = load_model_config(path)
    spec = read_spec(hf_config)
    if args.enable_lora and (why := _lora_unserved(spec)):
        raise ValueError(f"enable_lora is not supported for {spec.architecture} yet: {why}")
    if spec.has_state and args.speculative is not None:
        raise ValueError(f"speculative_config is not supported for {spec.architecture}: "
                         "some of its layers keep a state per request, which rejected "
                         "proposals cannot be rolled back out of")

    if args.dtype == "auto":
        config_dtype = getattr(hf_config, "dtype", None) or torch.float32
        if isinstance(config_dtype, str):
            config_dtype = _DTYPES.get(config_dtype.removeprefix("torch."), torch.float32)
        dtype = config_dtype
    else:
        dtype = _DTYPES[args.dtype]

    derived = spec.max_position
    if args.max_model_len is None:
        max_model_len = derived
    elif args.max_model_len > derived:
        raise ValueError(f"max_model_len={args.max_model_len} is larger than the model's "
                         f"max_position_embeddings={derived}")
    else:
        max_model_len = args.max_model_len
    checkpoint_quant, quantization = _quantization(args.quantization, hf_config, path)
    return ModelConfig(model=str(path), hf_config=hf_config, spec=spec, dtype=dtype,
                       max_model_len=max_model_len, load_format=args.load_format,
                       seed=args.seed, quantization=quantization,
                       checkpoint_quant=checkpoint_quant,
                       kv_cache_dtype=KV_CACHE_DTYPES.get(args.kv_cache_dtype))


def resolve_draft_config(args: EngineArgs, target: ModelConfig) -> ModelConfig | None:
    """Speculative decoding's draft model (None: none): read as the target is, in the
    target's dtype, max_model_len, load format and KV cache dtype, never quantized on
    load. Its proposals are token ids of the target's: the vocabularies must match."""
    spec = args.speculative
    if spec is None or spec.method != "draft_model":
        return None
    assert spec.model is not None
    dtype = next(name for name, value in _DTYPES.items() if value == target.dtype)
    try:
        draft = resolve_model_config(replace(args, model=spec.model, dtype=dtype,
                                             max_model_len=target.max_model_len,
                                             quantization=None))
    except (OSError, ValueError) as e:
        raise ValueError(f"speculative_config.model={spec.model!r}: {e}") from None
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config.model={spec.model!r}: its vocab_size "
                         f"{draft.vocab_size} differs from the model's {target.vocab_size} "
                         "(a draft model proposes the target's token ids)")
    return draft


def _mxfp4_experts(quantization_config: Any, hf_config: Any) -> bool:
    """Whether config.json says MXFP4 of gpt-oss's kind (OpenAI's own checkpoints):
    its experts load dequantized, everything else as it is; `quantization` may then
    pack them on load as for any full-precision checkpoint."""
    if quantization_config is None:
        return False
    if not isinstance(quantization_config, dict):
        quantization_config = quantization_config.to_dict()
    return (quantization_config.get("quant_method") == "mxfp4"
            and getattr(hf_config, "model_type", None) == "gpt_oss")


def _quantization(asked: str | None, hf_config: Any, path: Path
                  ) -> tuple[CheckpointQuant | None, str | None]:
    """(the checkpoint's format, the quantization to apply on load), as vLLM settles
    `quantization`: unset follows config.json; a checkpoint format's name must be the
    checkpoint's; "fp8" of a full-precision checkpoint (and "int4", "int8") quantizes
    on load."""
    quantization_config = getattr(hf_config, "quantization_config", None)
    if _mxfp4_experts(quantization_config, hf_config):
        return None, asked  # gpt-oss's experts load dequantized (gpt_oss.py)
    try:
        found = read_quantization_config(quantization_config)
    except ValueError as e:
        raise ValueError(f"{path / 'config.json'}: {e}") from None
    if found is None:
        if asked in METHODS and asked != "fp8":
            raise ValueError(f"quantization={asked!r} names a checkpoint format, but "
                             f"{path / 'config.json'} has no quantization_config")
        return None, asked
    if asked is not None and METHODS.get(asked) != found.method:
        raise ValueError(f"quantization={asked!r}, but {path} is a {found.method} checkpoint "
                         "(leave quantization unset to load it as it is)")
    return found, None
