"""The layers the decoder is built from, with nothing of one family in them.

`Linear` (every GEMM through `linear`, the CPU's choice of kernel), `RMSNorm` (fp32,
fused with the residual add; one Triton kernel on CUDA), and the two tensor-parallel
layers that end in an all-reduce: `RowParallelLinear` and `VocabParallelEmbedding`
(executor/model/parallel.py has the layout). A new model family builds its attention
block and MLP from these.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.executor.model.linear import linear
from pagellm.executor.model.parallel import TensorParallel
from pagellm.executor.model.quantize import quantized_linear, quantized_silu_and_mul
from pagellm.kernels import fused_for

if TYPE_CHECKING:
    from pagellm.executor.model.lora_slots import LoRASlots
    from pagellm.executor.model.quantize import Quantized


class Linear(nn.Linear):
    """nn.Linear through `linear`, plus the step's LoRA updates where the engine serves
    adapters (`lora`, set by the worker's LoRAManager: lora_slots.py); through the
    weight-only int4/int8 kernel where the engine quantized it on load (`quant`:
    quantize.py)."""

    lora: LoRASlots | None = None
    quant: Quantized | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = (linear(x, self.weight, self.bias) if self.quant is None
             else quantized_linear(x, self.quant, self.bias))
        if self.lora is not None:
            self.lora.add_to(x, y)
        return y

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """F.silu(gate) * up of this [gate | up] projection in one kernel where its
        weight's kernel fuses the activation (quantize.quantized_silu_and_mul), else
        None: the caller runs `forward` and the activation."""
        if self.quant is None or self.lora is not None or self.bias is not None:
            return None
        return quantized_silu_and_mul(x, self.quant)


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, optionally fused with the residual add before it."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(x + residual), x + residual); x: [..., size]. On CUDA a [T, size]
        x takes one fused kernel (kernels/triton_fused.py) instead of nine."""
        fused = fused_for(x) if x.dim() == 2 else None
        if fused is not None:
            return fused.rms_norm(x, self.weight, self.eps, residual)
        return self.reference(x, residual)

    def reference(self, x: torch.Tensor, residual: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` in torch ops: the CPU path and the fused kernel's reference."""
        h, x = self.normalized(x, residual)
        return self.weight * h.to(x.dtype), x

    def normalized(self, x: torch.Tensor, residual: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual normalised, in fp32 and not yet scaled; x + residual): what
        every family's RMSNorm shares before it scales and rounds its own way."""
        if residual is not None:
            x = x + residual
        h = x.float()
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps), x


class Fp32ScaledRMSNorm(RMSNorm):
    """RMSNorm scaled in fp32, then rounded (OLMo's order; Gemma's with its (1 + w)
    scale), where Llama's rounds first: torch ops on every device (the fused CUDA kernel
    rounds the Llama way)."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(x + residual), x + residual); x: [..., size]."""
        return self.reference(x, residual)

    def reference(self, x: torch.Tensor, residual: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        h, x = self.normalized(x, residual)
        return self.scaled(h).to(x.dtype), x

    def scaled(self, h: torch.Tensor) -> torch.Tensor:
        """The normalised fp32 `h` times the weight, still in fp32."""
        return self.weight * h


class ShardedRMSNorm(nn.Module):
    """RMSNorm over a vector of which this rank holds a slice (OLMoE's q/k norms span all
    heads): the mean square is summed over the ranks (`replicas`: how many ranks hold
    the same slice, whose sums count once). One rank computes transformers' own mean."""

    def __init__(self, size: int, full_size: int, eps: float, tp: TensorParallel,
                 replicas: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps, self.full_size, self.tp, self.replicas = eps, full_size, tp, replicas

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, size] -> [T, size]: normalised, rounded to x's dtype, then scaled
        (Llama's order, OLMoE's norms)."""
        return self.weight * self.normalized(x).to(x.dtype)

    def normalized(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, size] -> [T, size] normalised by the mean square over the whole vector,
        in fp32, not yet scaled."""
        h = x.float()
        if self.tp.size == 1:
            mean_square = h.pow(2).mean(-1, keepdim=True)
        else:
            total = self.tp.all_reduce(h.pow(2).sum(-1, keepdim=True))
            mean_square = total / (self.replicas * self.full_size)
        return h * torch.rsqrt(mean_square + self.eps)


class RowParallelLinear(nn.Module):
    """y = x W^T (+ b) where each rank holds W's columns for its slice of x: the partial
    products are summed by one all-reduce, then the (replicated) bias is added once."""

    lora: LoRASlots | None = None  # as Linear's; partial updates sum in the all-reduce
    quant: Quantized | None = None  # as Linear's: this rank's slice

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 tp: TensorParallel) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in_features] (this rank's slice) -> [T, out_features] (the full sum)."""
        if self.tp.size == 1:
            y = self._matmul(x, self.bias)
            if self.lora is not None:
                self.lora.add_to(x, y)
            return y
        y = self._matmul(x, None)
        if self.lora is not None:
            self.lora.add_to(x, y)
        y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias


    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quant is not None:
            return quantized_linear(x, self.quant, bias)
        return linear(x, self.weight, bias)


class VocabParallelEmbedding(nn.Module):
    """Each rank holds `tp.vocab_size` rows from `tp.vocab_start`; ids outside them look
    up zeros, and one all-reduce assembles every token's row."""

    def __init__(self, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(tp.vocab_size, hidden_size))
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [T] -> [T, hidden_size]."""
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.tp.vocab_start
        outside = (local < 0) | (local >= self.tp.vocab_size)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill(outside.unsqueeze(-1), 0))
