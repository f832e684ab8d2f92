"""The gated MLP of the decoder family (decoder.py's dense layers, Gemma's, and the
shared expert of a Qwen2-MoE layer, moe.py): its own module so that both the decoder and
the MoE block build it without importing each other."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.executor.model.layers import Linear, RowParallelLinear
from pagellm.executor.model.parallel import TensorParallel
from pagellm.executor.model.spec import DecoderSpec
from pagellm.kernels import fused_for


class DecoderMLP(nn.Module):
    """The gated MLP: down(act(gate(x)) * up(x)), act SiLU (SwiGLU) or GELU with the tanh
    approximation (GeGLU: Gemma's gelu_pytorch_tanh, torch's own op as transformers')."""

    def __init__(self, spec: DecoderSpec, tp: TensorParallel,
                 intermediate_size: int | None = None) -> None:
        """`intermediate_size`: this rank's columns (default the dense MLP's; a shared
        expert's, moe.py)."""
        super().__init__()
        self.intermediate_size = size = intermediate_size or tp.intermediate_size
        self.act = spec.hidden_act
        self.gate_up_proj = Linear(spec.hidden_size, 2 * size, bias=False)
        self.down_proj = RowParallelLinear(size, spec.hidden_size, False, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act == "gelu_pytorch_tanh":
            gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
            return self.down_proj(F.gelu(gate, approximate="tanh") * up)
        act = self.gate_up_proj.silu_and_mul(x)  # the projection's kernel fuses it, or None
        if act is None:
            gate_up = self.gate_up_proj(x)  # [T, 2 * intermediate]
            fused = fused_for(gate_up)
            if fused is not None:  # one kernel instead of two (kernels/triton_fused.py)
                act = fused.silu_and_mul(gate_up)
            else:
                gate, up = gate_up.split(self.intermediate_size, dim=-1)
                act = F.silu(gate) * up
        return self.down_proj(act)
