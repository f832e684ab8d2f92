"""IBM's Granite 4.0 (`GraniteMoeHybridForCausalLM`): the hybrids Granite-4.0-H-Micro,
-Tiny and -Small (Mamba-2 layers, mamba2.py, around a few attention layers that use no
RoPE) and the dense Granite-4.0-Micro (every layer attending, with RoPE), as
transformers' GraniteMoeHybrid computes them:

- Granite 3.x's four scalars (granite.py): the embedding times embedding_multiplier,
  each block's output times residual_multiplier before it joins the residual stream,
  the attention scaled by attention_multiplier, the logits divided by logits_scaling;
- RoPE only where position_embedding_type is "rope" (the hybrids attend without it:
  their Mamba-2 layers carry the order);
- the MLP: a shared SwiGLU MLP every token runs (shared_intermediate_size wide), plus,
  where num_local_experts > 0, top-k experts (a softmax over the chosen experts' router
  logits; moe.py's block: softmax, top-k, renormalised) whose sum is added to it,
  ungated.

Checkpoint names (`checkpoint_renames`): the shared MLP `shared_mlp.input_linear` (gate
and up fused, our merged gate_up_proj) and `shared_mlp.output_linear`; the experts
stacked as `block_sparse_moe.input_linear` [E, 2I, H] and `output_linear` [E, H, I], the
router `block_sparse_moe.router.layer` (transformers 5's in-memory names, which RL
trainers send, `block_sparse_moe.experts.gate_up_proj` and `router.weight`, load too);
the Mamba-2 layers' `mamba.*`. Each layer keeps its state per request as mamba2.py
says, so the hybrids are served without prefix caching or speculative decoding.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from pagellm.executor.model.attention import AttentionMetadata
from pagellm.executor.model.decoder import DecoderAttention
from pagellm.executor.model.granite import GraniteForCausalLM, GraniteModel
from pagellm.executor.model.mamba2 import Mamba2Mixer, mamba_destination
from pagellm.executor.model.mlp import DecoderMLP
from pagellm.executor.model.moe import SparseMoeBlock
from pagellm.executor.model.parallel import TensorParallel
from pagellm.executor.model.spec import DecoderSpec
from pagellm.executor.model.stateful import ConvBatch, Rope, StatefulLayer, StatefulModel
from pagellm.executor.model.weight_map import Destination


class SharedMLP(nn.Module):
    """The MLP of a layer without experts: the shared MLP alone, under the name it has
    beside experts (so one set of checkpoint renames serves both)."""

    def __init__(self, spec: DecoderSpec, tp: TensorParallel) -> None:
        super().__init__()
        self.shared_expert = DecoderMLP(spec, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared_expert(x)


class GraniteMoeBlock(SparseMoeBlock):
    """The experts plus the shared MLP, ungated (module docstring)."""

    def __init__(self, spec: DecoderSpec, tp: TensorParallel) -> None:
        super().__init__(spec, tp)
        self.shared_expert_gate = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H], summed over the ranks."""
        assert self.shared_expert is not None
        weights, ids = self.route(x)
        return self.tp.all_reduce(self.experts(x, weights, ids)) + self.shared_expert(x)


class GraniteMoeHybridDecoderLayer(StatefulLayer):
    """The mixer Mamba-2 or attention (stateful.py's layer), the blocks' outputs scaled
    by residual_multiplier before they join the residual stream."""

    moe_cls = GraniteMoeBlock

    def __init__(self, spec: DecoderSpec, layer_idx: int, tp: TensorParallel) -> None:
        super().__init__(spec, layer_idx, tp)
        assert spec.multipliers is not None
        self.residual_multiplier = spec.multipliers.residual
        self.mamba: Mamba2Mixer | None = None
        self.self_attn: DecoderAttention | None = None
        if spec.mamba is not None and spec.mamba.layers[layer_idx]:
            self.mamba = Mamba2Mixer(spec, spec.mamba, tp)
        else:
            self.self_attn = DecoderAttention(spec, layer_idx, tp)

    def make_mlp(self, spec: DecoderSpec, layer_idx: int, tp: TensorParallel) -> nn.Module:
        return GraniteMoeBlock(spec, tp) if spec.moe is not None else SharedMLP(spec, tp)

    def forward(self, rope: Rope, x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata, caches: list[torch.Tensor],
                batch: ConvBatch | None) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm(x, residual)
        h = self.mix(rope, h, meta, caches, batch) * self.residual_multiplier
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h) * self.residual_multiplier, residual

    def mix(self, rope: Rope, h: torch.Tensor, meta: AttentionMetadata,
            caches: list[torch.Tensor], batch: ConvBatch | None) -> torch.Tensor:
        if self.mamba is not None:
            assert batch is not None
            return self.mamba(h, batch, meta, caches[self.layer_idx])
        assert self.self_attn is not None
        return self.self_attn(rope, h, meta, caches)


class GraniteMoeHybridModel(GraniteModel, StatefulModel):
    """Granite's scaled embedding (granite.py) over the stateful layers."""

    layer_cls = GraniteMoeHybridDecoderLayer


_MAMBA = re.compile(r".+\.mamba\.(in_proj|conv1d|out_proj|dt_bias|A_log|D|norm)"
                    r"(?:\.weight|\.bias)?")


class GraniteMoeHybridForCausalLM(GraniteForCausalLM):
    """Granite 4.0: Granite's logits over `GraniteMoeHybridModel`, its checkpoint names,
    the Mamba-2 layers' states and tensor-parallel slices."""

    model_cls = GraniteMoeHybridModel
    checkpoint_renames = (
        (".mlp.experts.gate_up_proj", ".block_sparse_moe.input_linear.weight"),
        (".mlp.experts.down_proj", ".block_sparse_moe.output_linear.weight"),
        (".mlp.gate.weight", ".block_sparse_moe.router.layer.weight"),
        # transformers 5's in-memory names (a trainer's), read only: the rules above
        # have already renamed our side
        (".mlp.experts.", ".block_sparse_moe.experts."),
        (".mlp.gate.weight", ".block_sparse_moe.router.weight"),
        (".mlp.shared_expert.gate_up_proj.", ".shared_mlp.input_linear."),
        (".mlp.shared_expert.down_proj.", ".shared_mlp.output_linear."),
    )

    def state_shapes(self, rows: int) -> dict[int, tuple[tuple[int, ...], torch.dtype]]:
        """Each Mamba-2 layer's state: [rows, Mamba2Mixer.state_size()], float32 (the
        memory accumulates; the convolution's inputs are exact in it)."""
        return {i: ((rows, layer.mamba.state_size()), torch.float32)
                for i, layer in enumerate(self.model.layers)
                if isinstance(layer, GraniteMoeHybridDecoderLayer) and layer.mamba is not None}

    def family_destination(self, name: str, params: dict[str, nn.Parameter]
                           ) -> Destination | None:
        """The Mamba-2 layers' tensors on this rank (mamba2.py); the rest is the shared
        map's."""
        if (m := _MAMBA.fullmatch(name)) is not None:
            param = params.get(name)
            if param is None or self.spec.mamba is None:
                return None
            return mamba_destination(m[1], param, self.spec.mamba, self.tp)
        return super().family_destination(name, params)
