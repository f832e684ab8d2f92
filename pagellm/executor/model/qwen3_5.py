"""Qwen3.5 and Qwen3.5-MoE (`Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM`: the text
models; `Qwen3_5ForConditionalGeneration`, `Qwen3_5MoeForConditionalGeneration`: the
released checkpoints, served as their text model): linear attention by the gated delta
rule in three layers of four, gated full attention in the fourth; Qwen3.5-MoE's MLPs are
Qwen2-MoE's block (moe.py: top-k of a softmax, renormalised, and a shared expert gated
by sigmoid). Qwen3-Next (`Qwen3NextForCausalLM`) computes as Qwen3.5-MoE from the
linear attention's projections fused per key head (`Qwen3NextGatedDeltaNet`).

What differs from the shared decoder (decoder.py), as transformers computes it:

- a linear-attention layer (`GatedDeltaNet`) projects the token to queries, keys and
  values (`in_proj_qkv`), convolves them causally per channel over the request's last
  `conv_kernel` tokens (stateful.py), applies SiLU, then reads and updates a memory
  per value head, S [head_k_dim, head_v_dim], token by token:

      S <- S * exp(g)                      g = -exp(A_log) * softplus(a + dt_bias) <= 0
      S <- S + k (beta * (v - S^T k))^T    beta = sigmoid(b); q, k L2-normalised
      o  = S^T q / sqrt(head_k_dim)

  (query and key heads serve num_v_heads / num_k_heads value heads each), then
  RMSNorm(o) * SiLU(z) and `out_proj`. A step computes a prompt chunk in blocks of 64
  tokens (the delta rule's chunked form: one triangular solve per block, the memory
  carried between blocks) and one-token requests together in the recurrent form. The
  layer keeps, per request, the convolution's last inputs and S (`state_shapes`: one
  float32 row per request of the runner's batch), so, as LFM2's, a request computes
  from its first token: no prefix caching, no speculative decoding;
- the full-attention layers' query projection is twice as wide: each head's query,
  then its gate; the attention's output is multiplied by sigmoid(gate) before o_proj
  (`GatedAttention`); per-head q/k norms; RoPE on a quarter of each head (text
  positions: the multimodal RoPE's three sections coincide);
- every RMSNorm but the linear attention's output norm scales by (1 + w) in fp32 and
  then rounds (Gemma's, gemma.py).

Checkpoint names are transformers' (`linear_attn.in_proj_qkv`, `conv1d`, `A_log`, ...);
q_proj's rows (query and gate per head) load into the merged projection as the shared
weight map places them (`DecoderSpec.attn_output_gate`). The released checkpoints hold
the text model under `model.language_model.`, beside a vision tower (`model.visual.`)
and a multi-token prediction head (`mtp.`), neither of which is loaded: the engine
takes text only.
Under tensor parallelism each rank holds its share of the linear attention's key heads
and of the value heads they serve (their rows of the projections and the convolution,
their memories), and of the full attention's heads, as the shared decoder's.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.executor.model.attention import AttentionMetadata
from pagellm.executor.model.decoder import DecoderAttention, DecoderForCausalLM
from pagellm.executor.model.gemma import GemmaRMSNorm
from pagellm.executor.model.layers import Linear, RMSNorm, RowParallelLinear
from pagellm.executor.model.moe import SparseMoeBlock
from pagellm.executor.model.parallel import TensorParallel
from pagellm.executor.model.spec import DecoderSpec, GatedDeltaNetSpec
from pagellm.executor.model.stateful import (
    ConvBatch,
    Rope,
    StatefulLayer,
    StatefulModel,
    scan_requests,
)
from pagellm.executor.model.weight_map import SKIP, Destination

CHUNK = 64  # tokens per block of the delta rule's chunked form


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / ||x|| over the last dimension (1e-6 under the root, as the checkpoints' code)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


def delta_rule_steps(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
    """One token per request, the recurrent form (module docstring), float32. q, k: [R,
    H, dk] (normalised, q scaled); v: [R, H, dv]; g, beta: [R, H]; memory: [R, H, dk, dv],
    advanced in place (no temporary of its size: the memories are most of a decode
    step's bytes) -> o [R, H, dv]."""
    memory.mul_(g.exp()[..., None, None])
    recalled = torch.matmul(k[..., None, :], memory)[..., 0, :]  # [R, H, dv]: S^T k
    memory.addcmul_(k[..., None], ((v - recalled) * beta[..., None])[..., None, :])
    return torch.matmul(q[..., None, :], memory)[..., 0, :]


def delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
    """One request's L tokens in blocks of CHUNK, float32. q, k: [H, L, dk] (normalised,
    q scaled); v: [H, L, dv]; g, beta: [H, L]; memory: [H, dk, dv], advanced in place ->
    o [H, L, dv].

    Within a block, the delta rule's updates are one lower-triangular system: with
    W = K_beta K^T weighted by the decays between positions, U = (I + W)^-1 (V beta)
    are the values each position writes and (I + W)^-1 (K_beta exp(G)) how much of the
    block's starting memory S each one first erases; the block's outputs are its
    queries read against S plus the in-block causal attention over the written values,
    and S moves on to the block's end."""
    heads, length = q.shape[:2]
    pad = -length % CHUNK
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))  # g = 0, beta = 0: no update
    blocks = (length + pad) // CHUNK
    q, k, v = (t.reshape(heads, blocks, CHUNK, -1) for t in (q, k, v))
    g, beta = g.reshape(heads, blocks, CHUNK), beta.reshape(heads, blocks, CHUNK, 1)
    cum = g.cumsum(-1)  # [H, N, C] log-decay from the block's start
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta
    system = (k_beta @ k.transpose(-1, -2)) * decay  # [H, N, C, C], lower triangle
    written = torch.linalg.solve_triangular(system, v * beta, upper=False, unitriangular=True)
    erased = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False,
                                           unitriangular=True)
    in_block = (q @ k.transpose(-1, -2)) * decay
    q_start = q * cum.exp()[..., None]  # read S as decayed to each position
    k_end = k * (cum[..., -1:] - cum).exp()[..., None]  # written values decayed to the end
    block_decay = cum[..., -1].exp()[..., None, None]  # [H, N, 1, 1]
    out = torch.empty(written.shape, dtype=written.dtype, device=written.device)
    s = memory
    for i in range(blocks):
        new = written[:, i] - erased[:, i] @ s  # [H, C, dv]
        out[:, i] = q_start[:, i] @ s + in_block[:, i] @ new
        s = s * block_decay[:, i] + k_end[:, i].transpose(-1, -2) @ new
    memory.copy_(s)
    return out.view(heads, blocks * CHUNK, -1)[:, :length]


