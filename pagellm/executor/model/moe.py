"""The sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE): a router
picks each token's top-k experts, each a SwiGLU MLP, and their outputs are summed with
the routing weights; Qwen2-MoE adds a shared expert every token runs, gated by
sigmoid(shared_expert_gate(x)).

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
  transformers does (its `index_add_` per expert), so fp32 outputs match it. Decode
  steps run the same arithmetic in C++ (executor/worker/cpu_decode.py's fused step).

`quantization="int4"` / `"int8"` packs the experts too (`quantize_experts`; an integer
checkpoint's quantized experts load packed: quantized_checkpoint.py): each stacked
weight's E * N rows become one packed weight (`ExpertCodes`), expert e's rows e * N to
(e + 1) * N, so an expert's weight is a slice of the codes. On the CPU it is a
CpuIntWeight (N a multiple of the kernel's 16 rows: an expert owns whole tiles),
computed by the CPU's int kernel as the dense projections are; with the Triton kernels
a PackedWeight, which the fused MoE kernel dequantizes tile by tile (and, on the CPU
under the interpreter, each expert's slice runs the weight-only Triton GEMM). In a MoE
model the experts are nearly all the bytes (Qwen3-30B-A3B: 29 of its 30B weights): a
quantized model whose experts stayed fp32 would keep almost all of its size.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.executor.model.layers import Linear
from pagellm.executor.model.linear import linear
from pagellm.executor.model.mlp import DecoderMLP
from pagellm.executor.model.parallel import TensorParallel
from pagellm.executor.model.quantize import (
    empty_cpu_int,
    empty_packed,
    group_size_for,
    in_huge_pages,
    placeholder,
    quantized_linear,
    quantized_silu_and_mul,
)
from pagellm.executor.model.spec import DecoderSpec, MoeSpec
from pagellm.kernels import cpu_int_gemm
from pagellm.kernels.cpu_int_gemm import CpuIntWeight
from pagellm.kernels.quant import PackedWeight, quantize


class ExpertCodes(nn.Module):
    """A stacked expert weight [E, N, K] as integer codes: `quant` holds all E * N rows,
    expert e's rows e * N to (e + 1) * N (module docstring): in the CPU int kernel's
    layout (expert e's the tiles from e * N / 16), or kernels/quant.py's for the Triton
    kernels. A module of its own so that what finds packed weights by their `quant`
    (sleep's backups, the loader's sizes, weight updates' requantizing) finds these
    too."""

    def __init__(self, quant: CpuIntWeight | PackedWeight, experts: int) -> None:
        super().__init__()
        self.quant = quant
        self.rows = quant.out_features // experts  # N
        assert self.rows * experts == quant.out_features, (quant.shape, experts)
        assert isinstance(quant, PackedWeight) or self.rows % cpu_int_gemm.TILE == 0

    def expert(self, e: int) -> CpuIntWeight | PackedWeight:
        """Expert e's weight [N, K]: views of its rows (taken at each call: sleep and
        wake swap the tensors' storage)."""
        q = self.quant
        if isinstance(q, PackedWeight):
            return q.narrow(0, e * self.rows, self.rows)
        tiles = self.rows // cpu_int_gemm.TILE
        part = slice(e * tiles, (e + 1) * tiles)
        return CpuIntWeight(q.codes[part], q.scales[part], q.zeros[part], q.bits,
                            q.group_size, self.rows)


class Experts(nn.Module):
    """This rank's slice of every expert's weights, stacked (module docstring); packed
    as integer codes (`gate_up_codes`, `down_codes`; the parameters then meta
    placeholders) where quantized on load or by the checkpoint."""

    def __init__(self, moe: MoeSpec, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.intermediate_size = size = tp.moe_intermediate_size
        self.shards = tp.size  # down_proj's K is a slice of the experts' whole I
        self.gate_up_proj = nn.Parameter(torch.empty(moe.num_experts, 2 * size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(moe.num_experts, hidden_size, size))
        self.gate_up_codes: ExpertCodes | None = None
        self.down_codes: ExpertCodes | None = None
        self.swiglu = moe.swiglu  # gpt-oss's clamped SwiGLU, for the fused kernel

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
                ) -> torch.Tensor:
        """x [T, H]; weights [T, K] (the routing weights); ids [T, K] int64 -> this
        rank's part of each token's weighted sum of its experts [T, H] (the block
        all-reduces it): on CUDA the fused MoE kernel (module docstring), with the
        family's biases and activation; on the CPU `experts_grouped`."""
        if not x.is_cuda:
            return experts_grouped(x, self, weights, ids)
        from pagellm.kernels.triton_moe import fused_moe

        w13, w2 = self.fused_weights()
        b13, b2 = self.fused_biases()
        return fused_moe(x.contiguous(), w13, w2, weights.float(), ids, bias13=b13,
                         bias2=b2, swiglu=self.swiglu)

    def fused_biases(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(gate_up bias [E, 2I], down bias [E, H]) for the fused MoE kernel: none here
        (gpt_oss.py's experts have them)."""
        return None, None

    def pack(self, attr: str, quant: CpuIntWeight | PackedWeight) -> tuple[int, ExpertCodes]:
        """Compute stacked weight `attr` (gate_up_proj or down_proj) from `quant` (all
        its E * N rows) from now on; the parameter becomes a meta placeholder of its
        shape. Returns (the placeholder's id, the ExpertCodes): an entry of the model's
        `quantized`."""
        weight = getattr(self, attr)
        codes = ExpertCodes(quant, weight.shape[0])
        setattr(self, attr.replace("_proj", "_codes"), codes)
        setattr(self, attr, placeholder(weight))
        return id(getattr(self, attr)), codes

    def fused_weights(self) -> tuple[torch.Tensor | PackedWeight, torch.Tensor | PackedWeight]:
        """(gate_up, down) as the fused MoE kernel takes them: stacked, or packed."""
        return (_fused(self.gate_up_codes, self.gate_up_proj),
                _fused(self.down_codes, self.down_proj))

    def mlp(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e's SwiGLU MLP: x [n, H] -> [n, H]; each projection from its codes where
        packed (a file may store gate/up and down at different precisions)."""
        size = self.intermediate_size
        h = None if self.gate_up_codes is None else \
            quantized_silu_and_mul(x, self.gate_up_codes.expert(e))  # None: cannot fuse
        if h is None:
            gate_up = self.gate_up(e, x)  # [n, 2I]
            h = F.silu(gate_up[:, :size]) * gate_up[:, size:]  # [n, I]
        return self.down(e, h)

    def gate_up(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """x [n, H] @ expert e's gate_up [2I, H]^T -> [n, 2I] (gate's columns first)."""
        return _project(x, self.gate_up_codes, self.gate_up_proj, e)

    def down(self, e: int, h: torch.Tensor) -> torch.Tensor:
        """h [n, I] @ expert e's down [H, I]^T -> [n, H]."""
        return _project(h, self.down_codes, self.down_proj, e)


def _fused(codes: ExpertCodes | None, stacked: torch.Tensor) -> torch.Tensor | PackedWeight:
    """A stacked weight as the fused MoE kernel takes it: its PackedWeight where packed."""
    if codes is None:
        return stacked
    assert isinstance(codes.quant, PackedWeight), "the CPU's layout on CUDA"
    return codes.quant


def _project(x: torch.Tensor, codes: ExpertCodes | None, stacked: torch.Tensor, e: int
             ) -> torch.Tensor:
    """x [n, K] @ expert e's weight [N, K]^T: from its codes where packed, else from the
    stacked weight [E, N, K]."""
    return linear(x, stacked[e]) if codes is None else \
        quantized_linear(x, codes.expert(e), None)


class SparseMoeBlock(nn.Module):
    def __init__(self, spec: DecoderSpec, tp: TensorParallel) -> None:
        super().__init__()
        assert spec.moe is not None
        self.moe = spec.moe
        self.tp = tp
        self.gate = Linear(spec.hidden_size, spec.moe.num_experts, bias=False)  # the router
        self.experts = Experts(spec.moe, spec.hidden_size, tp)
        # Qwen2-MoE's shared expert: a gated MLP every token runs (this rank's columns;
        # its down projection all-reduces itself), scaled by sigmoid(shared_expert_gate)
        self.shared_expert: DecoderMLP | None = None
        self.shared_expert_gate: Linear | None = None
        if spec.moe.shared_expert_size:
            self.shared_expert = DecoderMLP(spec, tp, spec.moe.shared_expert_size // tp.size)
            self.shared_expert_gate = Linear(spec.hidden_size, 1, bias=False)

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
        out = self.tp.all_reduce(self.experts(x, weights, ids))
        if self.shared_expert is not None:  # transformers' order: experts + shared
            assert self.shared_expert_gate is not None
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def stacked_experts(model: nn.Module, cpu: bool
                    ) -> Iterator[tuple[str, Experts, str, int]]:
    """(layer, module, attr, shards) for each MoE layer's stacked weights: the layer's
    name (model.layers.N), `shards` the tensor-parallel slices of their K (row-parallel
    down_proj). For the CPU's int kernel
    (`cpu`), ValueError where the experts' rows do not fill whole tiles (each expert's
    weight must be a slice of the packed one)."""
    for name, module in model.named_modules():
        if not isinstance(module, Experts):
            continue
        for attr, shards in (("gate_up_proj", 1), ("down_proj", module.shards)):
            rows = getattr(module, attr).shape[1]
            if cpu and rows % cpu_int_gemm.TILE:
                raise ValueError(f"{name}.{attr}: experts of {rows} rows (not a multiple of "
                                 f"{cpu_int_gemm.TILE}) cannot take the CPU's int kernel")
            yield name.rsplit(".", 2)[0], module, attr, shards


def quantize_experts(model: nn.Module, bits: int, triton: bool, on_meta: bool = False
                     ) -> dict[int, nn.Module]:
    """Quantize on load (quantize.py) every MoE layer's experts, an expert at a time, in
    groups as `group_size_for` gives a projection: for the CPU's int kernel, or
    (`triton`) as one PackedWeight per stacked weight, scales in the model's dtype, for
    the fused MoE kernel (kernels/triton_moe.py); `on_meta` (before loading): empty, on
    the meta device, filled an expert's tensor at a time as they load (as
    quantize_projections'). Returns the ExpertCodes by their placeholder's id."""
    quantized: dict[int, nn.Module] = {}
    for _, experts, attr, shards in stacked_experts(model, cpu=not triton):
        weight = getattr(experts, attr)  # [E, N, K]
        group = group_size_for(weight.shape[2], shards)
        count, rows, k = weight.shape
        if on_meta:
            quant: CpuIntWeight | PackedWeight = (
                empty_packed(count * rows, k, bits, group, weight.dtype) if triton
                else empty_cpu_int(count * rows, k, bits, group))
        elif triton:
            parts = [quantize(w.detach(), bits, group) for w in weight]
            quant = PackedWeight(
                torch.cat([p.qweight for p in parts], dim=1),
                torch.cat([p.scales for p in parts], dim=1),
                torch.cat([p.zeros for p in parts], dim=1), bits, group)
        else:
            quant = in_huge_pages(cpu_int_gemm.concatenated([
                cpu_int_gemm.quantize(w.detach(), bits, group) for w in weight]))
        quantized.update([experts.pack(attr, quant)])
    return quantized


def experts_grouped(x: torch.Tensor, experts: Experts, weights: torch.Tensor,
                    ids: torch.Tensor) -> torch.Tensor:
    """The experts on the CPU, one GEMM per chosen expert and projection.

    x [T, H]; weights [T, K]; ids [T, K] -> [T, H] in x's dtype. The (token, slot) pairs
    are sorted by expert once (a stable sort: tokens keep their order within an
    expert), so each chosen expert reads its rows as one slice; experts no token chose
    cost nothing. One token (batch-1 decode) skips the grouping: its experts in
    ascending order, the same sums (10-14% of an int8/int4 Qwen3-30B-A3B layer's time at
    one token, benchmarks-log.md)."""
    if x.shape[0] == 1:
        out = torch.zeros_like(x)
        for expert, weight in sorted(zip(ids[0].tolist(), weights[0], strict=True)):
            out += (experts.mlp(expert, x) * weight).to(x.dtype)
        return out
    top_k = ids.shape[1]
    order = torch.argsort(ids.reshape(-1), stable=True)  # [T * K] pairs by expert
    counts = torch.bincount(ids.reshape(-1), minlength=experts.gate_up_proj.shape[0]).tolist()
    token_of = order // top_k  # [T * K]
    pair_weights = weights.reshape(-1)[order]  # [T * K]
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if not count:
            continue
        rows = token_of[start:start + count]
        h = experts.mlp(expert, x[rows])  # [n, H]
        # index_put_ with accumulate, not index_add_: the same sums (a token appears once
        # per expert), but torch 2.13's CPU index_add_ took ~2 ms for a few 2048-wide rows
        # (53% of a Qwen3-MoE-shaped step in torch's profiler), index_put_ ~9 us.
        out.index_put_((rows,), (h * pair_weights[start:start + count, None]).to(x.dtype),
                       accumulate=True)
        start += count
    return out
