"""Gemma 2 and Gemma 3 (text): the decoder with Gemma's computation.

What differs from the shared decoder (decoder.py), as transformers computes it:

- RMSNorm scales by (1 + w), in fp32 before rounding to the model's dtype
  (`GemmaRMSNorm`; its weights are stored centred on 0);
- the embedding is multiplied by sqrt(hidden_size) rounded to the model's dtype;
- "sandwich" norms: each of attention and MLP has a norm before it and one after it,
  and the residual add comes after the post norm:

      x ──► input_layernorm ──► attn ──► post_attention_layernorm ──► + ──┐
      └──────────────────────────── residual ─────────────────────────────┘ │
      ┌───────────────────────────────────────────────────────────────────────┘
      h ──► pre_feedforward_layernorm ──► mlp ──► post_feedforward_layernorm ──► +

  so the residual add fuses with the *next* pre-norm (input or pre-feedforward), as the
  shared decoder fuses it with its norms, while the post norms take no residual;
- GeGLU (gelu_pytorch_tanh) MLP, the attention scale query_pre_attn_scalar ** -0.5,
  attention logit soft-capping (Gemma 2), final logit soft-capping (in
  `compute_logits`, from the spec);
- local (sliding-window) and global layers alternating per `layer_types`; Gemma 3 adds
  per-head q/k norms and a RoPE of its own for the local layers (rope_local_base_freq),
  the global ones keeping rope_theta and its scaling (`LayerTypeRotaryEmbedding`).

The spec carries the data (spec.py: attn_scale, attn_softcap, final_logit_softcap,
sliding_rope, hidden_act); this module only the computation. Tensor parallelism,
weight names and loading are the shared decoder's: Gemma's checkpoints use Llama's
tensor names, plus the two extra norms per layer, which load whole.

On CUDA the (1 + w) norms stay torch ops: the fused RMSNorm kernel rounds as Llama does
(w times the normalised value in the model's dtype), not as Gemma does.
"""

from __future__ import annotations

import torch
from torch import nn

from pagellm.executor.model.attention import AttentionMetadata
from pagellm.executor.model.decoder import (
    DecoderAttention,
    DecoderForCausalLM,
    DecoderMLP,
    DecoderModel,
)
from pagellm.executor.model.layers import Fp32ScaledRMSNorm
from pagellm.executor.model.parallel import TensorParallel
from pagellm.executor.model.rope import RopeSpec, RotaryEmbedding
from pagellm.executor.model.spec import DecoderSpec

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, signed sin: [T, 1, rotary_dim]


class GemmaRMSNorm(Fp32ScaledRMSNorm):
    """RMSNorm with Gemma's (1 + w) scale, multiplied in fp32 and then rounded, as
    transformers' Gemma2RMSNorm/Gemma3RMSNorm (Llama's rounds first, then scales)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__(size, eps)
        nn.init.zeros_(self.weight)  # (1 + 0): the identity scale

    def scaled(self, h: torch.Tensor) -> torch.Tensor:
        return h * (1.0 + self.weight.float())


class GemmaAttention(DecoderAttention):
    """The shared attention block (scale, soft-capping and window from the spec), its
    per-head q/k norms (Gemma 3) Gemma's."""

    norm_cls = GemmaRMSNorm


class GemmaDecoderLayer(nn.Module):
    """One layer with sandwich norms (module docstring). Takes the model's two RoPE
    tables and rotates with the one of its layer type."""

    def __init__(self, spec: DecoderSpec, layer_idx: int, tp: TensorParallel) -> None:
        super().__init__()
        self.sliding = spec.window(layer_idx) is not None
        self.self_attn = GemmaAttention(spec, layer_idx, tp)
        self.mlp = DecoderMLP(spec, tp)
        size, eps = spec.hidden_size, spec.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(self, ropes: tuple[Rope, Rope], x: torch.Tensor,
                residual: torch.Tensor | None, meta: AttentionMetadata,
                kv_caches: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """ropes: (full-attention layers', sliding layers'); x: [T, hidden], the previous
        layer's output not yet added to `residual` (None before the first layer) ->
        (this layer's output, likewise not yet added; the residual stream)."""
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(ropes[1] if self.sliding else ropes[0], h, meta, kv_caches)
        h, _ = self.post_attention_layernorm(h)
        h, residual = self.pre_feedforward_layernorm(h, residual)
        h, _ = self.post_feedforward_layernorm(self.mlp(h))
        return h, residual


class LayerTypeRotaryEmbedding(RotaryEmbedding):
    """The global layers' RoPE tables (these), and `sliding`, the local layers' (Gemma
    3's rope_local_base_freq): one module, so that the loader's one `reset_cache()`
    fills both."""

    def __init__(self, spec: RopeSpec, sliding: RopeSpec, head_dim: int, max_position: int,
                 rows: int | None) -> None:
        super().__init__(spec, head_dim, max_position, rows)
        self.sliding = RotaryEmbedding(sliding, head_dim, max_position, rows)

    def reset_cache(self) -> None:
        super().reset_cache()
        if "sliding" in self._modules:  # absent while the base constructor runs this
            self.sliding.reset_cache()


class LayerTypeModel(DecoderModel):
    """A decoder whose layers take both RoPE tables, (full-attention layers', sliding
    layers'), and rotate with their type's (Gemma here, OLMo in olmo2.py); one table
    for both where the spec has no sliding_rope."""

    def make_rotary(self, spec: DecoderSpec, max_model_len: int | None) -> RotaryEmbedding:
        if spec.sliding_rope is None:  # one RoPE for every layer
            return super().make_rotary(spec, max_model_len)
        return LayerTypeRotaryEmbedding(spec.rope, spec.sliding_rope, spec.head_dim,
                                        spec.max_position, max_model_len)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """input_ids [T], positions [T] -> hidden states [T, hidden_size]."""
        x = self.embed(input_ids)  # [T, hidden]
        full = self.rotary_emb.cos_sin(positions, x.dtype)  # looked up once for all layers
        sliding = self.rotary_emb.sliding.cos_sin(positions, x.dtype) \
            if isinstance(self.rotary_emb, LayerTypeRotaryEmbedding) else full
        residual = None
        for layer in self.layers:
            x, residual = layer((full, sliding), x, residual, meta, kv_caches)
        x, _ = self.norm(x, residual)
        return x


class GemmaModel(LayerTypeModel):
    layer_cls = GemmaDecoderLayer
    norm_cls = GemmaRMSNorm

    def __init__(self, spec: DecoderSpec, tp: TensorParallel,
                 max_model_len: int | None = None) -> None:
        super().__init__(spec, tp, max_model_len)
        self.embed_scale = spec.hidden_size ** 0.5  # transformers': a Python float

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding times sqrt(hidden_size)."""
        x = self.embed_tokens(input_ids)  # [T, hidden]
        # The scale as transformers rounds it: a float32 tensor cast to the model's dtype
        # (sqrt(3072) = 55.43 is 55.5 in bf16); a Python float holding that value
        # multiplies as that tensor does, and is a constant to a captured CUDA graph.
        return x * float(torch.tensor(self.embed_scale, dtype=torch.float32).to(x.dtype))


class GemmaForCausalLM(DecoderForCausalLM):
    """Gemma 2 / Gemma 3 text: the shared causal LM (loading, tensor parallelism, the LM
    head and its final-logit soft-capping) around `GemmaModel`."""

    model_cls = GemmaModel
