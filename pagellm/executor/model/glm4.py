"""GLM-4 (Zhipu's `GlmForCausalLM`: glm-4-9b-chat-hf, GLM-Edge) and GLM-4-0414
(`Glm4ForCausalLM`: GLM-4-9B/32B-0414, GLM-Z1): the shared decoder with GLM's RoPE, and
for GLM-4-0414 norms after the blocks as well. ERNIE 4.5's dense models are
`GlmForCausalLM` with whole heads rotated (registry.py `_ernie4_5`), its MoE models
that attention with DeepSeek's experts (`Ernie45MoeForCausalLM`).

What differs, as transformers computes it:

- RoPE turns the first partial_rotary_factor (0.5) of each head, its dimensions paired
  interleaved, (x0, x1), (x2, x3), ... (transformers' GLM rotate_half), not as halves:
  `GlmAttention.rotate` reorders the pairs as halves first (rope.halves_from_pairs), the
  queries and keys alike, so every score is the interleaved rotation's and the shared
  kernels rotate as usual (the KV cache holds the keys so reordered);
- q/k/v have biases (attention_bias), o_proj none; the checkpoint stores the MLP's gate
  and up fused (`mlp.gate_up_proj`, the spec's fused_checkpoint), q/k/v apart;
- GLM-4-0414 (sandwich norms, as Gemma 2's but Llama's RMSNorm):

      h ─► input_layernorm ─► attn ─► post_self_attn_layernorm ─► + ─► post_attention_layernorm
      └─────────────────────────── residual ──────────────────────┘
        ─► mlp ─► post_mlp_layernorm ─► + (residual)

The spec carries the data (registry.py `_glm`); loading and tensor parallelism are the
shared decoder's. These classes take the torch path on the CPU (the fused decode step
serves the shared classes only).
"""

from __future__ import annotations

import torch
from torch import nn

from pagellm.executor.model.attention import AttentionMetadata
from pagellm.executor.model.decoder import (
    DecoderAttention,
    DecoderForCausalLM,
    DecoderLayer,
    DecoderModel,
)
from pagellm.executor.model.deepseek import DeepseekMoeBlock
from pagellm.executor.model.layers import RMSNorm
from pagellm.executor.model.mlp import DecoderMLP
from pagellm.executor.model.parallel import TensorParallel
from pagellm.executor.model.rope import apply_rotary, halves_from_pairs
from pagellm.executor.model.spec import DecoderSpec
from pagellm.executor.model.weight_map import SKIP, Destination


class GlmAttention(DecoderAttention):
    """The shared attention with GLM's interleaved rotary pairs (module docstring)."""

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor
               ) -> torch.Tensor:
        """x: [T, H, D] -> its first rotary_dim dimensions reordered as halves, then
        rotated."""
        return apply_rotary(halves_from_pairs(x, cos.shape[-1]), cos, signed_sin)


class GlmDecoderLayer(DecoderLayer):
    attention_cls = GlmAttention


class GlmModel(DecoderModel):
    layer_cls = GlmDecoderLayer


class GlmForCausalLM(DecoderForCausalLM):
    """GLM-4 (glm-4-9b-chat-hf): Llama's layers with GLM's attention."""

    model_cls = GlmModel


class Ernie45MoeDecoderLayer(GlmDecoderLayer):
    moe_cls = DeepseekMoeBlock


class Ernie45MoeModel(DecoderModel):
    layer_cls = Ernie45MoeDecoderLayer


class Ernie45MoeForCausalLM(DecoderForCausalLM):
    """ERNIE 4.5 MoE: GLM's attention over whole heads with DeepSeek's routed and shared
    experts (softmax scores and a choice bias: registry.py `_ernie4_5_moe`); its
    checkpoints' multi-token-prediction tensors (`mtp*`, which transformers ignores too)
    are not loaded."""

    model_cls = Ernie45MoeModel

    def family_destination(self, name: str, params: dict[str, nn.Parameter]
                           ) -> Destination | None:
        """The shared map's, but for the multi-token-prediction tensors (not loaded) and
        the choice bias, which the checkpoint stores [1, E]."""
        if name.removeprefix("model.").startswith("mtp"):
            return SKIP
        dest = super().family_destination(name, params)
        if dest is not None and dest.tensor is not None \
                and name.endswith("e_score_correction_bias"):
            return Destination(dest.tensor.view(1, -1), (1, dest.tensor.shape[0]))
        return dest


class Glm4DecoderLayer(nn.Module):
    """One GLM-4-0414 layer: sandwich norms (module docstring)."""

    def __init__(self, spec: DecoderSpec, layer_idx: int, tp: TensorParallel) -> None:
        super().__init__()
        self.self_attn = GlmAttention(spec, layer_idx, tp)
        self.mlp = DecoderMLP(spec, tp)
        size, eps = spec.hidden_size, spec.rms_norm_eps
        self.input_layernorm = RMSNorm(size, eps)
        self.post_self_attn_layernorm = RMSNorm(size, eps)
        self.post_attention_layernorm = RMSNorm(size, eps)
        self.post_mlp_layernorm = RMSNorm(size, eps)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                residual: torch.Tensor | None, meta: AttentionMetadata,
                kv_caches: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, hidden], the previous layer's output not yet added to `residual` (None
        before the first layer) -> (this layer's output, likewise; the residual
        stream)."""
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(rope, h, meta, kv_caches)
        h, _ = self.post_self_attn_layernorm(h)
        h, residual = self.post_attention_layernorm(h, residual)
        h, _ = self.post_mlp_layernorm(self.mlp(h))
        return h, residual


class Glm4Model(DecoderModel):
    layer_cls = Glm4DecoderLayer


class Glm4ForCausalLM(DecoderForCausalLM):
    """GLM-4-0414 / GLM-Z1: GLM's attention in sandwich-normed layers."""

    model_cls = Glm4Model
