"""`DecoderSpec`: what a model's config.json says, as the data the decoder is built from.

The Llama, Mistral, Qwen2/Qwen2.5 and Qwen3 families differ only in data: qkv bias
(Qwen2), per-head q/k RMSNorm and a head_dim independent of hidden_size (Qwen3), tied
embeddings, and the RoPE variant. `from_hf_config` reads them from a transformers config
and refuses, naming it, what the decoder cannot serve (another architecture, another
activation, sliding-window attention). Apart from the modules because more than the
model reads it: the model config, the tensor-parallel layout and the weight map.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagellm.executor.model.rope import RopeSpec

# model_type -> architecture, for configs that do not list "architectures".
SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                           "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@dataclass(frozen=True)
class DecoderSpec:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    max_position: int
    rope: RopeSpec

    @classmethod
    def from_hf_config(cls, config: Any) -> DecoderSpec:
        archs = list(getattr(config, "architectures", None) or [])
        model_type = getattr(config, "model_type", "")
        arch = archs[0] if archs else SUPPORTED_ARCHITECTURES.get(model_type, model_type)
        if arch not in SUPPORTED_ARCHITECTURES.values():
            raise ValueError(f"unsupported architecture {arch!r} "
                             f"(supported: {', '.join(SUPPORTED_ARCHITECTURES.values())})")
        # Qwen2 always has q/k/v biases and never an o_proj bias; Llama, Mistral and
        # Qwen3 put `attention_bias` on all four projections.
        attention_bias = bool(getattr(config, "attention_bias", False))
        is_qwen2 = arch == "Qwen2ForCausalLM"
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r} (supported: silu)")
        if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window",
                                                               arch == "MistralForCausalLM"):
            raise ValueError("sliding-window attention is not supported")
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=not is_qwen2 and attention_bias,
            qk_norm=arch == "Qwen3ForCausalLM",
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            max_position=config.max_position_embeddings,
            rope=RopeSpec.from_hf(getattr(config, "rope_parameters", None),
                                  getattr(config, "rope_theta", None),
                                  getattr(config, "rope_scaling", None)),
        )
