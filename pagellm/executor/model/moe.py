"""The sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral, OLMoE): a router picks each
token's top-k experts, each a SwiGLU MLP, and their outputs are summed with the routing
weights.

The experts' weights are stacked, as transformers 5 holds them in memory and as vLLM's
fused MoE reads them:

    experts.gate_up_proj [E, 2 * I, H]   rows [:I] expert e's gate projection, [I:] its up
    experts.down_proj    [E, H, I]

(checkpoints store one tensor per expert and projection; weight_map.py loads them into
these slices). Under tensor parallelism each rank holds the same I-slice of every expert
(Megatron's layout applied per expert, as vLLM's TP for MoE), so the rank's partial
outputs are summed by the layer's one all-reduce, as for the dense MLP.

The experts compute only for the tokens that chose them:
- CUDA: kernels/triton_moe.py's fused MoE (vLLM's design: the (token, slot) pairs
  grouped by expert on the device, a grouped GEMM for gate/up with SiLU-and-mul, one for
  down with the routing weight, a fixed-order sum over the k slots; no host sync, so
  decode steps run in CUDA graphs);
- CPU: the (token, slot) pairs grouped by expert, each chosen expert's rows one GEMM per
  projection (`linear`, the CPU's choice of kernel), summed in expert order as
  transformers does (its `index_add_` per expert), so fp32 outputs match it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.executor.model.layers import Linear
from pagellm.executor.model.linear import linear
from pagellm.executor.model.parallel import TensorParallel
from pagellm.executor.model.spec import DecoderSpec, MoeSpec


class Experts(nn.Module):
    """This rank's slice of every expert's weights, stacked (module docstring)."""

    def __init__(self, moe: MoeSpec, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.intermediate_size = size = tp.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(moe.num_experts, 2 * size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(moe.num_experts, hidden_size, size))


class SparseMoeBlock(nn.Module):
    def __init__(self, spec: DecoderSpec, tp: TensorParallel) -> None:
        super().__init__()
        assert spec.moe is not None
        self.moe = spec.moe
        self.tp = tp
        self.gate = Linear(spec.hidden_size, spec.moe.num_experts, bias=False)  # the router
        self.experts = Experts(spec.moe, spec.hidden_size, tp)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, K] float32, or x's dtype where the family rounds
        them; expert ids [T, K] int64): softmax over all experts in float32, then top-k,
        renormalised over the k where the family does."""
        probs = F.softmax(self.gate(x).float(), dim=-1)  # [T, E]
        weights, ids = torch.topk(probs, self.moe.top_k, dim=-1)
        if self.moe.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.moe.weights_in_model_dtype:
            weights = weights.to(x.dtype)
        return weights, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H], summed over the ranks."""
        weights, ids = self.route(x)
        if x.is_cuda:
            from pagellm.kernels.triton_moe import fused_moe

            out = fused_moe(x.contiguous(), self.experts.gate_up_proj,
                            self.experts.down_proj, weights.float(), ids)
        else:
            out = experts_grouped(x, self.experts.gate_up_proj, self.experts.down_proj,
                                  weights, ids)
        return self.tp.all_reduce(out)


def experts_grouped(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The experts on the CPU, one GEMM per chosen expert and projection.

    x [T, H]; w13 [E, 2I, H]; w2 [E, H, I]; weights [T, K]; ids [T, K] -> [T, H] in x's
    dtype. The (token, slot) pairs are sorted by expert once (a stable sort: tokens keep
    their order within an expert), so each chosen expert reads its rows as one slice;
    experts no token chose cost nothing."""
    top_k = ids.shape[1]
    size = w2.shape[2]
    order = torch.argsort(ids.reshape(-1), stable=True)  # [T * K] pairs by expert
    counts = torch.bincount(ids.reshape(-1), minlength=w13.shape[0]).tolist()
    token_of = order // top_k  # [T * K]
    pair_weights = weights.reshape(-1)[order]  # [T * K]
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if not count:
            continue
        rows = token_of[start:start + count]
        gate_up = linear(x[rows], w13[expert])  # [n, 2I]
        h = linear(F.silu(gate_up[:, :size]) * gate_up[:, size:], w2[expert])  # [n, H]
        # index_put_ with accumulate, not index_add_: the same sums (a token appears once
        # per expert), but torch 2.13's CPU index_add_ took ~2 ms for a few 2048-wide rows
        # (53% of a Qwen3-MoE-shaped step in torch's profiler), index_put_ ~9 us.
        out.index_put_((rows,), (h * pair_weights[start:start + count, None]).to(x.dtype),
                       accumulate=True)
        start += count
    return out
