"""SmolLM3 (`SmolLM3ForCausalLM`, Hugging Face's 3B): Llama's decoder with NoPE layers.

Every `no_rope_layer_interval`-th layer (config.json's `no_rope_layers`: 1 rotates, 0
does not) attends without positional rotation: its queries and keys enter attention as
projected (transformers' SmolLM3Attention skips apply_rotary_pos_emb there). The layer
hands its attention a RoPE table of width 0, which `apply_rotary` passes through
untouched, so the shared attention (every backend, the CUDA graphs) serves both kinds;
the spec carries which layers rotate (`DecoderSpec.rope_layers`, registry.py
`_smollm3`). Everything else (names, loading, tensor parallelism, sliding windows where
`use_sliding_window`) is the shared decoder's.
"""

from __future__ import annotations

import torch

from pagellm.executor.model.attention import AttentionMetadata
from pagellm.executor.model.decoder import DecoderForCausalLM, DecoderLayer, DecoderModel
from pagellm.executor.model.parallel import TensorParallel
from pagellm.executor.model.spec import DecoderSpec


class SmolLM3DecoderLayer(DecoderLayer):
    """The shared layer; a NoPE layer's attention gets a RoPE table of width 0."""

    def __init__(self, spec: DecoderSpec, layer_idx: int, tp: TensorParallel) -> None:
        super().__init__(spec, layer_idx, tp)
        self.rotates = spec.rotates(layer_idx)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                residual: torch.Tensor | None, meta: AttentionMetadata,
                kv_caches: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """rope: cos, signed sin [T, 1, rotary_dim]; see DecoderLayer.forward."""
        if not self.rotates:
            rope = (rope[0][..., :0], rope[1][..., :0])  # [T, 1, 0]: nothing rotates
        return super().forward(rope, x, residual, meta, kv_caches)


class SmolLM3Model(DecoderModel):
    layer_cls = SmolLM3DecoderLayer


class SmolLM3ForCausalLM(DecoderForCausalLM):
    """SmolLM3: the shared causal LM around `SmolLM3Model`."""

    model_cls = SmolLM3Model
