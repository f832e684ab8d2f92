"""DeepSeek-V2 / V3 (and the models built on them: DeepSeek-R1, Kimi K2, Moonlight,
GLM-4.7-Flash; glm4_moe.py's GLM-4.5 takes its MoE block):
multi-head latent attention (MLA) and experts routed by groups, as transformers computes
them.

Latent attention. Per token one latent c = RMSNorm(kv_a(x)[:R]) (kv_lora_rank R) and
one rotary key k_pe = RoPE(kv_a(x)[R:]) shared by every head; head h's key is
[W_UK[h] c ; k_pe] and its value W_UV[h] c, where kv_b_proj stacks W_UK [nope, R] and
W_UV [v, R] per head. Queries: q_proj(x), or q_b_proj(RMSNorm(q_a_proj(x))) (V3's
q_lora_rank), split per head into q_nope and q_pe. Since

    q_h . k_h = (W_UK[h]^T q_nope) . c + q_pe . k_pe      and      o_h = W_UV[h] (sum_j p_j c_j)

the cache holds only [c ; k_pe] per token, one "KV head" of R + rope (the spec's
head_dim), and attention runs as multi-query attention over it: each head's query is
[W_UK[h]^T q_nope ; q_pe] (the up-projection "absorbed" into the query), its output's
first R entries are the weighted latents, which W_UV[h] turns into the head's value
(`LatentProjection`). The
shared attention layer and every backend serve it unchanged: the value is the key
entry itself, and the cache holds it once (`DecoderSpec.kv_planes`: the K and V halves
of each layer's cache are views of one tensor; 576 numbers a token and layer, against
V3's 128 heads x 320 of full keys and values). Softmax scale: qk_head_dim ** -0.5
(times YaRN's mscale squared, registry.py), as transformers'.

RoPE: DeepSeek pairs rotary dimensions interleaved, (x0, x1), (x2, x3), ...;
`rotate_pe` de-interleaves them (evens, then odds: the layout transformers' V3 outputs)
and rotates halves, giving the same dot products (V3 with rope_interleave false: halves
as they come).

Experts (`DeepseekMoeBlock`): the shared stacked experts (moe.py: quantize-on-load,
sleep and weight updates as for any MoE) chosen by `DeepseekRouter` (spec.py's
`GroupedRouting`: softmax or sigmoid scores, V3's bias for the choice, the groups),
plus shared experts every token runs, ungated, one MLP of n_shared_experts times the
experts' width. The first first_k_dense_replace layers have the dense MLP.

Checkpoint names are transformers' (one tensor per expert, `mlp.shared_experts.*`,
`mlp.gate.e_score_correction_bias`); `family_destination` slices the latent
attention's per-head tensors by this rank's heads (q_proj / q_b_proj and kv_b_proj
rows, o_proj columns; the latents' projections replicated) and skips the
multi-token-prediction layer V3 checkpoints append (layer num_hidden_layers: a
speculative head this engine does not run).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.executor.model.attention import Attention, AttentionMetadata
from pagellm.executor.model.decoder import DecoderForCausalLM, DecoderLayer, DecoderModel
from pagellm.executor.model.layers import Linear, RMSNorm, RowParallelLinear
from pagellm.executor.model.mlp import DecoderMLP
from pagellm.executor.model.moe import Experts
from pagellm.executor.model.parallel import TensorParallel
from pagellm.executor.model.rope import RotaryEmbedding, apply_rotary, halves_from_pairs
from pagellm.executor.model.spec import DecoderSpec
from pagellm.executor.model.weight_map import SKIP, Destination

# transformers builds the latents' norms with RMSNorm's default epsilon, not the
# config's rms_norm_eps
LATENT_NORM_EPS = 1e-6


class LatentProjection(nn.Module):
    """kv_b_proj: per head, W_UK [nope, R] then W_UV [v, R] (`weight` [H * (nope + v),
    R], this rank's heads), applied in the absorbed form (module docstring): not a
    `Linear`, so quantize-on-load keeps it whole."""

    def __init__(self, heads: int, nope: int, v: int, rank: int) -> None:
        super().__init__()
        self.heads, self.nope, self.v, self.rank = heads, nope, v, rank
        self.weight = nn.Parameter(torch.empty(heads * (nope + v), rank))

    def _per_head(self) -> torch.Tensor:
        return self.weight.view(self.heads, self.nope + self.v, self.rank)  # [H, nope+v, R]

    def absorb(self, q_nope: torch.Tensor) -> torch.Tensor:
        """q_nope [T, H, nope] -> [T, H, R]: W_UK[h]^T q_nope[h], the query against c."""
        w_uk = self._per_head()[:, :self.nope]  # [H, nope, R]
        return torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)

    def values(self, latent: torch.Tensor) -> torch.Tensor:
        """latent [T, H, R] (each head's weighted sum of c) -> [T, H, v]: W_UV[h] of it."""
        w_uv = self._per_head()[:, self.nope:]  # [H, v, R]
        return torch.bmm(latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)


class MlaAttention(nn.Module):
    """Multi-head latent attention (module docstring) for this rank's heads."""

    def __init__(self, spec: DecoderSpec, layer_idx: int, tp: TensorParallel) -> None:
        super().__init__()
        mla = spec.mla
        assert mla is not None
        self.heads = heads = tp.num_heads
        self.nope, self.rope_dim, self.rank = (mla.qk_nope_head_dim, mla.qk_rope_head_dim,
                                               mla.kv_lora_rank)
        self.v_dim = mla.v_head_dim
        self.interleaved = mla.rope_interleave
        qk = self.nope + self.rope_dim
        self.q_proj: Linear | None = None
        self.q_a_proj: Linear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: Linear | None = None
        if mla.q_lora_rank is None:
            self.q_proj = Linear(spec.hidden_size, heads * qk, bias=False)
        else:
            self.q_a_proj = Linear(spec.hidden_size, mla.q_lora_rank, bias=spec.qkv_bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(mla.q_lora_rank, heads * qk, bias=False)
        self.kv_a_proj_with_mqa = Linear(spec.hidden_size, self.rank + self.rope_dim,
                                         bias=spec.qkv_bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS)
        self.kv_b_proj = LatentProjection(heads, self.nope, self.v_dim, self.rank)
        self.o_proj = RowParallelLinear(heads * self.v_dim, spec.hidden_size, spec.o_bias, tp)
        assert spec.attn_scale is not None
        self.attn = Attention(layer_idx, spec.attn_scale)

    def rotate_pe(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                  ) -> torch.Tensor:
        """x [T, n, rope] -> rotated, pairs de-interleaved first where DeepSeek interleaves
        them (module docstring)."""
        if self.interleaved:
            x = halves_from_pairs(x, x.shape[-1])
        return apply_rotary(x.contiguous(), cos, sin)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                meta: AttentionMetadata, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        tokens = x.shape[0]
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None \
                and self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))[0])
        q = q.view(tokens, self.heads, self.nope + self.rope_dim)
        latent = self.kv_a_proj_with_mqa(x)  # [T, R + rope]
        c, _ = self.kv_a_layernorm(latent[:, :self.rank].contiguous())  # [T, R]
        cos, sin = rope
        q_pe = self.rotate_pe(q[..., self.nope:], cos, sin)  # [T, H, rope]
        k_pe = self.rotate_pe(latent[:, None, self.rank:], cos, sin)  # [T, 1, rope]
        query = torch.cat((self.kv_b_proj.absorb(q[..., :self.nope]), q_pe), dim=-1)
        key = torch.cat((c[:, None], k_pe), dim=-1)  # [T, 1, R + rope]: the cache entry
        out = self.attn(query, key, key, meta, kv_caches)  # [T, H, R + rope]
        values = self.kv_b_proj.values(out[..., :self.rank])  # [T, H, v]
        return self.o_proj(values.reshape(tokens, self.heads * self.v_dim))


