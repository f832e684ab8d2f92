"""`DecoderSpec`: what a model's config.json says, as the data a model is built from.

Most families differ only in data: qkv bias (Qwen2), q/k RMSNorm per head (Qwen3) or over
all heads (OLMoE), a head_dim independent of hidden_size, tied embeddings, the RoPE
variant (a second one for sliding layers: Gemma 3), sliding-window attention per layer,
the MLP's activation, the attention scale and logit soft-capping (Gemma 2), attention
sinks (gpt-oss), checkpoints storing q/k/v and gate/up fused (Phi-3), a
mixture-of-experts MLP (`MoeSpec`, with DeepSeek's grouped routing: `GroupedRouting`),
DeepSeek's multi-head latent attention (`MlaSpec`), and LFM2's short-convolution layers,
Qwen3.5's linear attention and the Mamba-2 mixers of the hybrids (Granite 4.0-H), which
keep a state per request instead of a KV cache (`ShortConvSpec`, `GatedDeltaNetSpec`,
`Mamba2Spec`).
Each family's reader (executor/model/registry.py's table) fills these from a transformers
config and refuses, naming the field, what the engine cannot serve. Apart from the
modules because more than the model reads it: the model config, the tensor-parallel
layout, the weight map and the engine core (`kv_window`: the KV cache manager frees
blocks no layer can see again).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagellm.executor.model.rope import RopeSpec

# The gated MLP's activations: SwiGLU (silu) and GeGLU with the tanh approximation
# (Gemma's gelu_pytorch_tanh). The MoE experts compute SwiGLU only.
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class GroupedRouting:
    """DeepSeek's router (deepseek.py): scores by `scoring` ("softmax" over all experts:
    DeepSeek-V2; "sigmoid" per expert: V3), a learned bias added to choose (V3's
    e_score_correction_bias, not to weigh), the choice limited to the `topk_group` best
    of `n_group` expert groups (a group scored by its best expert, "max": V2's
    group_limited_greedy, or its best two summed, "top2": V3; None: every expert may be
    chosen), the chosen experts weighted by their scores (renormalised where
    `MoeSpec.renormalize`) times `scaling`."""

    scoring: str  # "softmax" | "sigmoid"
    score_bias: bool
    group_score: str | None  # "max" | "top2" | None (greedy over all experts)
    n_group: int
    topk_group: int
    scaling: float  # routed_scaling_factor
    # What the renormalisation adds to the chosen weights' sum (LFM2-MoE's 1e-6).
    renorm_eps: float = 1e-20


@dataclass(frozen=True)
class MlaSpec:
    """DeepSeek's multi-head latent attention: keys and values of every head are
    up-projected (kv_b_proj) from one normalised latent of `kv_lora_rank` per token, plus
    one shared `qk_rope_head_dim` rotary key; queries come from q_proj, or from a
    `q_lora_rank` latent (q_a_proj, its norm, q_b_proj). The KV cache holds the latent and
    the rotary key: one "KV head" of kv_lora_rank + qk_rope_head_dim (the spec's
    head_dim; deepseek.py)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # The rotary dimensions pair up interleaved, (x0, x1), (x2, x3), ... (DeepSeek's own
    # layout; V3's rope_interleave), not as halves.
    rope_interleave: bool


@dataclass(frozen=True)
class Multipliers:
    """Granite's scalars (granite.py): the embedding times `embedding`, each block's
    output times `residual` before it joins the residual stream, the logits divided by
    `logits_scaling`."""

    embedding: float
    residual: float
    logits_scaling: float


@dataclass(frozen=True)
class MoeSpec:
    """A sparse mixture-of-experts MLP: a router picks `top_k` of `num_experts` SwiGLU
    experts per token (softmax over all experts, then top-k), their outputs summed with
    the routing weights (and a gated shared expert's, where the family has one)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    renormalize: bool  # the top-k weights divided by their sum (Mixtral; norm_topk_prob)
    # Per layer: a MoE block (True) or the dense MLP (Qwen3-MoE's mlp_only_layers and
    # decoder_sparse_step).
    sparse_layers: tuple[bool, ...]
    # Routing weights rounded to the model's dtype before they scale the experts' outputs
    # (Qwen3-MoE, OLMoE); Mixtral keeps them in float32.
    weights_in_model_dtype: bool = True
    # A shared expert's intermediate size (Qwen2-MoE: a SwiGLU MLP every token runs, its
    # output scaled by sigmoid(shared_expert_gate(x)) and added); 0: none.
    shared_expert_size: int = 0
    # gpt-oss's clamped SwiGLU experts (alpha, limit): gate clamped above at limit, up to
    # [-limit, limit], (up + 1) * gate * sigmoid(alpha * gate); None: SiLU(gate) * up.
    swiglu: tuple[float, float] | None = None
    # The checkpoint stores each layer's experts stacked, under the model's own parameter
    # names (gpt-oss, whose module maps its layout), not one tensor per expert.
    checkpoint_stacked: bool = False
    # DeepSeek's routing (scores, groups, scaling), its shared experts ungated; None: the
    # softmax-then-top-k router above.
    grouped: GroupedRouting | None = None

    def __post_init__(self) -> None:
        """config.json may say 0 experts and 0 per token (Granite 4.0: none); a family
        that builds this block needs 1 <= top-k <= experts."""
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"a mixture-of-experts layer needs 1 <= num_experts_per_tok "
                             f"<= the number of experts, got {self.top_k} of "
                             f"{self.num_experts}")


@dataclass(frozen=True)
class ShortConvSpec:
    """LFM2's gated short convolutions (lfm2.py) in the layers `layers` marks (True; the
    others attend): each channel of B * x convolved causally over the request's last
    `kernel` tokens (conv_L_cache), then gated by C. Such a layer keeps no KV cache but
    a state per request: the last kernel - 1 inputs of its convolution."""

    kernel: int
    bias: bool  # conv_bias: in_proj, the convolution and out_proj all have biases
    layers: tuple[bool, ...]


@dataclass(frozen=True)
class GatedDeltaNetSpec:
    """Qwen3.5's linear attention (qwen3_5.py: the gated delta rule) in the layers `layers`
    marks (True; the others attend, their output gated): keys and queries of
    `num_k_heads` heads of `head_k_dim`, values of `num_v_heads` of `head_v_dim`, after a
    causal convolution of `conv_kernel` taps. Such a layer keeps no KV cache but a state
    per request: the convolution's last inputs and a [head_k_dim, head_v_dim] memory
    per value head."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    layers: tuple[bool, ...]

    @property
    def conv_dim(self) -> int:
        """The convolved channels: queries, keys and values."""
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim


@dataclass(frozen=True)
class Mamba2Spec:
    """Mamba-2's selective state-space mixer (mamba2.py) in the layers `layers` marks
    (True; the others attend): `num_heads` heads of `head_dim` channels, each reading a
    [d_state] key (B) and query (C) of one of `n_groups` groups, after a causal
    convolution of `conv_kernel` taps over x, B and C. Such a layer keeps no KV cache but
    a state per request: the convolution's last inputs and a [d_state, head_dim] memory
    per head."""

    num_heads: int
    head_dim: int
    n_groups: int
    d_state: int
    conv_kernel: int
    conv_bias: bool  # the convolution's bias
    proj_bias: bool  # in_proj's and out_proj's biases
    layers: tuple[bool, ...]

    @property
    def inner(self) -> int:
        """The mixer's width: num_heads x head_dim channels (z, x and y each)."""
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """The convolved channels: x, then B and C of every group."""
        return self.inner + 2 * self.n_groups * self.d_state


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
    qk_norm: str | None  # "head": RMSNorm over each head (Qwen3); "full": over all (OLMoE)
    tie_word_embeddings: bool
    max_position: int
    rope: RopeSpec
    architecture: str = "LlamaForCausalLM"
    # Per layer, the sliding window (keys p - W < j <= p are visible to position p) or
    # None (full causal attention); empty when no layer slides.
    layer_windows: tuple[int | None, ...] = ()
    clip_qkv: float | None = None  # q, k and v clamped to [-clip, clip] (OLMoE)
    moe: MoeSpec | None = None
    hidden_act: str = "silu"  # the gated MLP's activation (SUPPORTED_ACTIVATIONS)
    attn_scale: float | None = None  # scores' scale; None: head_dim ** -0.5
    # Soft-capping c * tanh(x / c) of the attention scores (Gemma 2) and of the final
    # logits (Gemma 2, Gemma 3 if set); None: off.
    attn_softcap: float | None = None
    final_logit_softcap: float | None = None
    # The RoPE of the sliding-window layers where it differs from `rope` (Gemma 3's
    # rope_local_base_freq); None: every layer rotates with `rope`.
    sliding_rope: RopeSpec | None = None
    # Our merged modules the checkpoint stores fused, as this model holds them, not apart
    # (q/k/v_proj, gate/up_proj): Phi-3's "qkv_proj" and "gate_up_proj", GLM-4's
    # "gate_up_proj" (weight_map.py).
    fused_checkpoint: tuple[str, ...] = ()
    # A learned logit per query head in every softmax's denominator (gpt-oss's
    # `self_attn.sinks`; kernels/reference.py).
    attn_sinks: bool = False
    # Granite's embedding, residual and logit scalars; None: all 1.
    multipliers: Multipliers | None = None
    # The logits times this (Cohere's logit_scale, cohere.py); None: as they are.
    logit_scale: float | None = None
    # Which layers rotate q and k (SmolLM3's no_rope_layers: every fourth does not;
    # Cohere 2's and EXAONE 4's global layers do not); empty: every layer. The shared
    # attention reads it (decoder.py).
    rope_layers: tuple[bool, ...] = ()
    # DeepSeek's latent attention (num_kv_heads 1 and head_dim the latent's width: what
    # the KV cache holds per token); None: q/k/v projections of heads of head_dim.
    mla: MlaSpec | None = None
    # LFM2's short-convolution layers and Qwen3.5's linear-attention ones; None: every
    # layer attends.
    short_conv: ShortConvSpec | None = None
    linear_attention: GatedDeltaNetSpec | None = None
    mamba: Mamba2Spec | None = None  # the Mamba-2 layers of a hybrid (Granite 4.0-H)
    # The attention's output times sigmoid of a gate the query projection also computes
    # (Qwen3.5: q_proj is twice as wide, each head's query then its gate).
    attn_output_gate: bool = False

    def has_kv(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` attends (a paged KV cache), rather than keeping a
        state per request (a short-convolution, linear-attention or Mamba-2 layer)."""
        return not any(mixer is not None and mixer.layers[layer_idx]
                       for mixer in (self.short_conv, self.linear_attention, self.mamba))

    @property
    def conv_kernel(self) -> int | None:
        """The taps of the stateful layers' causal convolution (each kind has one), or
        None for a model whose every layer attends."""
        for mixer in (self.short_conv, self.linear_attention, self.mamba):
            if mixer is not None and any(mixer.layers):
                return mixer.kernel if isinstance(mixer, ShortConvSpec) else mixer.conv_kernel
        return None

    @property
    def num_kv_layers(self) -> int:
        """The layers with a paged KV cache (what a KV block holds a slice of per layer)."""
        return sum(self.has_kv(i) for i in range(self.num_layers))

    @property
    def has_state(self) -> bool:
        """Some layer keeps a state per request, which no KV block holds: it cannot be
        restored from a cached prefix or rolled back after rejected proposals."""
        return self.num_kv_layers < self.num_layers

    def rotates(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` applies RoPE (False: a NoPE layer)."""
        return not self.rope_layers or self.rope_layers[layer_idx]

    def window(self, layer_idx: int) -> int | None:
        """Layer `layer_idx`'s sliding window, or None for full attention."""
        return self.layer_windows[layer_idx] if self.layer_windows else None

    @property
    def kv_planes(self) -> int:
        """What a layer's cache holds per token: keys and values (2), or one entry that
        is its own value (1: DeepSeek's latent, deepseek.py; the K and V halves of the
        layer's cache are then views of one tensor: executor/worker/model_runner.py)."""
        return 1 if self.mla is not None else 2

    @property
    def kv_window(self) -> int | None:
        """The window when every layer slides (the engine core then frees KV blocks older
        than it), else None: one full-attention layer reads every block."""
        windows = self.layer_windows
        if not windows or any(w is None for w in windows):
            return None
        return max(w for w in windows if w is not None)


def read_layer_windows(config: Any) -> tuple[int | None, ...]:
    """transformers 5's per-layer windows: `sliding_window` with `layer_types` (Qwen2/3
    set it to None unless `use_sliding_window`; Gemma alternates), or every layer when a
    config has a window and no layer types (Mistral)."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return ()
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding_window must be a positive integer, got {window!r}")
    layer_types = getattr(config, "layer_types", None)
    num_layers = config.num_hidden_layers
    if not layer_types:
        return (window,) * num_layers
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for "
                         f"num_hidden_layers={num_layers}")
    unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise ValueError(f"unsupported layer_types {unknown} (supported: "
                         "sliding_attention, full_attention)")
    windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
    return windows if any(w is not None for w in windows) else ()


def read_decoder_spec(config: Any, architecture: str, **fields: Any) -> DecoderSpec:
    """The fields every family reads the same way from `config`, with `fields` (the
    family's own) on top (a family passing `rope` reads its own RoPE settings, and
    `hidden_act` its own activation field); refuses an activation the MLP does not
    compute and RoPE settings that do not fit the heads."""
    act = fields.get("hidden_act", getattr(config, "hidden_act", "silu"))
    if act not in SUPPORTED_ACTIVATIONS:
        raise ValueError(f"unsupported hidden_act {act!r} (supported: "
                         f"{', '.join(SUPPORTED_ACTIVATIONS)})")
    if act != "silu" and fields.get("moe") is not None:
        raise ValueError(f"unsupported hidden_act {act!r} for mixture-of-experts layers "
                         "(supported: silu)")
    num_heads = config.num_attention_heads
    attention_bias = bool(getattr(config, "attention_bias", False))
    common: dict[str, Any] = dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // num_heads,
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        qk_norm=None,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        max_position=config.max_position_embeddings,
        architecture=architecture,
        layer_windows=read_layer_windows(config),
        hidden_act=act,
    )
    if "rms_norm_eps" not in fields:  # (Cohere's layer_norm_eps is its reader's)
        common["rms_norm_eps"] = config.rms_norm_eps
    if "rope" not in fields:
        common["rope"] = RopeSpec.from_hf(getattr(config, "rope_parameters", None),
                                          getattr(config, "rope_theta", None),
                                          getattr(config, "rope_scaling", None))
    common.update(fields)
    spec = DecoderSpec(**common)
    if not spec.num_kv_layers:  # (a model of stateful layers only: no block to schedule by)
        raise ValueError("layer_types must include at least one 'full_attention' layer: "
                         "the engine schedules requests by their KV cache blocks")
    rotated = spec.head_dim if spec.mla is None else spec.mla.qk_rope_head_dim
    for rope in (spec.rope, spec.sliding_rope):
        if rope is not None:
            rope.validate(rotated)
    return spec
