"""One decoder for the Llama, Qwen2/Qwen2.5 and Qwen3 families.

The families differ only in data, carried by `DecoderSpec`: qkv bias (Qwen2), per-head
q/k RMSNorm and a head_dim independent of hidden_size (Qwen3), tied embeddings, and the
RoPE variant. q/k/v and gate/up projections are stored merged (one GEMM each);
`load_weights` maps the checkpoint's separate tensors into them.

Under tensor parallelism (executor/model/parallel.py) each rank builds the same modules with
its slice's sizes: `destination` says which slice of which checkpoint tensor loads into
which parameter, and the two row-parallel projections and the embedding all-reduce.

The forward pass takes the step's flat, unpadded token batch:
    input_ids [T], positions [T] -> hidden states [T, hidden_size]
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.executor.model.attention import Attention, AttentionMetadata
from pagellm.executor.model.linear import linear
from pagellm.executor.model.parallel import TensorParallel
from pagellm.executor.model.rope import RopeSpec, RotaryEmbedding, apply_rotary
from pagellm.kernels import fused_for

# model_type -> architecture, for configs that do not list "architectures".
SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                           "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@dataclass(frozen=True)
class DecoderSpec:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    max_position: int
    rope: RopeSpec

    @classmethod
    def from_hf_config(cls, config: Any) -> DecoderSpec:
        archs = list(getattr(config, "architectures", None) or [])
        model_type = getattr(config, "model_type", "")
        arch = archs[0] if archs else SUPPORTED_ARCHITECTURES.get(model_type, model_type)
        if arch not in SUPPORTED_ARCHITECTURES.values():
            raise ValueError(f"unsupported architecture {arch!r} "
                             f"(supported: {', '.join(SUPPORTED_ARCHITECTURES.values())})")
        # Qwen2 always has q/k/v biases and never an o_proj bias; Llama, Mistral and
        # Qwen3 put `attention_bias` on all four projections.
        attention_bias = bool(getattr(config, "attention_bias", False))
        is_qwen2 = arch == "Qwen2ForCausalLM"
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r} (supported: silu)")
        if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window",
                                                               arch == "MistralForCausalLM"):
            raise ValueError("sliding-window attention is not supported")
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=not is_qwen2 and attention_bias,
            qk_norm=arch == "Qwen3ForCausalLM",
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            max_position=config.max_position_embeddings,
            rope=RopeSpec.from_hf(getattr(config, "rope_parameters", None),
                                  getattr(config, "rope_theta", None),
                                  getattr(config, "rope_scaling", None)),
        )


class Linear(nn.Linear):
    """nn.Linear through `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


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
        if residual is not None:
            x = x + residual
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype), x


class RowParallelLinear(nn.Module):
    """y = x W^T (+ b) where each rank holds W's columns for its slice of x: the partial
    products are summed by one all-reduce, then the (replicated) bias is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 tp: TensorParallel) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in_features] (this rank's slice) -> [T, out_features] (the full sum)."""
        if self.tp.size == 1:
            return linear(x, self.weight, self.bias)
        y = self.tp.all_reduce(linear(x, self.weight))
        return y if self.bias is None else y + self.bias


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


class DecoderAttention(nn.Module):
    def __init__(self, spec: DecoderSpec, layer_idx: int, tp: TensorParallel) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (tp.num_heads, tp.num_kv_heads,
                                                            spec.head_dim)
        self.q_size = tp.num_heads * spec.head_dim
        self.kv_size = tp.num_kv_heads * spec.head_dim
        self.qkv_proj = Linear(spec.hidden_size, self.q_size + 2 * self.kv_size,
                               bias=spec.qkv_bias)
        self.o_proj = RowParallelLinear(self.q_size, spec.hidden_size, spec.o_bias, tp)
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.attn = Attention(layer_idx, spec.head_dim ** -0.5)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                meta: AttentionMetadata, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        tokens, heads, qk_size = x.shape[0], self.num_heads, self.q_size + self.kv_size
        qkv = self.qkv_proj(x)  # [T, (H + 2 * H_kv) * D]
        v = qkv[:, qk_size:].view(tokens, self.num_kv_heads, self.head_dim)
        cos, sin = rope
        if self.q_norm is not None and self.k_norm is not None:
            q, _ = self.q_norm(qkv[:, :self.q_size].view(tokens, heads, self.head_dim))
            k, _ = self.k_norm(qkv[:, self.q_size:qk_size].view(tokens, -1, self.head_dim))
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        else:  # q and k side by side: one rotation for both
            qk = apply_rotary(qkv[:, :qk_size].view(tokens, -1, self.head_dim), cos, sin)
            q, k = qk[:, :heads], qk[:, heads:]
        out = self.attn(q, k, v, meta, kv_caches)  # [T, H, D]
        return self.o_proj(out.reshape(tokens, self.q_size))


class DecoderMLP(nn.Module):
    def __init__(self, spec: DecoderSpec, tp: TensorParallel) -> None:
        super().__init__()
        self.intermediate_size = tp.intermediate_size
        self.gate_up_proj = Linear(spec.hidden_size, 2 * tp.intermediate_size, bias=False)
        self.down_proj = RowParallelLinear(tp.intermediate_size, spec.hidden_size, False, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 * intermediate]
        fused = fused_for(gate_up)
        if fused is not None:  # one kernel instead of two (kernels/triton_fused.py)
            return self.down_proj(fused.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, spec: DecoderSpec, layer_idx: int, tp: TensorParallel) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(spec, layer_idx, tp)
        self.mlp = DecoderMLP(spec, tp)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                residual: torch.Tensor | None, meta: AttentionMetadata,
                kv_caches: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(rope, h, meta, kv_caches)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class DecoderModel(nn.Module):
    def __init__(self, spec: DecoderSpec, tp: TensorParallel,
                 max_model_len: int | None = None) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(spec.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(spec, i, tp) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        # Tables for the positions that can occur (max_model_len); the config's
        # max_position_embeddings still drives the RoPE scaling math.
        self.rotary_emb = RotaryEmbedding(spec.rope, spec.head_dim, spec.max_position,
                                          max_model_len)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        rope = self.rotary_emb.cos_sin(positions, x.dtype)  # looked up once for all layers
        residual = None
        for layer in self.layers:
            x, residual = layer(rope, x, residual, meta, kv_caches)
        x, _ = self.norm(x, residual)
        return x


# Checkpoint tensor -> (our parameter, shard) for the merged projections.
_STACKED = (("q_proj", "qkv_proj", "q"), ("k_proj", "qkv_proj", "k"),
            ("v_proj", "qkv_proj", "v"), ("gate_proj", "gate_up_proj", 0),
            ("up_proj", "gate_up_proj", 1))


@dataclass(frozen=True)
class Destination:
    """Where checkpoint tensor `name` loads: `tensor`, a view of a parameter, takes the
    checkpoint tensor's `length` entries from `start` along `dim` (the whole tensor when
    `dim` is None). `shape` is the checkpoint tensor's full shape. `tensor` is None
    for tensors loaded into nothing (computed, or tied)."""

    tensor: torch.Tensor | None
    shape: tuple[int, ...] = ()
    dim: int | None = None
    start: int = 0
    length: int = 0

    def load(self, checkpoint: torch.Tensor, non_blocking: bool = False) -> None:
        """Copy this rank's part of the full `checkpoint` tensor in (shape checked)."""
        if self.tensor is None:
            return
        if tuple(checkpoint.shape) != self.shape:
            raise ValueError(f"shape {tuple(checkpoint.shape)}, the model's is {self.shape}")
        part = checkpoint if self.dim is None else checkpoint.narrow(self.dim, self.start,
                                                                     self.length)
        with torch.no_grad():
            self.tensor.copy_(part, non_blocking=non_blocking)

    def receiver(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """The parameter view itself, when a whole checkpoint tensor of `dtype` on
        `device` can be written straight into it (this rank keeps all of it, same dtype
        and device, contiguous): a broadcast lands there with no copy. Else None."""
        t = self.tensor
        whole = self.dim is None or (self.start == 0 and self.length == self.shape[self.dim])
        if t is None or not whole or t.dtype != dtype or t.device != device \
                or not t.is_contiguous():
            return None
        return t


# A checkpoint tensor that loads into nothing (computed or tied), distinct from None.
SKIP = Destination(None)


class DecoderForCausalLM(nn.Module):
    def __init__(self, spec: DecoderSpec, tp: TensorParallel | None = None,
                 max_model_len: int | None = None) -> None:
        """`max_model_len`: the longest sequence served, which sizes the RoPE tables
        (default: the config's max_position_embeddings)."""
        super().__init__()
        self.spec = spec
        self.tp = tp = tp or TensorParallel.layout(spec)
        self.model = DecoderModel(spec, tp, max_model_len)
        self.lm_head = (None if spec.tie_word_embeddings
                        else VocabParallelEmbedding(spec.hidden_size, tp))
        # Checkpoint names whose parameters hold no values yet: allocated empty by a wake
        # from sleep level 2, not loaded since (every load path takes names out). An
        # engine serving from them would answer garbage with a 200.
        self.unloaded: set[str] = set()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        return self.model(input_ids, positions, meta, kv_caches)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden_size] -> logits [N, vocab_size] (gathered from every rank's
        vocabulary slice, so each rank has them all)."""
        logits = self.tp.all_gather_last(linear(hidden, self.head_weight))
        return logits if self.tp.size == 1 else logits[:, :self.spec.vocab_size]

    @property
    def head_weight(self) -> nn.Parameter:
        """The LM head's weight [vocab slice, hidden]: the embedding's, when tied."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def linear_weights(self) -> list[torch.Tensor]:
        """Every weight that multiplies through `linear` ([out, in]), the LM head's
        included: those the CPU may keep packed copies of (cpu_linear)."""
        return [m.weight for m in self.modules()
                if isinstance(m, (Linear, RowParallelLinear))] + [self.head_weight]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors in, any subset of them, as vLLM's models do (RL
        worker extensions push one tensor at a time this way); the checkpoint names
        loaded. A name the model does not have, or a wrong shape, raises naming it
        (the tensors before it are loaded). The loader checks a whole checkpoint's
        completeness against `checkpoint_keys`."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        unexpected: list[str] = []
        for name, tensor in weights:
            dest = self.destination(name, params)
            if dest is None:
                unexpected.append(name)
                continue
            try:
                dest.load(tensor)
            except ValueError as e:
                raise ValueError(f"shape mismatch for {name}: checkpoint {e}") from None
            loaded.add(name)
        self.unloaded -= loaded
        if unexpected:
            raise ValueError(f"no such weight in the model: {unexpected[:8]}"
                             f"{'...' if len(unexpected) > 8 else ''}")
        return loaded

    def checkpoint_keys(self) -> set[str]:
        """The checkpoint names our parameters load from (merged ones split back)."""
        keys = set()
        for name, _ in self.named_parameters():
            parts = [name.replace(merged, ckpt) for ckpt, merged, _ in _STACKED
                     if f".{merged}." in name]
            keys.update(parts or [name])
        return keys

    def destination(self, name: str, params: dict[str, nn.Parameter] | None = None
                    ) -> Destination | None:
        """Where checkpoint tensor `name` loads on this rank (the slice of a merged or
        sharded parameter); SKIP for tensors we compute or share; None for a name the
        model does not have."""
        if "rotary_emb.inv_freq" in name:
            return SKIP  # older checkpoints store the RoPE table; we compute it
        if name == "lm_head.weight" and self.lm_head is None:
            return SKIP  # some tied checkpoints still carry a copy
        target, shard = name, None
        for ckpt, merged, shard_id in _STACKED:
            if f".{ckpt}." in name:
                target, shard = name.replace(ckpt, merged), shard_id
                break
        param = (params if params is not None else dict(self.named_parameters())).get(target)
        if param is None:
            return None
        spec, tp, d = self.spec, self.tp, self.spec.head_dim
        if shard is None:
            if target.endswith(("embed_tokens.weight", "lm_head.weight")):
                rows = max(0, min(tp.vocab_size, spec.vocab_size - tp.vocab_start))
                return Destination(param[:rows], (spec.vocab_size, param.shape[1]), 0,
                                   tp.vocab_start, rows)
            if target.endswith(("o_proj.weight", "down_proj.weight")):  # row parallel
                full = spec.num_heads * d if "o_proj" in target else spec.intermediate_size
                width = param.shape[1]
                return Destination(param, (param.shape[0], full), 1, tp.rank * width, width)
            return Destination(param, tuple(param.shape))  # replicated
        if isinstance(shard, int):  # gate (0) / up (1): column parallel
            size = tp.intermediate_size
            return Destination(param[shard * size:(shard + 1) * size],
                               (spec.intermediate_size, *param.shape[1:]), 0,
                               tp.rank * size, size)
        q_size, kv_size = tp.num_heads * d, tp.num_kv_heads * d
        offset, size, full, start = {
            "q": (0, q_size, spec.num_heads * d, tp.rank * q_size),
            "k": (q_size, kv_size, spec.num_kv_heads * d, tp.kv_head_start * d),
            "v": (q_size + kv_size, kv_size, spec.num_kv_heads * d, tp.kv_head_start * d),
        }[shard]
        return Destination(param[offset:offset + size], (full, *param.shape[1:]), 0, start,
                           size)

