"""One decoder for the Llama, Mistral, Qwen2/Qwen2.5, Qwen3, Qwen3-MoE, Mixtral and OLMoE
families.

The families differ only in data, carried by `DecoderSpec` (spec.py): qkv bias (Qwen2),
q/k RMSNorm per head (Qwen3) or over all heads (OLMoE), q/k/v clipping (OLMoE), a
head_dim independent of hidden_size, tied embeddings, the RoPE variant (partial rotary and
LongRoPE: Phi-3) and the layers without it (SmolLM3), per-layer sliding windows (Mistral),
the MLP's activation, and a sparse mixture-of-experts MLP in the layers the spec marks
(moe.py). q/k/v and gate/up projections are stored merged (one GEMM each);
`load_weights` maps the checkpoint's separate tensors (or Phi-3's fused ones) into them.

This module is the family's own part: its attention block, MLP, layer and model, built
from the shared layers (layers.py: linear, norm, tensor-parallel layers) and loaded
through the shared weight map (weight_map.py). A family whose computation differs
(gemma.py, gpt_oss.py, deepseek.py) subclasses these, choosing its norm, attention,
MoE, layer and model classes through the `norm_cls` / `attention_cls` / `moe_cls` /
`layer_cls` / `model_cls` class attributes. Under tensor parallelism
(executor/model/parallel.py) each rank builds the same modules with its slice's sizes:
`destination` says which slice of which checkpoint tensor loads into which parameter,
and the two row-parallel projections and the embedding all-reduce.

The forward pass takes the step's flat, unpadded token batch:
    input_ids [T], positions [T] -> hidden states [T, hidden_size]
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from pagellm.executor.model import weight_map
from pagellm.executor.model.attention import Attention, AttentionMetadata
from pagellm.executor.model.layers import (
    Linear,
    RMSNorm,
    RowParallelLinear,
    ShardedRMSNorm,
    VocabParallelEmbedding,
)
from pagellm.executor.model.linear import linear
from pagellm.executor.model.mlp import DecoderMLP
from pagellm.executor.model.moe import SparseMoeBlock
from pagellm.executor.model.parallel import TensorParallel
from pagellm.executor.model.quantize import requantizing
from pagellm.executor.model.rope import RotaryEmbedding, apply_rotary
from pagellm.executor.model.spec import DecoderSpec
from pagellm.executor.model.weight_map import Destination


class DecoderAttention(nn.Module):
    norm_cls: ClassVar[type[RMSNorm]] = RMSNorm  # of the per-head q/k norms
    full_norm_cls: ClassVar[type[ShardedRMSNorm]] = ShardedRMSNorm  # of the all-head ones

    def __init__(self, spec: DecoderSpec, layer_idx: int, tp: TensorParallel) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (tp.num_heads, tp.num_kv_heads,
                                                            spec.head_dim)
        self.q_size = tp.num_heads * spec.head_dim
        self.kv_size = tp.num_kv_heads * spec.head_dim
        # [queries (each head's query then, with an output gate, its gate) | k | v]
        self.q_rows = self.q_size * (2 if spec.attn_output_gate else 1)
        self.qkv_proj = Linear(spec.hidden_size, self.q_rows + 2 * self.kv_size,
                               bias=spec.qkv_bias)
        self.o_proj = RowParallelLinear(self.q_size, spec.hidden_size, spec.o_bias, tp)
        self.q_norm: RMSNorm | ShardedRMSNorm | None = None
        self.k_norm: RMSNorm | ShardedRMSNorm | None = None
        if spec.qk_norm == "head":
            self.q_norm = self.norm_cls(spec.head_dim, spec.rms_norm_eps)
            self.k_norm = self.norm_cls(spec.head_dim, spec.rms_norm_eps)
        elif spec.qk_norm == "full":  # over this rank's heads, the statistic over all
            replicas = max(1, tp.size // spec.num_kv_heads)  # ranks sharing a KV head
            self.q_norm = self.full_norm_cls(self.q_size, spec.num_heads * spec.head_dim,
                                             spec.rms_norm_eps, tp, 1)
            self.k_norm = self.full_norm_cls(self.kv_size, spec.num_kv_heads * spec.head_dim,
                                             spec.rms_norm_eps, tp, replicas)
        self.clip_qkv = spec.clip_qkv
        self.rotates = spec.rotates(layer_idx)  # False: a NoPE layer (SmolLM3, Cohere 2)
        scale = spec.head_dim ** -0.5 if spec.attn_scale is None else spec.attn_scale
        self.attn = Attention(layer_idx, scale, sliding_window=spec.window(layer_idx),
                              softcap=spec.attn_softcap)
        # gpt-oss's attention sinks: this rank's heads' (weight_map.py slices them)
        self.sinks = nn.Parameter(torch.empty(tp.num_heads)) if spec.attn_sinks else None

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                meta: AttentionMetadata, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        tokens, heads, qk_size = x.shape[0], self.num_heads, self.q_size + self.kv_size
        qkv = self.qkv_proj(x)  # [T, (H + 2 * H_kv) * D]
        v = qkv[:, qk_size:].view(tokens, self.num_kv_heads, self.head_dim)
        cos, sin = rope if self.rotates else (rope[0][..., :0], rope[1][..., :0])
        if isinstance(self.q_norm, ShardedRMSNorm) and isinstance(self.k_norm, ShardedRMSNorm):
            q = self.q_norm(qkv[:, :self.q_size])
            k = self.k_norm(qkv[:, self.q_size:qk_size])
            if self.clip_qkv is not None:  # OLMoE clips after its norms
                q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
            q = self.rotate(q.view(tokens, heads, self.head_dim), cos, sin)
            k = self.rotate(k.view(tokens, -1, self.head_dim), cos, sin)
        elif self.q_norm is not None and self.k_norm is not None:
            q, _ = self.q_norm(qkv[:, :self.q_size].view(tokens, heads, self.head_dim))
            k, _ = self.k_norm(qkv[:, self.q_size:qk_size].view(tokens, -1, self.head_dim))
            q, k = self.rotate(q, cos, sin), self.rotate(k, cos, sin)
        else:  # q and k side by side: one rotation for both
            qk = self.rotate(qkv[:, :qk_size].view(tokens, -1, self.head_dim), cos, sin)
            q, k = qk[:, :heads], qk[:, heads:]
        out = self.attn(q, k, v, meta, kv_caches, self.sinks)  # [T, H, D]
        return self.o_proj(out.reshape(tokens, self.q_size))

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor
               ) -> torch.Tensor:
        """x: [T, H, D] queries or keys -> rotated (RoPE on halves: rope.apply_rotary; a
        family that pairs its dimensions otherwise reorders them here, glm4.py). A NoPE
        layer's tables have width 0: nothing turns."""
        return apply_rotary(x, cos, signed_sin)


