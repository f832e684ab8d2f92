"""gpt-oss (OpenAI's gpt-oss-20b / gpt-oss-120b): the decoder with gpt-oss's MoE, norms
and checkpoint layout.

What differs from the shared decoder (decoder.py), as transformers computes it:

- attention sinks: a learned logit per query head in every softmax's denominator, so a
  head may attend to nothing (the spec's `attn_sinks`: the shared attention block holds
  them, every attention backend applies them; kernels/reference.py);
- sliding-window (128) and full-attention layers alternating per `layer_types`, q/k/v
  and o_proj biases, YaRN RoPE: the shared decoder's, from the spec;
- RMSNorm multiplies its weight in fp32 before rounding to the model's dtype
  (`GptOssRMSNorm`; transformers keeps gpt-oss's norms in fp32);
- the MoE block (`GptOssMoeBlock`): a router with a bias, top-k over its logits and a
  softmax over those k (in the model's dtype), every layer sparse; experts with biases
  and a clamped SwiGLU, (up + 1) * gate * sigmoid(alpha * gate) with gate <= limit and
  |up| <= limit (`MoeSpec.swiglu`).

The checkpoint stores each layer's experts stacked under our own names, in its layout:

    mlp.experts.gate_up_proj       [E, H, 2I]  x @ W; columns 2i the gate's, 2i + 1 up's
    mlp.experts.gate_up_proj_bias  [E, 2I]     interleaved alike
    mlp.experts.down_proj          [E, I, H]
    mlp.experts.down_proj_bias     [E, H]

`expert_destination` turns them into the shared experts' layout (moe.py: [E, 2I, H]
with the gate's rows first, [E, H, I]) as they load, this rank's I-slice of each
(tensor parallelism), so quantize-on-load, sleep and weight updates (RL trainers send
these names) work on them as on any MoE. The down projection's bias is added by rank 0
only: the ranks' partial outputs are summed by the layer's all-reduce.

OpenAI's own checkpoints store the experts as MXFP4 (`quant_method: "mxfp4"`: each
stacked weight as `<name>_blocks` and `<name>_scales` in the [E, N, K] orientation;
kernels/mxfp4.py). `load_weights` pairs the two and loads the weight they stand for
(exact in bf16 and fp32), in the bf16 checkpoints' layout, so everything above applies;
`quantization="int8"` / `"int4"` then packs it on load.

On the CPU an fp32 model's decode steps run in the fused C++ step
(executor/worker/cpu_decode.py: sinks, biases and the clamped SwiGLU there too); a bf16
one takes the torch path (its norms and experts round where the shared decoder's do
not).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from pagellm.executor.model.decoder import DecoderForCausalLM, DecoderLayer, DecoderModel
from pagellm.executor.model.layers import Fp32ScaledRMSNorm, Linear
from pagellm.executor.model.moe import Experts
from pagellm.executor.model.parallel import TensorParallel
from pagellm.executor.model.spec import DecoderSpec, MoeSpec
from pagellm.executor.model.weight_map import Destination
from pagellm.kernels import mxfp4


class GptOssRMSNorm(Fp32ScaledRMSNorm):
    """RMSNorm with the weight multiplied in fp32, then rounded (transformers'
    GptOssRMSNorm; the shared one rounds first)."""


class GptOssExperts(Experts):
    """The shared stacked experts (moe.py: packed on load like any) with gpt-oss's
    biases and clamped SwiGLU (module docstring)."""

    def __init__(self, moe: MoeSpec, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__(moe, hidden_size, tp)
        assert moe.swiglu is not None
        self.alpha, self.limit = moe.swiglu
        self.gate_up_proj_bias = nn.Parameter(torch.empty(moe.num_experts,
                                                          2 * self.intermediate_size))
        self.down_proj_bias = nn.Parameter(torch.empty(moe.num_experts, hidden_size))
        self.adds_down_bias = tp.rank == 0  # once, before the all-reduce

    def mlp(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e: x [n, H] -> [n, H], each op in x's dtype as transformers'."""
        size = self.intermediate_size
        gate_up = self.gate_up(e, x) + self.gate_up_proj_bias[e]  # [n, 2I]
        gate = gate_up[:, :size].clamp(max=self.limit)
        up = gate_up[:, size:].clamp(-self.limit, self.limit)
        h = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))  # [n, I]
        out = self.down(e, h)
        return out + self.down_proj_bias[e] if self.adds_down_bias else out

    def fused_biases(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(gate_up bias [E, 2I], down bias [E, H] or None off rank 0) for the fused
        MoE kernel."""
        return self.gate_up_proj_bias, self.down_proj_bias if self.adds_down_bias else None


class GptOssMoeBlock(nn.Module):
    """Router (with bias) -> top-k logits -> softmax over the k, in the model's dtype
    (transformers' GptOssTopKRouter) -> the chosen experts, weighted and summed."""

    def __init__(self, spec: DecoderSpec, tp: TensorParallel) -> None:
        super().__init__()
        assert spec.moe is not None
        self.moe = spec.moe
        self.tp = tp
        self.router = Linear(spec.hidden_size, spec.moe.num_experts, bias=True)
        self.experts = GptOssExperts(spec.moe, spec.hidden_size, tp)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, K] in x's dtype, expert ids [T, K] int64)."""
        top, ids = torch.topk(self.router(x), self.moe.top_k, dim=-1)
        return torch.softmax(top, dim=-1, dtype=top.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H], summed over the ranks."""
        weights, ids = self.route(x)
        return self.tp.all_reduce(self.experts(x, weights, ids))


class GptOssDecoderLayer(DecoderLayer):
    """The shared layer (its attention block takes the sinks from the spec) with
    gpt-oss's norms and MoE block."""

    norm_cls = GptOssRMSNorm
    moe_cls = GptOssMoeBlock


class GptOssModel(DecoderModel):
    layer_cls = GptOssDecoderLayer
    norm_cls = GptOssRMSNorm


class GptOssForCausalLM(DecoderForCausalLM):
    """The shared causal LM (tensor parallelism, the LM head, loading) around
    `GptOssModel`, with the experts' checkpoint layout mapped (`expert_destination`)."""

    model_cls = GptOssModel

    def family_destination(self, name: str, params: dict[str, nn.Parameter]
                           ) -> Destination | None:
        dest = expert_destination(name, params, self.spec, self.tp)
        return dest if dest is not None else super().family_destination(name, params)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The shared `load_weights`, an MXFP4 checkpoint's experts dequantized first
        (`dequantized_experts`)."""
        dtype = self.model.embed_tokens.weight.dtype
        return super().load_weights(dequantized_experts(weights, dtype))


_MXFP4 = re.compile(r"(.+\.mlp\.experts\.(?:gate_up_proj|down_proj))_(blocks|scales)")


def dequantized_experts(weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights` with each MXFP4 expert weight's blocks and scales (in either order,
    anywhere in the stream) replaced by the weight they stand for, in `dtype` and the
    bf16 checkpoints' layout ([E, N, K] transposed: x @ W). ValueError naming what is
    left unpaired at the end."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        m = _MXFP4.fullmatch(name)
        if m is None:
            yield name, tensor
            continue
        parts = pending.setdefault(m[1], {})
        parts[m[2]] = tensor
        if len(parts) == 2:
            del pending[m[1]]
            yield m[1], mxfp4.dequantize(parts["blocks"], parts["scales"], dtype,
                                         m[1]).transpose(1, 2)
    if pending:
        unpaired = [f"{name}_{next(iter(parts))}" for name, parts in pending.items()]
        raise ValueError(f"MXFP4 experts without their blocks or scales: {unpaired[:4]}")


_EXPERTS = re.compile(r".+\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?")


def expert_destination(name: str, params: dict[str, nn.Parameter], spec: DecoderSpec,
                       tp: TensorParallel) -> Destination | None:
    """Where a gpt-oss expert tensor loads on rank `tp` (module docstring); None for any
    other name."""
    if _EXPERTS.fullmatch(name) is None or (param := params.get(name)) is None:
        return None
    assert spec.moe is not None
    experts, hidden, full = spec.moe.num_experts, spec.hidden_size, spec.moe.intermediate_size
    size = tp.moe_intermediate_size
    start = tp.rank * size
    layout: Callable[[torch.Tensor], torch.Tensor]
    if name.endswith("gate_up_proj"):  # [E, H, 2I] -> [E, 2, I, H]: gate rows, up rows
        def layout(t: torch.Tensor) -> torch.Tensor:
            return t.view(experts, hidden, full, 2).permute(0, 3, 2, 1)

        return Destination(param.view(experts, 2, size, hidden), (experts, hidden, 2 * full),
                           2, start, size, layout=layout)
    if name.endswith("gate_up_proj_bias"):  # [E, 2I] -> [E, 2, I]
        def layout(t: torch.Tensor) -> torch.Tensor:
            return t.view(experts, full, 2).transpose(1, 2)

        return Destination(param.view(experts, 2, size), (experts, 2 * full), 2, start, size,
                           layout=layout)
    if name.endswith("down_proj"):  # [E, I, H] -> [E, H, I]: this rank's columns
        return Destination(param, (experts, full, hidden), 2, start, size,
                           layout=lambda t: t.transpose(1, 2))
    return Destination(param, (experts, hidden))  # down_proj_bias: whole on every rank
