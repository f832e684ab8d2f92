"""Liquid AI's LFM2 (`Lfm2ForCausalLM`: LFM2-350M, 700M, 1.2B, 2.6B) and LFM2-MoE
(`Lfm2MoeForCausalLM`: LFM2-8B-A1B): attention layers between gated short convolutions,
a hybrid built for CPUs and phones.

What differs from the shared decoder (decoder.py), as transformers computes it:

- most layers (the spec's `short_conv.layers`) replace attention with a gated
  depthwise convolution over the last `kernel` tokens (3 in every release):

      B, C, x = in_proj(h).chunk(3)          # [T, hidden] each
      y = C * conv(B * x)                    # causal per channel: tokens t-K+1 .. t
      out = out_proj(y)

  Such a layer reads no KV cache. It keeps, per request, the last kernel - 1 inputs of
  its convolution (B * x): its *state*, [kernel - 1, hidden] per request, which the
  runner allocates beside the KV cache, one row per request of its batch
  (`state_shapes`), zeroed when a request starts. A step's chunk continues from it,
  however the prompt was split; so the state cannot be rebuilt from a cached prefix
  (the engine serves these models without prefix caching) or rolled back after
  rejected proposals (no speculative decoding);
- the attention layers are Qwen3's (per-head q/k RMSNorms), the MLP SwiGLU, the norms
  Llama's, each layer pre-norm with the residual added after each block;
- LFM2-MoE: after its first num_dense_layers, each layer's MLP is a mixture of experts
  routed as DeepSeek-V3's without groups or shared experts (deepseek.py's block: top-k
  by sigmoid score plus a float32 choice bias, the chosen scores renormalised with
  1e-6 added to their sum, times routed_scaling_factor, rounded to the model's dtype);
- the checkpoint's own names (`checkpoint_renames`): `operator_norm` / `ffn_norm`,
  `feed_forward.w1/w3/w2` (the experts' `feed_forward.experts.{e}.w1/w3/w2`, the router
  `feed_forward.gate`, the choice bias `feed_forward.expert_bias`),
  `self_attn.out_proj`, `q_layernorm`, `embedding_norm` (the final norm). Under tensor
  parallelism each rank convolves its slice of the channels (in_proj's B, C and x rows
  of them, out_proj's columns).

A step convolves all its requests at once (stateful.py's `ConvBatch`).
"""

from __future__ import annotations

import torch
from torch import nn

from pagellm.executor.model.attention import AttentionMetadata
from pagellm.executor.model.decoder import DecoderAttention, DecoderForCausalLM
from pagellm.executor.model.deepseek import DeepseekMoeBlock
from pagellm.executor.model.layers import Linear, RowParallelLinear
from pagellm.executor.model.parallel import TensorParallel
from pagellm.executor.model.spec import DecoderSpec, ShortConvSpec
from pagellm.executor.model.stateful import ConvBatch, Rope, StatefulLayer, StatefulModel
from pagellm.executor.model.weight_map import Destination


class ShortConv(nn.Module):
    """The gated short convolution (module docstring), over this rank's channels."""

    def __init__(self, spec: DecoderSpec, conv: ShortConvSpec, tp: TensorParallel) -> None:
        super().__init__()
        self.channels = channels = spec.hidden_size // tp.size
        self.in_proj = Linear(spec.hidden_size, 3 * channels, bias=conv.bias)
        # Only its parameters, [C, 1, K] and [C]: the checkpoint's names and shapes.
        self.conv = nn.Conv1d(channels, channels, conv.kernel, groups=channels,
                              bias=conv.bias)
        self.out_proj = RowParallelLinear(channels, spec.hidden_size, conv.bias, tp)

    def forward(self, x: torch.Tensor, batch: ConvBatch, state: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]; `state`: this layer's [rows, K - 1, C]."""
        b, c, h = self.in_proj(x).split(self.channels, dim=-1)  # [T, C] each
        y = c * batch.convolve(b * h, self.conv.weight, self.conv.bias, state)
        return self.out_proj(y)