class DeepseekRouter(nn.Module):
    """The router's weight [E, hidden] and, for V3, the bias added to the scores to
    choose (e_score_correction_bias [E]), both kept in float32 whatever the model's
    dtype: the bias as transformers and vLLM keep it (neighbouring experts' biases
    differ by less than bf16 resolves), the weight as transformers keeps ERNIE 4.5's
    (stored in float32) and vLLM MiniMax-M2's; a bf16 checkpoint's weight is exact in
    float32, so its scores are the ones a bf16 router computes in float32."""

    def __init__(self, hidden_size: int, num_experts: int, score_bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.e_score_correction_bias = (nn.Parameter(torch.empty(num_experts))
                                        if score_bias else None)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True
               ) -> DeepseekRouter:
        kept = (self.weight, self.e_score_correction_bias)

        def convert(t: torch.Tensor) -> torch.Tensor:
            return fn(t).float() if any(t is k for k in kept) else fn(t)

        return super()._apply(convert, recurse)


class DeepseekMoeBlock(nn.Module):
    """DeepSeek's routed experts plus its ungated shared experts (module docstring)."""

    def __init__(self, spec: DecoderSpec, tp: TensorParallel) -> None:
        super().__init__()
        moe = spec.moe
        assert moe is not None and moe.grouped is not None
        self.moe, self.routing, self.tp = moe, moe.grouped, tp
        self.gate = DeepseekRouter(spec.hidden_size, moe.num_experts, moe.grouped.score_bias)
        self.experts = Experts(moe, spec.hidden_size, tp)
        self.shared_experts = (DecoderMLP(spec, tp, moe.shared_expert_size // tp.size)
                               if moe.shared_expert_size else None)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, K] float32, or x's dtype where the family rounds
        them (ERNIE 4.5); expert ids [T, K] int64), in float32 throughout as
        transformers' router."""
        r = self.routing
        logits = F.linear(x.float(), self.gate.weight.float())  # [T, E]
        scores = logits.sigmoid() if r.scoring == "sigmoid" else logits.softmax(dim=-1)
        bias = self.gate.e_score_correction_bias
        choice = scores if bias is None else scores + bias
        if r.group_score is not None:
            groups = choice.view(choice.shape[0], r.n_group, -1)  # [T, G, E / G]
            group_scores = (groups.max(dim=-1).values if r.group_score == "max"
                            else groups.topk(2, dim=-1).values.sum(dim=-1))  # [T, G]
            best = torch.topk(group_scores, r.topk_group, dim=-1).indices
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
            choice = groups.masked_fill(~keep[..., None], float("-inf")).flatten(1)
        ids = torch.topk(choice, self.moe.top_k, dim=-1).indices  # [T, K]
        weights = scores.gather(1, ids)
        if self.moe.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + r.renorm_eps)
        weights = weights * r.scaling
        return (weights.to(x.dtype) if self.moe.weights_in_model_dtype else weights), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden], summed over the ranks."""
        weights, ids = self.route(x)
        out = self.tp.all_reduce(self.experts(x, weights, ids))
        if self.shared_experts is not None:  # transformers' order: experts + shared
            out = out + self.shared_experts(x)  # (its down projection all-reduces)
        return out


class DeepseekDecoderLayer(DecoderLayer):
    attention_cls = MlaAttention
    moe_cls = DeepseekMoeBlock


class DeepseekModel(DecoderModel):
    layer_cls = DeepseekDecoderLayer

    def make_rotary(self, spec: DecoderSpec, max_model_len: int | None) -> RotaryEmbedding:
        """Tables for the rotary part of a head only (qk_rope_head_dim)."""
        assert spec.mla is not None
        return RotaryEmbedding(spec.rope, spec.mla.qk_rope_head_dim, spec.max_position,
                               max_model_len)


_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


class DeepseekForCausalLM(DecoderForCausalLM):
    """The shared causal LM around `DeepseekModel`, with the latent attention's tensors
    sliced by head (`family_destination`)."""

    model_cls: ClassVar[type[DecoderModel]] = DeepseekModel

    def family_destination(self, name: str, params: dict[str, nn.Parameter]
                           ) -> Destination | None:
        m = _LAYER.fullmatch(name)
        if m is not None and int(m[1]) >= self.spec.num_layers:
            return SKIP  # V3's multi-token-prediction layer (module docstring)
        dest = (latent_attention_destination(name, params, self.spec, self.tp)
                if self.spec.mla is not None else None)  # (GLM-4.5's is the shared one)
        return dest if dest is not None else super().family_destination(name, params)


def latent_attention_destination(name: str, params: dict[str, Any], spec: DecoderSpec,
                                 tp: TensorParallel) -> Destination | None:
    """Where a per-head latent-attention tensor loads on rank `tp`: this rank's heads'
    rows of q_proj / q_b_proj (nope + rope each) and kv_b_proj (nope + v each), its
    heads' columns of o_proj (v each). None for any other name (the shared weight map's:
    the latents' projections and norms load whole on every rank)."""
    mla = spec.mla
    assert mla is not None
    if not name.endswith(".weight") or (param := params.get(name)) is None:
        return None
    module = name.rsplit(".", 2)[-2]
    per_head = {"q_proj": mla.qk_nope_head_dim + mla.qk_rope_head_dim,
                "q_b_proj": mla.qk_nope_head_dim + mla.qk_rope_head_dim,
                "kv_b_proj": mla.qk_nope_head_dim + mla.v_head_dim}.get(module)
    if per_head is not None:  # rows: column parallel
        rows = tp.num_heads * per_head
        return Destination(param, (spec.num_heads * per_head, param.shape[1]), 0,
                           tp.rank * rows, rows)
    if module == "o_proj":  # columns: row parallel
        width = tp.num_heads * mla.v_head_dim
        return Destination(param, (param.shape[0], spec.num_heads * mla.v_head_dim), 1,
                           tp.rank * width, width)
    return None
