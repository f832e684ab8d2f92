"""Cohere's Command R / Aya Expanse (`CohereForCausalLM`) and Command R7B / Command A
(`Cohere2ForCausalLM`): parallel attention and MLP blocks.

What differs from the shared decoder (decoder.py), as transformers computes it:

- one norm per layer, a LayerNorm without bias (`CohereLayerNorm`: the mean taken out,
  then scaled, in fp32), feeding the attention and the MLP side by side:

      h ──► input_layernorm ──┬──► attn ──► + ──────────► + ──►
                              └──► mlp  ───┼─────────────┘
      └────────────── residual ────────────┘

  added to the residual stream in transformers' order (residual + attn, then + mlp:
  a layer hands back the MLP's output not yet added, and the stream with the attention's
  added);
- RoPE pairs each head's dimensions interleaved (GLM's: glm4.py `GlmAttention`);
  Command R7B / A's full-attention layers take no RoPE at all (every fourth layer; the
  others are sliding-window layers): the spec's rope_layers, which the shared attention
  reads (SmolLM3's NoPE layers);
- the final norm is the same LayerNorm; the logits are multiplied by logit_scale (the
  spec's), the embedding tied.

Command R+ (use_qk_norm: per-head LayerNorms of q and k with a weight per head) is
refused by the reader (registry.py `_cohere`). Names, loading and tensor parallelism are
the shared decoder's.
"""

from __future__ import annotations

import torch
from torch import nn

from pagellm.executor.model.attention import AttentionMetadata
from pagellm.executor.model.decoder import DecoderForCausalLM, DecoderModel
from pagellm.executor.model.glm4 import GlmAttention
from pagellm.executor.model.layers import RMSNorm
from pagellm.executor.model.mlp import DecoderMLP
from pagellm.executor.model.parallel import TensorParallel
from pagellm.executor.model.spec import DecoderSpec


class CohereLayerNorm(RMSNorm):
    """LayerNorm without bias in fp32, then rounded (transformers' CohereLayerNorm), with
    RMSNorm's call: optionally fused with the residual add before it. Torch ops on every
    device (the fused CUDA kernel computes RMSNorm)."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(x + residual), x + residual); x: [..., size]."""
        if residual is not None:
            x = x + residual
        h = x.float()
        h = h - h.mean(-1, keepdim=True)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * h).to(x.dtype), x


class CohereDecoderLayer(nn.Module):
    """One layer: attention and MLP side by side (module docstring)."""

    def __init__(self, spec: DecoderSpec, layer_idx: int, tp: TensorParallel) -> None:
        super().__init__()
        self.self_attn = GlmAttention(spec, layer_idx, tp)
        self.mlp = DecoderMLP(spec, tp)
        self.input_layernorm = CohereLayerNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                residual: torch.Tensor | None, meta: AttentionMetadata,
                kv_caches: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """rope: cos, signed sin [T, 1, rotary_dim]; x: [T, hidden], the previous layer's
        output not yet added to `residual` (None before the first layer) -> (the MLP's
        output, not yet added; the residual stream with the attention's added)."""
        h, residual = self.input_layernorm(x, residual)
        attn = self.self_attn(rope, h, meta, kv_caches)
        return self.mlp(h), residual + attn


class CohereModel(DecoderModel):
    layer_cls = CohereDecoderLayer
    norm_cls = CohereLayerNorm


class CohereForCausalLM(DecoderForCausalLM):
    """Command R / Aya Expanse and Command R7B / A: the shared causal LM around
    `CohereModel`, its logits times logit_scale."""

    model_cls = CohereModel

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden_size] -> logits [N, vocab_size] * logit_scale."""
        logits = super().compute_logits(hidden)
        scale = self.spec.logit_scale
        return logits if scale is None else logits * scale