class Lfm2DecoderLayer(StatefulLayer):
    """The mixer attention or a short convolution (stateful.py's layer); LFM2-MoE's
    experts DeepSeek's block."""

    moe_cls = DeepseekMoeBlock

    def __init__(self, spec: DecoderSpec, layer_idx: int, tp: TensorParallel) -> None:
        super().__init__(spec, layer_idx, tp)
        assert spec.short_conv is not None
        self.conv: ShortConv | None = None
        self.self_attn: DecoderAttention | None = None
        if spec.short_conv.layers[layer_idx]:
            self.conv = ShortConv(spec, spec.short_conv, tp)
        else:
            self.self_attn = DecoderAttention(spec, layer_idx, tp)

    def mix(self, rope: Rope, h: torch.Tensor, meta: AttentionMetadata,
            caches: list[torch.Tensor], batch: ConvBatch | None) -> torch.Tensor:
        if self.conv is not None:
            assert batch is not None
            return self.conv(h, batch, caches[self.layer_idx])
        assert self.self_attn is not None
        return self.self_attn(rope, h, meta, caches)


class Lfm2Model(StatefulModel):
    layer_cls = Lfm2DecoderLayer


class Lfm2ForCausalLM(DecoderForCausalLM):
    """LFM2 and LFM2-MoE: the shared causal LM (LM head, loading) around `Lfm2Model`,
    its checkpoint's names, and the convolutions' states and tensor-parallel slices."""

    model_cls = Lfm2Model
    checkpoint_renames = (
        (".self_attn.o_proj.", ".self_attn.out_proj."),
        (".self_attn.q_norm.", ".self_attn.q_layernorm."),
        (".self_attn.k_norm.", ".self_attn.k_layernorm."),
        # LFM2-MoE's choice bias (before the block's own rename)
        (".mlp.gate.e_score_correction_bias", ".feed_forward.expert_bias"),
        (".mlp.", ".feed_forward."),  # the MLP, or the MoE block: router, experts
        (".gate_proj.", ".w1."),
        (".up_proj.", ".w3."),
        (".down_proj.", ".w2."),
        (".input_layernorm.", ".operator_norm."),
        (".post_attention_layernorm.", ".ffn_norm."),
        (".model.norm.", ".model.embedding_norm."),
    )

    def state_shapes(self, rows: int) -> dict[int, tuple[tuple[int, ...], torch.dtype]]:
        """Each convolution layer's state: [rows, kernel - 1, this rank's channels] in the
        model's dtype (the inputs it holds are)."""
        conv = self.spec.short_conv
        assert conv is not None
        channels = self.spec.hidden_size // self.tp.size
        dtype = self.model.embed_tokens.weight.dtype
        return {i: ((rows, conv.kernel - 1, channels), dtype)
                for i, is_conv in enumerate(conv.layers) if is_conv}

    def family_destination(self, name: str, params: dict[str, nn.Parameter]
                           ) -> Destination | None:
        """The convolutions' tensors under tensor parallelism: in_proj's B, C and x rows of
        this rank's channels, the convolution's channels, out_proj's input columns (its
        bias whole); the rest is the shared map's."""
        tp = self.tp
        if tp.size == 1 or ".conv." not in name:
            return super().family_destination(name, params)
        param = params.get(name)
        if param is None:
            return None
        channels, hidden = param.shape[0] // 3, self.spec.hidden_size
        if ".in_proj." in name:  # rows [B | C | x], each [hidden, ...] in the checkpoint
            shape = (3 * hidden, *param.shape[1:])
            return Destination(param, shape, parts=tuple(
                Destination(param[i * channels:(i + 1) * channels], shape, 0,
                            i * hidden + tp.rank * channels, channels) for i in range(3)))
        if ".conv.conv." in name:  # [C, 1, K] / [C]
            width = param.shape[0]
            return Destination(param, (hidden, *param.shape[1:]), 0, tp.rank * width, width)
        if name.endswith("out_proj.weight"):  # row parallel: this rank's input columns
            width = param.shape[1]
            return Destination(param, (hidden, hidden), 1, tp.rank * width, width)
        return Destination(param, tuple(param.shape))  # out_proj's bias, added once