class DecoderLayer(nn.Module):
    norm_cls: ClassVar[type[RMSNorm]] = RMSNorm  # of the input and post-attention norms
    moe_cls: ClassVar[type[nn.Module]] = SparseMoeBlock  # of the sparse layers' MLP
    # (spec, layer_idx, tp); forward(rope, x, meta, kv_caches): DeepSeek's latent one
    attention_cls: ClassVar[type[nn.Module]] = DecoderAttention

    def __init__(self, spec: DecoderSpec, layer_idx: int, tp: TensorParallel) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(spec, layer_idx, tp)
        sparse = spec.moe is not None and spec.moe.sparse_layers[layer_idx]
        self.mlp: nn.Module = self.moe_cls(spec, tp) if sparse else DecoderMLP(spec, tp)
        self.input_layernorm = self.norm_cls(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = self.norm_cls(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                residual: torch.Tensor | None, meta: AttentionMetadata,
                kv_caches: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(rope, h, meta, kv_caches)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class DecoderModel(nn.Module):
    layer_cls: ClassVar[type[nn.Module]] = DecoderLayer
    norm_cls: ClassVar[type[RMSNorm]] = RMSNorm  # of the final norm

    def __init__(self, spec: DecoderSpec, tp: TensorParallel,
                 max_model_len: int | None = None) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(spec.hidden_size, tp)
        self.layers = nn.ModuleList(self.layer_cls(spec, i, tp)
                                    for i in range(spec.num_layers))
        self.norm = self.norm_cls(spec.hidden_size, spec.rms_norm_eps)
        # Tables for the positions that can occur (max_model_len); the config's
        # max_position_embeddings still drives the RoPE scaling math.
        self.rotary_emb = self.make_rotary(spec, max_model_len)

    def make_rotary(self, spec: DecoderSpec, max_model_len: int | None) -> RotaryEmbedding:
        """The RoPE tables (the loader calls their `reset_cache()` once the model is on
        its device)."""
        return RotaryEmbedding(spec.rope, spec.head_dim, spec.max_position, max_model_len)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> the first layer's input [T, hidden] (a family scales it:
        Gemma, Granite)."""
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        x = self.embed(input_ids)
        rope = self.rotary_emb.cos_sin(positions, x.dtype)  # looked up once for all layers
        residual = None
        for layer in self.layers:
            x, residual = layer(rope, x, residual, meta, kv_caches)
        x, _ = self.norm(x, residual)
        return x


class DecoderForCausalLM(nn.Module):
    model_cls: ClassVar[type[DecoderModel]] = DecoderModel
    # (ours, the checkpoint's): name fragments (".self_attn.o_proj.") a family's
    # checkpoints spell their own way (lfm2.py); every name in and out is translated.
    checkpoint_renames: ClassVar[tuple[tuple[str, str], ...]] = ()

    def __init__(self, spec: DecoderSpec, tp: TensorParallel | None = None,
                 max_model_len: int | None = None) -> None:
        """`max_model_len`: the longest sequence served, which sizes the RoPE tables
        (default: the config's max_position_embeddings)."""
        super().__init__()
        self.spec = spec
        self.tp = tp = tp or TensorParallel.layout(spec)
        self.model = self.model_cls(spec, tp, max_model_len)
        self.lm_head = (None if spec.tie_word_embeddings
                        else VocabParallelEmbedding(spec.hidden_size, tp))
        # Checkpoint names whose parameters hold no values yet: allocated empty by a wake
        # from sleep level 2, not loaded since (every load path takes names out). An
        # engine serving from them would answer garbage with a 200.
        self.unloaded: set[str] = set()
        # The projections quantized on load (quantize.py), by their placeholder weight's
        # id: updates of those weights are quantized as they land.
        self.quantized: dict[int, nn.Module] = {}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        return self.model(input_ids, positions, meta, kv_caches)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden_size] -> logits [N, vocab_size] (gathered from every rank's
        vocabulary slice, so each rank has them all), soft-capped where the family caps
        them (Gemma 2), here, so that sampling and logprobs both see the capped logits as
        transformers' do (its ops, in the logits' dtype)."""
        logits = self.tp.all_gather_last(linear(hidden, self.head_weight))
        if self.tp.size > 1:
            logits = logits[:, :self.spec.vocab_size]
        cap = self.spec.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

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
        worker extensions push one tensor at a time this way); returns the checkpoint
        names loaded (the family's own: weight_map.canonical_keys). A name the model
        does not have, or a wrong shape, raises naming it (the tensors before it are
        loaded). The loader checks a whole checkpoint's completeness against
        `checkpoint_keys`."""
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
            loaded.update(self.canonical_keys(name))
        self.unloaded -= loaded
        if unexpected:
            raise ValueError(f"no such weight in the model: {unexpected[:8]}"
                             f"{'...' if len(unexpected) > 8 else ''}")
        return loaded

    def checkpoint_keys(self) -> set[str]:
        """The checkpoint names our parameters load from (merged ones split back, unless
        the family's checkpoints store them fused)."""
        return {self.checkpoint_name(key) for key in weight_map.checkpoint_keys(
            (name for name, _ in self.named_parameters()), self.spec)}

    def checkpoint_parts(self, module: str) -> list[str]:
        """The checkpoint modules our `module` (a projection's name) is made of."""
        return [self.checkpoint_name(part)
                for part in weight_map.checkpoint_parts(module, self.spec)]

    def canonical_keys(self, name: str) -> list[str]:
        """The checkpoint keys (the family's own names) that checkpoint tensor `name`
        fills (weight_map.canonical_keys, in our spelling and back)."""
        if not self.checkpoint_renames:
            return weight_map.canonical_keys(name, self.spec)
        return [self.checkpoint_name(key)
                for key in weight_map.canonical_keys(self.our_name(name), self.spec)]

    def checkpoint_name(self, ours: str) -> str:
        """Our name `ours` as the family's checkpoints spell it (`checkpoint_renames`)."""
        name = f".{ours}"
        for fragment, theirs in self.checkpoint_renames:
            name = name.replace(fragment, theirs)
        return name[1:]

    def our_name(self, checkpoint: str) -> str:
        """Checkpoint name `checkpoint` as our parameters spell it."""
        name = f".{checkpoint}"
        for ours, fragment in self.checkpoint_renames:
            name = name.replace(fragment, ours)
        return name[1:]

    def state_shapes(self, rows: int) -> dict[int, tuple[tuple[int, ...], torch.dtype]]:
        """The per-request state (shape, dtype) of each layer that keeps one instead of a
        KV cache, by layer index, for `rows` requests: the runner allocates them beside
        the KV cache (lfm2.py: a short convolution's last inputs; qwen3_5.py: the linear
        attention's). None here."""
        return {}

    def mark_loaded(self, names: Iterable[str]) -> None:
        """Checkpoint tensors `names` now hold values (a wake from level 2 left them
        empty): their family keys leave `unloaded`."""
        for name in names:
            self.unloaded.difference_update(self.canonical_keys(name))

    def destination(self, name: str, params: dict[str, nn.Parameter] | None = None
                    ) -> Destination | None:
        """Where checkpoint tensor `name` loads on this rank (weight_map.py); SKIP for
        tensors we compute or share; None for a name the model does not have. Into a
        projection quantized on load, the tensor is quantized as it lands
        (quantize.RequantizingDestination)."""
        dest = self.family_destination(
            self.our_name(name) if self.checkpoint_renames else name,
            params if params is not None else dict(self.named_parameters()))
        if self.quantized and dest is not None and dest.tensor is not None:
            base = dest.tensor if dest.tensor._base is None else dest.tensor._base
            module = self.quantized.get(id(base))
            if module is not None:
                return requantizing(dest, module)
        return dest

    def family_destination(self, name: str, params: dict[str, nn.Parameter]
                           ) -> Destination | None:
        """`destination` before quantization: the shared weight map's. A family whose
        checkpoint lays a tensor out differently maps it here (gpt_oss.py). `name` is
        in our spelling (`checkpoint_renames` applied)."""
        return weight_map.destination(name, params, self.spec, self.tp,
                                      tied=self.lm_head is None)