def local_heads(la: GatedDeltaNetSpec, ranks: int) -> GatedDeltaNetSpec:
    """One of `ranks` ranks' share of the linear attention: its key heads and the value
    heads they serve (parallel.check_divisible: the key heads split evenly)."""
    return replace(la, num_k_heads=la.num_k_heads // ranks,
                   num_v_heads=la.num_v_heads // ranks)


class GatedDeltaNet(nn.Module):
    """The linear-attention layer (module docstring), its state one float32 row per
    request: the convolution's last kernel - 1 inputs, then the memory of every head."""

    def __init__(self, spec: DecoderSpec, la: GatedDeltaNetSpec, tp: TensorParallel) -> None:
        """On `tp`'s rank: its share of the key heads and of the value heads they serve
        (`la` scaled down: `local_heads`)."""
        super().__init__()
        self.la = la = local_heads(la, tp.size)
        self.key_dim = la.num_k_heads * la.head_k_dim
        self.value_dim = la.num_v_heads * la.head_v_dim
        self.make_projections(spec.hidden_size)
        # Only its parameter, [conv_dim, 1, K]: the checkpoint's name and shape.
        self.conv1d = nn.Conv1d(la.conv_dim, la.conv_dim, la.conv_kernel, groups=la.conv_dim,
                                bias=False)
        self.dt_bias = nn.Parameter(torch.empty(la.num_v_heads))
        self.A_log = nn.Parameter(torch.empty(la.num_v_heads))
        self.norm = RMSNorm(la.head_v_dim, spec.rms_norm_eps)  # of each head's output
        self.out_proj = RowParallelLinear(self.value_dim, spec.hidden_size, False, tp)

    def make_projections(self, hidden: int) -> None:
        """Qwen3.5's four input projections: queries-keys-values, z, b and a."""
        self.in_proj_qkv = Linear(hidden, self.la.conv_dim, bias=False)
        self.in_proj_z = Linear(hidden, self.value_dim, bias=False)
        self.in_proj_b = Linear(hidden, self.la.num_v_heads, bias=False)
        self.in_proj_a = Linear(hidden, self.la.num_v_heads, bias=False)

    def project(self, x: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [T, hidden] -> (the convolution's input [T, q | k | v], z [T, value_dim],
        b [T, Hv], a [T, Hv])."""
        return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)

    def state_size(self) -> int:
        """A request's state: (kernel - 1) x conv_dim convolution inputs, then
        num_v_heads x head_k_dim x head_v_dim of memory."""
        la = self.la
        return ((la.conv_kernel - 1) * la.conv_dim
                + la.num_v_heads * la.head_k_dim * la.head_v_dim)

    def forward(self, x: torch.Tensor, batch: ConvBatch, meta: AttentionMetadata,
                state: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]; `state`: this layer's [rows, state_size()]."""
        la, tokens = self.la, x.shape[0]
        conv_size = (la.conv_kernel - 1) * la.conv_dim
        conv_state = state[:, :conv_size].view(-1, la.conv_kernel - 1, la.conv_dim)
        memory = state[:, conv_size:].view(-1, la.num_v_heads, la.head_k_dim, la.head_v_dim)
        qkv, z, b, a = self.project(x)
        mixed = F.silu(batch.convolve(qkv, self.conv1d.weight, None, conv_state))
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        groups = la.num_v_heads // la.num_k_heads  # value heads per query/key head
        q, k = (_l2norm(t.reshape(tokens, la.num_k_heads, la.head_k_dim).float())
                .repeat_interleave(groups, dim=1) for t in (q, k))
        q = q * la.head_k_dim ** -0.5
        v32 = v.reshape(tokens, la.num_v_heads, la.head_v_dim).float()
        beta = b.sigmoid().float()  # [T, Hv]
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        out = scan_requests(delta_rule_steps, delta_rule_chunked, (q, k, v32, g, beta),
                            memory, meta)  # [T, Hv, dv]
        normed, _ = self.norm(out.to(x.dtype).reshape(-1, la.head_v_dim))
        z = z.reshape(-1, la.head_v_dim)
        gated = (normed.float() * F.silu(z.float())).to(x.dtype)
        return self.out_proj(gated.reshape(tokens, self.value_dim))


class Qwen3NextGatedDeltaNet(GatedDeltaNet):
    """Qwen3-Next's linear attention: Qwen3.5's, its projections fused per key head as
    its checkpoints store them: in_proj_qkvz, each key head's [q (dk) | k (dk) | v (g dv)
    | z (g dv)] (g = value heads per key head), and in_proj_ba, each key head's [b (g) |
    a (g)]; split here into the layout the convolution and the rule read. A rank's key
    heads are a run of rows of each."""

    def make_projections(self, hidden: int) -> None:
        la = self.la
        self.in_proj_qkvz = Linear(hidden, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = Linear(hidden, 2 * la.num_v_heads, bias=False)

    def project(self, x: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        la, tokens = self.la, x.shape[0]
        g = la.num_v_heads // la.num_k_heads
        dk, dv = la.head_k_dim, la.head_v_dim
        q, k, v, z = self.in_proj_qkvz(x).view(tokens, la.num_k_heads, -1).split(
            [dk, dk, g * dv, g * dv], dim=-1)
        qkv = torch.cat([t.reshape(tokens, -1) for t in (q, k, v)], dim=-1)
        b, a = self.in_proj_ba(x).view(tokens, la.num_k_heads, 2 * g).split([g, g], dim=-1)
        return qkv, z.reshape(tokens, -1), b.reshape(tokens, -1), a.reshape(tokens, -1)


class GatedAttention(DecoderAttention):
    """The shared attention with Qwen3.5's output gate: q_proj gives each head's query
    and then its gate, and the attention's output is times sigmoid(gate); per-head q/k
    norms scale by (1 + w)."""

    norm_cls = GemmaRMSNorm

    def forward(self, rope: Rope, x: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[torch.Tensor]) -> torch.Tensor:
        tokens, heads, d = x.shape[0], self.num_heads, self.head_dim
        qkv = self.qkv_proj(x)  # [T, (2 H + 2 H_kv) D]: spec.attn_output_gate's rows
        q_gate = qkv[:, :self.q_rows].view(tokens, heads, 2 * d)
        k = qkv[:, self.q_rows:self.q_rows + self.kv_size].view(tokens, -1, d)
        v = qkv[:, self.q_rows + self.kv_size:].view(tokens, -1, d)
        assert self.q_norm is not None and self.k_norm is not None
        q, _ = self.q_norm(q_gate[..., :d])
        k, _ = self.k_norm(k)
        cos, sin = rope
        out = self.attn(self.rotate(q, cos, sin), self.rotate(k, cos, sin), v, meta,
                        kv_caches, self.sinks)  # [T, H, D]
        gate = q_gate[..., d:].reshape(tokens, self.q_size)
        return self.o_proj(out.reshape(tokens, self.q_size) * torch.sigmoid(gate))


class Qwen3_5DecoderLayer(StatefulLayer):
    """The mixer linear or gated full attention (stateful.py's layer), (1 + w) norms."""

    linear_cls: ClassVar[type[GatedDeltaNet]] = GatedDeltaNet
    norm_cls = GemmaRMSNorm
    moe_cls = SparseMoeBlock

    def __init__(self, spec: DecoderSpec, layer_idx: int, tp: TensorParallel) -> None:
        super().__init__(spec, layer_idx, tp)
        la = spec.linear_attention
        assert la is not None
        self.linear_attn: GatedDeltaNet | None = None
        self.self_attn: GatedAttention | None = None
        if la.layers[layer_idx]:
            self.linear_attn = self.linear_cls(spec, la, tp)
        else:
            self.self_attn = GatedAttention(spec, layer_idx, tp)

    def mix(self, rope: Rope, h: torch.Tensor, meta: AttentionMetadata,
            caches: list[torch.Tensor], batch: ConvBatch | None) -> torch.Tensor:
        if self.linear_attn is not None:
            assert batch is not None
            return self.linear_attn(h, batch, meta, caches[self.layer_idx])
        assert self.self_attn is not None
        return self.self_attn(rope, h, meta, caches)


class Qwen3_5Model(StatefulModel):
    layer_cls = Qwen3_5DecoderLayer
    norm_cls = GemmaRMSNorm


_LINEAR = re.compile(r".+\.linear_attn\.(in_proj_qkvz|in_proj_ba|in_proj_qkv|conv1d|in_proj_z|"
                     r"in_proj_b|in_proj_a|dt_bias|A_log|out_proj)(\.weight)?")


class Qwen3_5ForCausalLM(DecoderForCausalLM):
    """Qwen3.5's text model: the shared causal LM around `Qwen3_5Model`, the linear
    attention's states, q_proj's gates placed in the merged projection."""

    model_cls = Qwen3_5Model

    def state_shapes(self, rows: int) -> dict[int, tuple[tuple[int, ...], torch.dtype]]:
        """Each linear-attention layer's state: [rows, GatedDeltaNet.state_size()],
        float32 (the memory accumulates; the convolution's inputs are exact in it)."""
        return {i: ((rows, layer.linear_attn.state_size()), torch.float32)
                for i, layer in enumerate(self.model.layers)
                if isinstance(layer, Qwen3_5DecoderLayer) and layer.linear_attn is not None}

    def family_destination(self, name: str, params: dict[str, nn.Parameter]
                           ) -> Destination | None:
        """This rank's heads of the linear attention (`_linear_destination`); the rest
        is the shared map's (q_proj's 2 D rows a head: spec.attn_output_gate)."""
        if (m := _LINEAR.fullmatch(name)) is not None:
            param = params.get(name)
            return None if param is None else self._linear_destination(m[1], param)
        return super().family_destination(name, params)

    def _linear_destination(self, module: str, param: nn.Parameter) -> Destination:
        """A linear-attention tensor on this rank: in_proj_qkv's and conv1d's rows of its
        query, key and value heads (three parts), in_proj_z's, in_proj_b's, in_proj_a's,
        dt_bias's and A_log's of its value heads (Qwen3-Next's in_proj_qkvz's and
        in_proj_ba's of its key heads), out_proj's columns of them."""
        full = self.spec.linear_attention
        assert full is not None
        ranks, rank = self.tp.size, self.tp.rank
        if ranks == 1:
            return Destination(param, tuple(param.shape))
        key, value = full.num_k_heads * full.head_k_dim, full.num_v_heads * full.head_v_dim
        rest = tuple(param.shape[1:])
        if module in ("in_proj_qkv", "conv1d"):  # rows [q | k | v]
            k_local, v_local = key // ranks, value // ranks
            shape = (2 * key + value, *rest)
            parts = ((0, 0, k_local), (k_local, key, k_local),
                     (2 * k_local, 2 * key, v_local))
            return Destination(param, shape, parts=tuple(
                Destination(param[at:at + n], shape, 0, start + rank * n, n)
                for at, start, n in parts))
        if module == "out_proj":  # row parallel: its value heads' columns
            width = param.shape[1]
            return Destination(param, (param.shape[0], value), 1, rank * width, width)
        rows = param.shape[0]  # per value head (z: head_v_dim rows each; Qwen3-Next's
        # fused projections: each key head's run of rows)
        return Destination(param, (rows * ranks, *rest), 0, rank * rows, rows)


class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    """Qwen3.5's released checkpoints, as their text model (module docstring)."""

    checkpoint_renames = ((".model.", ".model.language_model."),)

    def family_destination(self, name: str, params: dict[str, nn.Parameter]
                           ) -> Destination | None:
        if name.startswith(("model.visual.", "mtp.")):
            return SKIP  # the vision tower and the speculative head: text only here
        return super().family_destination(name, params)


class Qwen3NextDecoderLayer(Qwen3_5DecoderLayer):
    linear_cls = Qwen3NextGatedDeltaNet


class Qwen3NextModel(Qwen3_5Model):
    layer_cls = Qwen3NextDecoderLayer


class Qwen3NextForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3-Next (Qwen3-Next-80B-A3B): Qwen3.5-MoE's computation, the linear attention's
    projections fused per key head (`Qwen3NextGatedDeltaNet`)."""

    model_cls = Qwen3NextModel
