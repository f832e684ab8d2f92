"""Granite 3.x (`GraniteForCausalLM`, IBM): Llama's decoder with four scalars, as
transformers' Granite computes them:

- the embedding times `embedding_multiplier`;
- each block's output (attention, MLP) times `residual_multiplier` before it joins the
  residual stream (rounded to the model's dtype there, then added, as transformers'
  `residual + h * m`);
- the attention scores scaled by `attention_multiplier` instead of head_dim ** -0.5
  (spec attn_scale);
- the logits divided by `logits_scaling`.

The spec carries them (`Multipliers`, registry.py `_granite`); names, loading and tensor
parallelism are the shared decoder's.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from pagellm.executor.model.attention import AttentionMetadata
from pagellm.executor.model.decoder import DecoderForCausalLM, DecoderLayer, DecoderModel
from pagellm.executor.model.parallel import TensorParallel
from pagellm.executor.model.spec import DecoderSpec, Multipliers


def _multipliers(spec: DecoderSpec) -> Multipliers:
    assert spec.multipliers is not None  # registry.py's reader sets them
    return spec.multipliers


class GraniteDecoderLayer(DecoderLayer):
    """The shared layer, its blocks' outputs scaled before the residual add."""

    def __init__(self, spec: DecoderSpec, layer_idx: int, tp: TensorParallel) -> None:
        super().__init__(spec, layer_idx, tp)
        self.residual_multiplier = _multipliers(spec).residual

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                residual: torch.Tensor | None, meta: AttentionMetadata,
                kv_caches: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """See DecoderLayer.forward; x: [T, hidden], this layer's input not yet added
        to `residual`."""
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(rope, h, meta, kv_caches) * self.residual_multiplier
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h) * self.residual_multiplier, residual


class GraniteModel(DecoderModel):
    layer_cls: ClassVar[type[nn.Module]] = GraniteDecoderLayer

    def __init__(self, spec: DecoderSpec, tp: TensorParallel,
                 max_model_len: int | None = None) -> None:
        super().__init__(spec, tp, max_model_len)
        self.embedding_multiplier = _multipliers(spec).embedding

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding times embedding_multiplier."""
        return self.embed_tokens(input_ids) * self.embedding_multiplier


class GraniteForCausalLM(DecoderForCausalLM):
    """Granite: the shared causal LM around `GraniteModel`, its logits divided by
    logits_scaling."""

    model_cls = GraniteModel

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden_size] -> logits [N, vocab_size] / logits_scaling."""
        return super().compute_logits(hidden) / _multipliers(self.spec).logits_scaling
