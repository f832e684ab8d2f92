"""OLMo 2 and OLMo 3 (AllenAI's fully open models, `Olmo2ForCausalLM`,
`Olmo3ForCausalLM`): the decoder with OLMo's computation.

What differs from the shared decoder (decoder.py), as transformers computes it:

- norms after each block and none before it ("reordered" norms):

      h ──► attn ──► post_attention_layernorm ──► + ──► mlp ──► post_feedforward_layernorm ──► +
      └────────────────── residual ───────────────┘ └──────────────── residual ────────────────┘

  so a layer takes the residual stream whole (the previous layer's output added to it)
  and hands back its MLP's normalised output not yet added, as the shared layers do;
- every RMSNorm scales in fp32 and rounds after (`OlmoRMSNorm`; Llama's rounds first),
  the q and k norms too, which span all heads (spec qk_norm "full", as OLMoE's, sharded
  under tensor parallelism: `OlmoShardedRMSNorm`);
- OLMo 3: sliding-window and full layers per `layer_types`, each type with its own RoPE
  (rope_parameters per layer type: YaRN on the full layers of the long-context models),
  the tables Gemma 3's keep (gemma.py `LayerTypeModel`).

The spec carries the data (registry.py `_olmo2`); weight names, loading and tensor
parallelism are the shared decoder's (the two post norms load whole). On CUDA the norms
stay torch ops: the fused RMSNorm kernel rounds as Llama does.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from pagellm.executor.model.attention import AttentionMetadata
from pagellm.executor.model.decoder import DecoderAttention, DecoderForCausalLM, DecoderMLP
from pagellm.executor.model.gemma import LayerTypeModel
from pagellm.executor.model.layers import Fp32ScaledRMSNorm, RMSNorm, ShardedRMSNorm
from pagellm.executor.model.parallel import TensorParallel
from pagellm.executor.model.spec import DecoderSpec

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, signed sin: [T, 1, rotary_dim]


class OlmoRMSNorm(Fp32ScaledRMSNorm):
    """RMSNorm scaled in fp32, then rounded (transformers' Olmo2RMSNorm/Olmo3RMSNorm)."""


class OlmoShardedRMSNorm(ShardedRMSNorm):
    """The all-heads q/k norm, scaled in fp32, then rounded."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, size] -> [T, size]."""
        return (self.weight * self.normalized(x)).to(x.dtype)


class Olmo2Attention(DecoderAttention):
    """The shared attention, its all-heads q/k norms OLMo's (scaled, then rounded)."""

    full_norm_cls = OlmoShardedRMSNorm


class PostNormDecoderLayer(nn.Module):
    """One layer with norms after its blocks and none before (module docstring), of the
    family's norm and attention classes (EXAONE 4's are Llama's: exaone4.py)."""

    norm_cls: ClassVar[type[RMSNorm]] = OlmoRMSNorm
    attention_cls: ClassVar[type[DecoderAttention]] = Olmo2Attention

    def __init__(self, spec: DecoderSpec, layer_idx: int, tp: TensorParallel) -> None:
        super().__init__()
        self.sliding = spec.window(layer_idx) is not None
        self.self_attn = self.attention_cls(spec, layer_idx, tp)
        self.mlp = DecoderMLP(spec, tp)
        self.post_attention_layernorm = self.norm_cls(spec.hidden_size, spec.rms_norm_eps)
        self.post_feedforward_layernorm = self.norm_cls(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, rope: Rope, x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata, kv_caches: list[torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """rope: this layer's cos, signed sin; x: [T, hidden], the previous layer's output
        not yet added to `residual` (None before the first layer) -> (this layer's
        output, likewise not yet added; the residual stream)."""
        h = x if residual is None else x + residual
        attn = self.self_attn(rope, h, meta, kv_caches)
        attn, _ = self.post_attention_layernorm(attn)
        h = h + attn
        out, _ = self.post_feedforward_layernorm(self.mlp(h))
        return out, h


class Olmo2DecoderLayer(PostNormDecoderLayer):
    """OLMo's layer; rotates with its layer type's RoPE."""

    def forward(self, ropes: tuple[Rope, Rope], x: torch.Tensor,  # type: ignore[override]
                residual: torch.Tensor | None, meta: AttentionMetadata,
                kv_caches: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """ropes: (full-attention layers', sliding layers'); see
        PostNormDecoderLayer.forward."""
        return super().forward(ropes[1] if self.sliding else ropes[0], x, residual, meta,
                               kv_caches)


class Olmo2Model(LayerTypeModel):
    layer_cls = Olmo2DecoderLayer
    norm_cls = OlmoRMSNorm


class Olmo2ForCausalLM(DecoderForCausalLM):
    """OLMo 2 / OLMo 3: the shared causal LM (loading, tensor parallelism, the LM head)
    around `Olmo2Model`."""

    model_cls = Olmo2Model
