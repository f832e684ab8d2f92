"""The architectures served: for each, how its config reads into a `DecoderSpec` and
which model class it builds.

Families that differ from Llama only in data are a reader here and the shared decoder
(decoder.py, whose MLP is the sparse MoE block of moe.py where the spec has experts); a
family whose computation differs brings its own module with a reader and a model class
(gemma.py, gpt_oss.py, deepseek.py, glm4.py, glm4_moe.py, minimax_m2.py, cohere.py,
olmo2.py, exaone4.py, granite.py, lfm2.py, qwen3_5.py, granitemoehybrid.py).
Adding a family is that module and one row of `FAMILIES`.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from pagellm.executor.model.rope import RopeSpec, yarn_mscale
from pagellm.executor.model.spec import (
    DecoderSpec,
    GatedDeltaNetSpec,
    GroupedRouting,
    Mamba2Spec,
    MlaSpec,
    MoeSpec,
    Multipliers,
    ShortConvSpec,
    read_decoder_spec,
)

if TYPE_CHECKING:  # the model modules import torch's layers: only when a model is built
    from pagellm.executor.model.decoder import DecoderForCausalLM


@dataclass(frozen=True)
class Family:
    model_type: str  # config.json's, for configs that do not list "architectures"
    read: Callable[[Any, str], DecoderSpec]  # (transformers config, architecture)
    model: Callable[[], type[DecoderForCausalLM]]  # imported when a model is built


def _lazy(module: str, name: str) -> Callable[[], type[DecoderForCausalLM]]:
    """Class `name` of executor/model/`module`.py, imported when a model is built (the
    model modules import torch's layers; reading a config does not)."""
    def load() -> type[DecoderForCausalLM]:
        return getattr(importlib.import_module(f"pagellm.executor.model.{module}"), name)

    return load


_decoder = _lazy("decoder", "DecoderForCausalLM")
_gemma = _lazy("gemma", "GemmaForCausalLM")
_deepseek = _lazy("deepseek", "DeepseekForCausalLM")
_olmo2 = _lazy("olmo2", "Olmo2ForCausalLM")


def _sparse_layers(config: Any) -> tuple[bool, ...]:
    """Qwen3-MoE's rule: layer i is sparse unless listed in `mlp_only_layers`, every
    `decoder_sparse_step`-th layer (1: all of them)."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    dense = set(getattr(config, "mlp_only_layers", None) or ())
    return tuple(i not in dense and (i + 1) % step == 0
                 for i in range(config.num_hidden_layers))


def _moe(config: Any, num_experts: int, renormalize: bool,
         weights_in_model_dtype: bool = True) -> MoeSpec:
    return MoeSpec(num_experts=num_experts, top_k=config.num_experts_per_tok,
                   intermediate_size=getattr(config, "moe_intermediate_size", None)
                   or config.intermediate_size,
                   renormalize=renormalize, sparse_layers=_sparse_layers(config),
                   weights_in_model_dtype=weights_in_model_dtype,
                   shared_expert_size=getattr(config, "shared_expert_intermediate_size", 0)
                   or 0)


def _llama(config: Any, arch: str) -> DecoderSpec:
    return read_decoder_spec(config, arch)


def _qwen2(config: Any, arch: str) -> DecoderSpec:
    # Qwen2 always has q/k/v biases and never an o_proj bias.
    return read_decoder_spec(config, arch, qkv_bias=True, o_bias=False)


def _qwen3(config: Any, arch: str) -> DecoderSpec:
    return read_decoder_spec(config, arch, qk_norm="head")


def _qwen2_moe(config: Any, arch: str) -> DecoderSpec:
    # Qwen2's attention (q/k/v biases where `qkv_bias`, the default; no o_proj bias) and
    # Qwen3-MoE's routing, with a shared expert in every sparse layer.
    return read_decoder_spec(config, arch, qkv_bias=bool(getattr(config, "qkv_bias", True)),
                             o_bias=False, moe=_moe(config, config.num_experts,
                                                    bool(config.norm_topk_prob)))


def _qwen3_moe(config: Any, arch: str) -> DecoderSpec:
    return read_decoder_spec(config, arch, qk_norm="head",
                             moe=_moe(config, config.num_experts,
                                      bool(config.norm_topk_prob)))


def _mixtral(config: Any, arch: str) -> DecoderSpec:
    return read_decoder_spec(config, arch, moe=_moe(config, config.num_local_experts,
                                                    renormalize=True,
                                                    weights_in_model_dtype=False))


def _olmoe(config: Any, arch: str) -> DecoderSpec:
    return read_decoder_spec(config, arch, qk_norm="full",
                             clip_qkv=getattr(config, "clip_qkv", None),
                             moe=_moe(config, config.num_experts,
                                      bool(config.norm_topk_prob)))


def _gemma_common(config: Any, arch: str, **fields: Any) -> DecoderSpec:
    """What Gemma 2 and 3 read alike: GeGLU from `hidden_activation` (their MLP's field;
    configs also carry a `hidden_act` transformers ignores), the attention scale from
    query_pre_attn_scalar, the final logit soft-capping; causal attention only."""
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention=True is not supported (causal "
                         "attention only)")
    act = getattr(config, "hidden_activation", None) or "gelu_pytorch_tanh"
    return read_decoder_spec(config, arch, hidden_act=act,
                             attn_scale=config.query_pre_attn_scalar ** -0.5,
                             final_logit_softcap=_softcap(config, "final_logit_softcapping"),
                             **fields)


def _softcap(config: Any, field: str) -> float | None:
    value = getattr(config, field, None)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{field} must be a positive number or null, got {value!r}")
    return float(value)


def _gemma2(config: Any, arch: str) -> DecoderSpec:
    return _gemma_common(config, arch,
                         attn_softcap=_softcap(config, "attn_logit_softcapping"))


def _gemma3(config: Any, arch: str) -> DecoderSpec:
    """Gemma 3 text: q/k norms per head; rope_parameters per layer type (transformers 5
    nests them: "full_attention" with rope_theta and scaling, "sliding_attention" with
    rope_local_base_freq). transformers' Gemma 3 attention does not pass
    attn_logit_softcapping on (its configs leave it null): neither do we."""
    params = getattr(config, "rope_parameters", None) or {}
    full = params.get("full_attention")
    sliding = params.get("sliding_attention")
    if full is None or sliding is None:
        raise ValueError("gemma3_text rope_parameters must have 'full_attention' and "
                         f"'sliding_attention' entries, got {sorted(params)}")
    return _gemma_common(config, arch, qk_norm="head",
                         rope=RopeSpec.from_hf(full, None, None),
                         sliding_rope=RopeSpec.from_hf(sliding, None, None))


def _gpt_oss_spec(config: Any, arch: str) -> DecoderSpec:
    """gpt-oss: every layer a MoE of clamped-SwiGLU experts with biases (the top-k
    softmax is over the k chosen logits: renormalised), attention sinks, stacked
    experts in its checkpoint (gpt_oss.py). The SwiGLU's alpha and limit default to
    the values transformers 5.0 hard-coded (its config has no such fields; OpenAI's
    config.json gives swiglu_limit, which later releases and vLLM read)."""
    moe = MoeSpec(num_experts=config.num_local_experts, top_k=config.num_experts_per_tok,
                  intermediate_size=config.intermediate_size, renormalize=True,
                  sparse_layers=(True,) * config.num_hidden_layers,
                  swiglu=(float(getattr(config, "swiglu_alpha", 1.702)),
                          float(getattr(config, "swiglu_limit", 7.0))),
                  checkpoint_stacked=True)
    return read_decoder_spec(config, arch, moe=moe, attn_sinks=True)


def _deepseek_moe(config: Any, routing: GroupedRouting) -> MoeSpec:
    """DeepSeek's experts (also GLM-4.5's): `routing`, shared experts of n_shared_experts
    times an expert's width, dense MLPs in the first first_k_dense_replace layers (or
    where `mlp_layer_types` says "dense": GLM-4.7-Flash)."""
    experts = config.n_routed_experts
    if experts % routing.n_group:
        raise ValueError(f"n_routed_experts ({experts}) must be a multiple of n_group "
                         f"({routing.n_group})")
    per_group = experts // routing.n_group
    if routing.topk_group > routing.n_group:
        raise ValueError(f"topk_group ({routing.topk_group}) must be at most n_group "
                         f"({routing.n_group})")
    if config.num_experts_per_tok > routing.topk_group * per_group:
        raise ValueError(f"num_experts_per_tok ({config.num_experts_per_tok}) must be at "
                         f"most the experts of topk_group ({routing.topk_group}) groups")
    if routing.group_score == "top2" and per_group < 2:
        raise ValueError(f"n_group ({routing.n_group}) leaves fewer than two experts per "
                         "group, which V3's group scores (the best two summed) need")
    layers = config.num_hidden_layers
    types = getattr(config, "mlp_layer_types", None)
    if types:
        if len(types) != layers or set(types) - {"dense", "sparse"}:
            raise ValueError(f"mlp_layer_types must list 'dense' or 'sparse' for each of the "
                             f"{layers} layers, got {types!r}")
        sparse = tuple(t == "sparse" for t in types)
    else:
        first_dense = getattr(config, "first_k_dense_replace", 0) or 0
        sparse = tuple(i >= first_dense for i in range(layers))
    moe_size = config.moe_intermediate_size
    return MoeSpec(num_experts=experts, top_k=config.num_experts_per_tok,
                   intermediate_size=moe_size, renormalize=bool(config.norm_topk_prob),
                   sparse_layers=sparse, weights_in_model_dtype=False,
                   shared_expert_size=moe_size * (config.n_shared_experts or 0),
                   grouped=routing)


def _v3_routing(config: Any) -> GroupedRouting:
    """DeepSeek-V3's router: sigmoid scores, a learned bias for the choice
    (e_score_correction_bias), the choice within the topk_group best of n_group groups
    (each scored by its best two experts), weights from the unbiased scores."""
    return GroupedRouting(scoring="sigmoid", score_bias=True, group_score="top2",
                          n_group=config.n_group or 1, topk_group=config.topk_group or 1,
                          scaling=float(config.routed_scaling_factor))


def _deepseek_spec(config: Any, arch: str, routing: GroupedRouting,
                   rope_interleave: bool) -> DecoderSpec:
    """DeepSeek-V2/V3 (and their kin: Kimi K2, Moonlight, GLM-4.7-Flash): latent
    attention (`MlaSpec`) and experts with shared experts and the family's routing
    (`_deepseek_moe`). The scale of the scores is qk_head_dim ** -0.5, times YaRN's
    mscale(factor, mscale_all_dim) squared where the RoPE is YaRN (the attention's own
    temperature; the tables carry mscale / mscale_all_dim)."""
    mla = MlaSpec(q_lora_rank=config.q_lora_rank, kv_lora_rank=config.kv_lora_rank,
                  qk_nope_head_dim=config.qk_nope_head_dim,
                  qk_rope_head_dim=config.qk_rope_head_dim, v_head_dim=config.v_head_dim,
                  rope_interleave=rope_interleave)
    rope = RopeSpec.from_hf(getattr(config, "rope_parameters", None),
                            getattr(config, "rope_theta", None),
                            getattr(config, "rope_scaling", None))
    scale = (mla.qk_nope_head_dim + mla.qk_rope_head_dim) ** -0.5
    mscale_all_dim = rope.params.get("mscale_all_dim")
    if rope.rope_type != "default" and mscale_all_dim:
        scale *= yarn_mscale(rope.params.get("factor", 1.0), mscale_all_dim) ** 2
    return read_decoder_spec(config, arch, num_kv_heads=1,
                             head_dim=mla.kv_lora_rank + mla.qk_rope_head_dim, rope=rope,
                             attn_scale=scale, moe=_deepseek_moe(config, routing), mla=mla)


def _deepseek_v2(config: Any, arch: str) -> DecoderSpec:
    """DeepSeek-V2 / V2-Lite / V2.5: softmax scores, greedy or group-limited (groups
    scored by their best expert) top-k, weights scaled by routed_scaling_factor and
    renormalised where norm_topk_prob (DeepSeek's and vLLM's code; transformers' ignores
    the field, false in DeepSeek's configs); rotary pairs interleaved."""
    method = getattr(config, "topk_method", "greedy") or "greedy"
    if method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"unsupported topk_method {method!r} (supported: greedy, "
                         "group_limited_greedy)")
    grouped = method == "group_limited_greedy"
    routing = GroupedRouting(
        scoring="softmax", score_bias=False, group_score="max" if grouped else None,
        n_group=config.n_group if grouped else 1,
        topk_group=config.topk_group if grouped else 1,
        scaling=float(config.routed_scaling_factor))
    return _deepseek_spec(config, arch, routing, rope_interleave=True)


def _deepseek_v3(config: Any, arch: str) -> DecoderSpec:
    """DeepSeek-V3 / R1, Kimi K2, Moonlight, GLM-4.7-Flash: V3's routing
    (`_v3_routing`), renormalised (norm_topk_prob) and scaled; rope_interleave as the
    config says. The multi-token-prediction layer some checkpoints carry (layer
    num_hidden_layers) is not loaded (deepseek.py)."""
    return _deepseek_spec(config, arch, _v3_routing(config),
                          rope_interleave=bool(getattr(config, "rope_interleave", True)))


def _glm4_moe(config: Any, arch: str) -> DecoderSpec:
    """GLM-4.5 / 4.5-Air / 4.6: grouped-query attention with q/k/v biases, per-head q/k
    norms where use_qk_norm, RoPE on the first partial_rotary_factor of each head (0.5;
    halves, as Llama's), and DeepSeek-V3's experts and routing (glm4_moe.py)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    params.setdefault("partial_rotary_factor",
                      getattr(config, "partial_rotary_factor", None) or 1.0)
    rope = RopeSpec.from_hf(params, getattr(config, "rope_theta", None),
                            getattr(config, "rope_scaling", None), partial_rotary=True)
    return read_decoder_spec(config, arch, o_bias=False, rope=rope,
                             qk_norm="head" if getattr(config, "use_qk_norm", False) else None,
                             moe=_deepseek_moe(config, _v3_routing(config)))


def _minimax_m2(config: Any, arch: str) -> DecoderSpec:
    """MiniMax-M2 / M2.1: grouped-query attention with q/k norms over all heads, RoPE on
    the first `rotary_dim` of each head (its checkpoints' field; transformers 5.0 does
    not read it, later releases turn it into partial_rotary_factor), and top-k of
    sigmoid-scored experts chosen with a bias (DeepSeek-V3's rule without groups,
    renormalised, unscaled) in every layer, no shared expert (minimax_m2.py)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    head_dim = getattr(config, "head_dim", None) or \
        config.hidden_size // config.num_attention_heads
    rotary_dim = getattr(config, "rotary_dim", None)
    if rotary_dim is not None:
        if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int) \
                or not 0 < rotary_dim <= head_dim or rotary_dim % 2:
            raise ValueError(f"rotary_dim must be an even number in (0, head_dim "
                             f"({head_dim})], got {rotary_dim!r}")
        params["partial_rotary_factor"] = rotary_dim / head_dim
    rope = RopeSpec.from_hf(params, getattr(config, "rope_theta", None),
                            getattr(config, "rope_scaling", None), partial_rotary=True)
    routing = GroupedRouting(scoring="sigmoid", score_bias=True, group_score=None,
                             n_group=1, topk_group=1, scaling=1.0)
    moe = MoeSpec(num_experts=config.num_local_experts, top_k=config.num_experts_per_tok,
                  intermediate_size=config.intermediate_size, renormalize=True,
                  sparse_layers=(True,) * config.num_hidden_layers,
                  weights_in_model_dtype=False, grouped=routing)
    return read_decoder_spec(config, arch, rope=rope, qk_norm="full", moe=moe)


def _glm(config: Any, arch: str) -> DecoderSpec:
    """GLM-4 and GLM-4-0414 / GLM-Z1: q/k/v biases where attention_bias (o_proj has
    none), RoPE on the first partial_rotary_factor of each head, pairs interleaved
    (glm4.py), the MLP's gate and up fused in the checkpoint; MLP biases refused."""
    if getattr(config, "mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported (the MLP has no biases)")
    params = dict(getattr(config, "rope_parameters", None) or {})
    params.setdefault("partial_rotary_factor",
                      getattr(config, "partial_rotary_factor", None) or 1.0)
    rope = RopeSpec.from_hf(params, getattr(config, "rope_theta", None),
                            getattr(config, "rope_scaling", None), partial_rotary=True)
    return read_decoder_spec(config, arch, qkv_bias=bool(getattr(config, "attention_bias",
                                                                  False)),
                             o_bias=False, rope=rope, fused_checkpoint=("gate_up_proj",))


def _ernie4_5(config: Any, arch: str) -> DecoderSpec:
    """ERNIE 4.5 (dense: ERNIE-4.5-0.3B): Llama's decoder with GLM's interleaved RoPE
    pairs over the whole head (glm4.py's attention; transformers rotates in fp32, here
    in the model's dtype: the same in fp32). use_bias (biases on every projection, the
    MLP's too) refused: the MLP has none."""
    if getattr(config, "use_bias", False):
        raise ValueError("use_bias=True is not supported (the MLP has no biases)")
    return read_decoder_spec(config, arch)


def _ernie4_5_moe(config: Any, arch: str) -> DecoderSpec:
    """ERNIE 4.5 MoE (ERNIE-4.5-21B-A3B, 300B-A47B): ERNIE 4.5's attention and, in the
    layers from moe_layer_start_index to moe_layer_end_index (every moe_layer_interval-
    th), top-k of the experts by softmax score plus a float32 choice bias (the statistics
    module's e_score_correction_bias), weighted by the unbiased scores renormalised and
    rounded to the model's dtype, plus moe_num_shared_experts ungated shared experts
    (glm4.py `Ernie45MoeForCausalLM`). moe_norm_min, the renormalisation's floor
    (1e-12), only matters for weights that sum below it; multi-token-prediction tensors
    are not loaded."""
    if getattr(config, "use_bias", False):
        raise ValueError("use_bias=True is not supported (the MLP has no biases)")
    layers = config.num_hidden_layers
    start, end = config.moe_layer_start_index, config.moe_layer_end_index
    interval = config.moe_layer_interval
    for field, value in (("moe_layer_start_index", start), ("moe_layer_end_index", end),
                         ("moe_layer_interval", interval)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{field} must be an integer, got {value!r}")
    if interval < 1:
        raise ValueError(f"moe_layer_interval must be at least 1, got {interval}")
    end = layers - 1 if end == -1 else end
    moe = MoeSpec(num_experts=config.moe_num_experts, top_k=config.moe_k,
                  intermediate_size=config.moe_intermediate_size, renormalize=True,
                  sparse_layers=tuple((i + 1) % interval == 0 and start <= i <= end
                                      for i in range(layers)),
                  shared_expert_size=config.moe_intermediate_size
                  * (config.moe_num_shared_experts or 0),
                  grouped=GroupedRouting(scoring="softmax", score_bias=True,
                                         group_score=None, n_group=1, topk_group=1,
                                         scaling=1.0))
    return read_decoder_spec(config, arch, moe=moe)


def _rope_on_sliding_layers(config: Any) -> tuple[bool, ...]:
    """Which layers rotate where only the sliding-window ones do (Command R7B / A; EXAONE
    4 where it has a window): those `layer_types` names "sliding_attention"."""
    return tuple(t == "sliding_attention" for t in getattr(config, "layer_types", None) or ())


def _cohere(config: Any, arch: str) -> DecoderSpec:
    """Command R / Aya Expanse and Command R7B / A (cohere.py): LayerNorm eps
    (layer_norm_eps), attention biases where attention_bias, logit_scale; Command R7B /
    A's full-attention layers (layer_types) without RoPE. Per-head q/k LayerNorms
    (use_qk_norm: Command R+) and MLP biases refused."""
    if getattr(config, "use_qk_norm", False):
        raise ValueError("use_qk_norm=True is not supported (Command R+'s per-head q/k "
                         "LayerNorms)")
    if getattr(config, "mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported (the MLP has no biases)")
    scale = getattr(config, "logit_scale", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) \
            or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"logit_scale must be a positive number, got {scale!r}")
    fields: dict[str, Any] = {"rms_norm_eps": config.layer_norm_eps,
                              "logit_scale": float(scale)}
    if arch == "Cohere2ForCausalLM":
        fields["rope_layers"] = _rope_on_sliding_layers(config)
    return read_decoder_spec(config, arch, **fields)


def _exaone4(config: Any, arch: str) -> DecoderSpec:
    """EXAONE 4.0 (exaone4.py): per-head q/k norms; where it has a sliding window, its
    global layers (layer_types "full_attention") take no RoPE; MLP biases refused."""
    if getattr(config, "mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported (the MLP has no biases)")
    fields: dict[str, Any] = {"qk_norm": "head"}
    if getattr(config, "sliding_window", None):  # (without one, every layer rotates)
        fields["rope_layers"] = _rope_on_sliding_layers(config)
    return read_decoder_spec(config, arch, **fields)


def _olmo2_spec(config: Any, arch: str) -> DecoderSpec:
    """OLMo 2 / OLMo 3: q and k norms over all heads; OLMo 3's rope_parameters per layer
    type (transformers nests them: "full_attention", "sliding_attention") with its
    sliding windows from layer_types."""
    params = getattr(config, "rope_parameters", None) or {}
    if "full_attention" not in params:  # OLMo 2: one RoPE
        return read_decoder_spec(config, arch, qk_norm="full")
    full, sliding = params.get("full_attention"), params.get("sliding_attention")
    if full is None or sliding is None:
        raise ValueError(f"{config.model_type} rope_parameters must have 'full_attention' "
                         f"and 'sliding_attention' entries, got {sorted(params)}")
    return read_decoder_spec(config, arch, qk_norm="full",
                             rope=RopeSpec.from_hf(full, None, None),
                             sliding_rope=RopeSpec.from_hf(sliding, None, None))


def _smollm3(config: Any, arch: str) -> DecoderSpec:
    """SmolLM3 (Hugging Face's 3B): Llama's decoder whose every fourth layer attends
    without RoPE (transformers' SmolLM3Attention skips the rotation there): Llama's
    fields, `no_rope_layers` (1: the layer rotates; the spec's rope_layers, which the
    shared attention reads: its RoPE tables of width 0 turn nothing), sliding
    windows only where `use_sliding_window`; MLP biases refused (its checkpoints have
    none, and the shared MLP takes none)."""
    if getattr(config, "mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported (the MLP has no biases)")
    flags = list(getattr(config, "no_rope_layers", None) or ())
    if len(flags) != config.num_hidden_layers or any(f not in (0, 1) for f in flags):
        raise ValueError(f"no_rope_layers must hold a 0 or 1 per layer "
                         f"({config.num_hidden_layers}), got {str(flags)[:80]}")
    fields: dict[str, Any] = {"rope_layers": tuple(bool(f) for f in flags)}
    if not getattr(config, "use_sliding_window", False):
        fields["layer_windows"] = ()
    return read_decoder_spec(config, arch, **fields)


def _granite_scalars(config: Any) -> dict[str, Any]:
    """Granite's four scalars as spec fields (granite.py), each checked positive."""
    values = {}
    for field in ("embedding_multiplier", "residual_multiplier", "attention_multiplier",
                  "logits_scaling"):
        value = getattr(config, field, 1.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{field} must be a positive number, got {value!r}")
        values[field] = float(value)
    return dict(attn_scale=values["attention_multiplier"],
                multipliers=Multipliers(values["embedding_multiplier"],
                                        values["residual_multiplier"],
                                        values["logits_scaling"]))


def _granite(config: Any, arch: str) -> DecoderSpec:
    """Granite 3.x: Llama's fields and four scalars (granite.py); MLP biases refused."""
    if getattr(config, "mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported (the MLP has no biases)")
    return read_decoder_spec(config, arch, **_granite_scalars(config))


# Layer kinds as configs spell them: transformers 5's names and the released configs'.
_MAMBA_LAYER, _ATTENTION_LAYER = ("linear_attention", "mamba"), ("full_attention", "attention")


def _granite_hybrid(config: Any, arch: str) -> DecoderSpec:
    """Granite 4.0 (granitemoehybrid.py): layer_types (or the released configs'
    layers_block_type) "mamba" / "linear_attention" (Mamba-2, mamba2.py) or
    "attention" / "full_attention"; Granite's scalars; RoPE where
    position_embedding_type is "rope", else none; the shared MLP of
    shared_intermediate_size beside num_local_experts experts of intermediate_size
    (none: the shared MLP alone)."""
    layers = config.num_hidden_layers
    types = list(getattr(config, "layer_types", None)
                 or getattr(config, "layers_block_type", None) or ())
    if len(types) != layers or set(types) - {*_MAMBA_LAYER, *_ATTENTION_LAYER}:
        raise ValueError(f"layer_types must list 'mamba' or 'attention' for each of the "
                         f"{layers} layers, got {str(types)[:120]}")
    limit = tuple(getattr(config, "time_step_limit", None) or (0.0, math.inf))
    if limit != (0.0, math.inf):
        raise ValueError(f"time_step_limit={list(limit)} is not supported (only the "
                         "default, no clamp on dt)")
    heads, head_dim, groups, state, kernel = _positive_ints(
        config, "mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state",
        "mamba_d_conv")
    if heads % groups:
        raise ValueError(f"mamba_n_heads ({heads}) must be a multiple of mamba_n_groups "
                         f"({groups})")
    if kernel > 64:
        raise ValueError(f"mamba_d_conv must be at most 64, got {kernel}")
    mamba = Mamba2Spec(heads, head_dim, groups, state, kernel, bool(config.mamba_conv_bias),
                       bool(config.mamba_proj_bias), tuple(t in _MAMBA_LAYER for t in types))
    shared = _positive_ints(config, "shared_intermediate_size")[0]
    experts = getattr(config, "num_local_experts", 0) or 0
    moe = None
    if experts:
        moe = MoeSpec(num_experts=experts, top_k=config.num_experts_per_tok,
                      intermediate_size=config.intermediate_size, renormalize=True,
                      sparse_layers=(True,) * layers, shared_expert_size=shared,
                      checkpoint_stacked=True)
    rope = getattr(config, "position_embedding_type", None) == "rope"
    return read_decoder_spec(config, arch, **_granite_scalars(config),
                             intermediate_size=shared, fused_checkpoint=("gate_up_proj",),
                             rope_layers=(rope,) * layers, moe=moe,
                             mamba=mamba if any(mamba.layers) else None)


def _seed_oss(config: Any, arch: str) -> DecoderSpec:
    """Seed-OSS: Llama's computation with q/k/v biases (attention_bias) and an o_proj
    bias of its own switch (attention_out_bias); MLP biases refused."""
    if getattr(config, "mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported (the MLP has no biases)")
    return read_decoder_spec(config, arch,
                             o_bias=bool(getattr(config, "attention_out_bias", False)))


def _phi3(config: Any, arch: str) -> DecoderSpec:
    """Phi-3 / Phi-4: Llama's computation from fused qkv/gate_up checkpoint tensors, with
    a partial rotary factor (Phi-4-mini) and LongRoPE (rope.py) read from
    rope_parameters."""
    rope = RopeSpec.from_hf(getattr(config, "rope_parameters", None),
                            getattr(config, "rope_theta", None),
                            getattr(config, "rope_scaling", None), partial_rotary=True)
    return read_decoder_spec(config, arch, rope=rope,
                             fused_checkpoint=("qkv_proj", "gate_up_proj"))


def _short_convs(config: Any) -> ShortConvSpec:
    """LFM2's layer_types: "conv" (a short convolution of conv_L_cache taps, lfm2.py) or
    "full_attention"."""
    layers = config.num_hidden_layers
    types = list(getattr(config, "layer_types", None) or ())
    if len(types) != layers or set(types) - {"conv", "full_attention"}:
        raise ValueError(f"layer_types must list 'conv' or 'full_attention' for each of the "
                         f"{layers} layers, got {str(types)[:120]}")
    kernel = config.conv_L_cache
    if isinstance(kernel, bool) or not isinstance(kernel, int) or not 1 <= kernel <= 64:
        raise ValueError(f"conv_L_cache must be an integer from 1 to 64, got {kernel!r}")
    return ShortConvSpec(kernel, bool(config.conv_bias), tuple(t == "conv" for t in types))


def _lfm2(config: Any, arch: str) -> DecoderSpec:
    """LFM2 (lfm2.py): short convolutions and attention layers with per-head q/k norms;
    the MLP's width derived from intermediate_size as transformers' Lfm2MLP derives it
    (block_auto_adjust_ff_dim: two thirds, times block_ffn_dim_multiplier, rounded up
    to block_multiple_of)."""
    size = config.intermediate_size
    if getattr(config, "block_auto_adjust_ff_dim", False):
        size = int(2 * size / 3)
        multiplier = getattr(config, "block_ffn_dim_multiplier", None)
        if multiplier is not None:
            of = config.block_multiple_of
            if isinstance(of, bool) or not isinstance(of, int) or of < 1:
                raise ValueError(f"block_multiple_of must be a positive integer, got {of!r}")
            size = of * -(-int(multiplier * size) // of)
    if size < 1:
        raise ValueError(f"the MLP's width (from intermediate_size="
                         f"{config.intermediate_size}) must be positive, got {size}")
    return read_decoder_spec(config, arch, qk_norm="head", rms_norm_eps=config.norm_eps,
                             intermediate_size=size, short_conv=_short_convs(config))


def _lfm2_moe(config: Any, arch: str) -> DecoderSpec:
    """LFM2-MoE (lfm2.py): LFM2's layers with experts after the first num_dense_layers
    (whose MLPs are intermediate_size wide as given), routed by sigmoid score plus a
    choice bias (use_expert_bias), renormalised with 1e-6 added to the sum where
    norm_topk_prob, times routed_scaling_factor."""
    layers, dense = config.num_hidden_layers, config.num_dense_layers
    if isinstance(dense, bool) or not isinstance(dense, int) or not 0 <= dense <= layers:
        raise ValueError(f"num_dense_layers must be an integer from 0 to num_hidden_layers "
                         f"({layers}), got {dense!r}")
    scaling = config.routed_scaling_factor
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) \
            or not math.isfinite(scaling) or scaling <= 0:
        raise ValueError(f"routed_scaling_factor must be a positive number, got {scaling!r}")
    routing = GroupedRouting(scoring="sigmoid", score_bias=bool(config.use_expert_bias),
                             group_score=None, n_group=1, topk_group=1,
                             scaling=float(scaling), renorm_eps=1e-6)
    moe = MoeSpec(num_experts=config.num_experts, top_k=config.num_experts_per_tok,
                  intermediate_size=config.moe_intermediate_size,
                  renormalize=bool(config.norm_topk_prob),
                  sparse_layers=tuple(i >= dense for i in range(layers)), grouped=routing)
    return read_decoder_spec(config, arch, qk_norm="head", rms_norm_eps=config.norm_eps,
                             short_conv=_short_convs(config), moe=moe)


def _positive_ints(config: Any, *fields: str) -> list[int]:
    """The config's `fields`, each checked to be a positive integer (ValueError naming
    the first that is not)."""
    values: list[int] = []
    for field in fields:
        value = getattr(config, field, None)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{field} must be a positive integer, got {value!r}")
        values.append(value)
    return values


def _qwen3_5(config: Any, arch: str) -> DecoderSpec:
    """Qwen3.5's text model and Qwen3.5-MoE's (qwen3_5.py): layer_types
    "linear_attention" (the gated delta rule after a causal convolution of
    linear_conv_kernel_dim taps; value heads a multiple of the key heads) or
    "full_attention" (per-head q/k norms, the output
    gated); RoPE on partial_rotary_factor of each head (the multimodal sections of
    rope_parameters coincide for text); MoE: Qwen2-MoE's block in every layer (top-k
    of the softmax, always renormalised, a shared expert gated by sigmoid)."""
    layers = config.num_hidden_layers
    types = list(getattr(config, "layer_types", None) or ())
    if len(types) != layers or set(types) - {"linear_attention", "full_attention"}:
        raise ValueError(f"layer_types must list 'linear_attention' or 'full_attention' for "
                         f"each of the {layers} layers, got {str(types)[:120]}")
    k_heads, v_heads, k_dim, v_dim, kernel = _positive_ints(
        config, "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
        "linear_value_head_dim", "linear_conv_kernel_dim")
    if v_heads % k_heads:
        raise ValueError(f"linear_num_value_heads ({v_heads}) must be a multiple of "
                         f"linear_num_key_heads ({k_heads})")
    if kernel > 64:
        raise ValueError(f"linear_conv_kernel_dim must be at most 64, got {kernel}")
    params = {key: value for key, value in (getattr(config, "rope_parameters", None)
                                            or {}).items()
              if key not in ("mrope_section", "mrope_interleaved")}
    rope = RopeSpec.from_hf(params, getattr(config, "rope_theta", None),
                            getattr(config, "rope_scaling", None), partial_rotary=True)
    linear = GatedDeltaNetSpec(k_heads, v_heads, k_dim, v_dim, kernel,
                               tuple(t == "linear_attention" for t in types))
    moe = None
    if getattr(config, "num_experts", None):  # Qwen3.5-MoE, Qwen3-Next: Qwen2-MoE's block
        # (Qwen3.5-MoE's always renormalised; Qwen3-Next's where norm_topk_prob)
        moe = _moe(config, config.num_experts,
                   renormalize=bool(getattr(config, "norm_topk_prob", True)))
    return read_decoder_spec(config, arch, qk_norm="head", rope=rope,
                             linear_attention=linear, attn_output_gate=True, moe=moe)


def _qwen3_5_released(config: Any, arch: str) -> DecoderSpec:
    """Qwen3.5's released checkpoints (`Qwen3_5ForConditionalGeneration`): the text model
    of text_config, served alone (images and video are not); the embedding tied where
    the top-level config says (qwen3_5.py)."""
    text = getattr(config, "text_config", None)
    if text is None:
        raise ValueError(f"{arch} config.json has no text_config")
    return replace(_qwen3_5(text, arch),
                   tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)))


FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family("llama", _llama, _decoder),
    "MistralForCausalLM": Family("mistral", _llama, _decoder),
    "Qwen2ForCausalLM": Family("qwen2", _qwen2, _decoder),
    "Qwen3ForCausalLM": Family("qwen3", _qwen3, _decoder),
    "Qwen2MoeForCausalLM": Family("qwen2_moe", _qwen2_moe, _decoder),
    "Qwen3MoeForCausalLM": Family("qwen3_moe", _qwen3_moe, _decoder),
    "MixtralForCausalLM": Family("mixtral", _mixtral, _decoder),
    "OlmoeForCausalLM": Family("olmoe", _olmoe, _decoder),
    "Gemma2ForCausalLM": Family("gemma2", _gemma2, _gemma),
    "Gemma3ForCausalLM": Family("gemma3_text", _gemma3, _gemma),
    "Phi3ForCausalLM": Family("phi3", _phi3, _decoder),
    "GptOssForCausalLM": Family("gpt_oss", _gpt_oss_spec, _lazy("gpt_oss", "GptOssForCausalLM")),
    "DeepseekV2ForCausalLM": Family("deepseek_v2", _deepseek_v2, _deepseek),
    "DeepseekV3ForCausalLM": Family("deepseek_v3", _deepseek_v3, _deepseek),
    "Glm4MoeLiteForCausalLM": Family("glm4_moe_lite", _deepseek_v3, _deepseek),
    "Glm4MoeForCausalLM": Family("glm4_moe", _glm4_moe, _lazy("glm4_moe", "Glm4MoeForCausalLM")),
    "MiniMaxM2ForCausalLM": Family("minimax_m2", _minimax_m2,
                                   _lazy("minimax_m2", "MiniMaxM2ForCausalLM")),
    "GlmForCausalLM": Family("glm", _glm, _lazy("glm4", "GlmForCausalLM")),
    "Glm4ForCausalLM": Family("glm4", _glm, _lazy("glm4", "Glm4ForCausalLM")),
    "Ernie4_5ForCausalLM": Family("ernie4_5", _ernie4_5, _lazy("glm4", "GlmForCausalLM")),
    "Ernie4_5_MoeForCausalLM": Family("ernie4_5_moe", _ernie4_5_moe,
                                      _lazy("glm4", "Ernie45MoeForCausalLM")),
    "CohereForCausalLM": Family("cohere", _cohere, _lazy("cohere", "CohereForCausalLM")),
    "Cohere2ForCausalLM": Family("cohere2", _cohere, _lazy("cohere", "CohereForCausalLM")),
    "Exaone4ForCausalLM": Family("exaone4", _exaone4,
                                 _lazy("exaone4", "Exaone4ForCausalLM")),
    "Olmo2ForCausalLM": Family("olmo2", _olmo2_spec, _olmo2),
    "Olmo3ForCausalLM": Family("olmo3", _olmo2_spec, _olmo2),
    "SmolLM3ForCausalLM": Family("smollm3", _smollm3, _decoder),
    "GraniteForCausalLM": Family("granite", _granite, _lazy("granite", "GraniteForCausalLM")),
    "GraniteMoeHybridForCausalLM": Family(
        "granitemoehybrid", _granite_hybrid,
        _lazy("granitemoehybrid", "GraniteMoeHybridForCausalLM")),
    "SeedOssForCausalLM": Family("seed_oss", _seed_oss, _decoder),
    "Lfm2ForCausalLM": Family("lfm2", _lfm2, _lazy("lfm2", "Lfm2ForCausalLM")),
    "Lfm2MoeForCausalLM": Family("lfm2_moe", _lfm2_moe, _lazy("lfm2", "Lfm2ForCausalLM")),
    "Qwen3_5ForCausalLM": Family("qwen3_5_text", _qwen3_5,
                                 _lazy("qwen3_5", "Qwen3_5ForCausalLM")),
    "Qwen3_5ForConditionalGeneration": Family(
        "qwen3_5", _qwen3_5_released, _lazy("qwen3_5", "Qwen3_5ForConditionalGeneration")),
    "Qwen3NextForCausalLM": Family("qwen3_next", _qwen3_5,
                                   _lazy("qwen3_5", "Qwen3NextForCausalLM")),
    "Qwen3_5MoeForCausalLM": Family("qwen3_5_moe_text", _qwen3_5,
                                    _lazy("qwen3_5", "Qwen3_5ForCausalLM")),
    "Qwen3_5MoeForConditionalGeneration": Family(
        "qwen3_5_moe", _qwen3_5_released, _lazy("qwen3_5", "Qwen3_5ForConditionalGeneration")),
}


def architecture_of(config: Any) -> str:
    """The architecture `config` names (its first `architectures` entry, else its
    model_type's); ValueError naming the supported ones when we do not serve it."""
    archs = list(getattr(config, "architectures", None) or [])
    model_type = getattr(config, "model_type", "")
    by_type = {family.model_type: arch for arch, family in FAMILIES.items()}
    arch = archs[0] if archs else by_type.get(model_type, model_type)
    if arch not in FAMILIES:
        raise ValueError(f"unsupported architecture {arch!r} "
                         f"(supported: {', '.join(FAMILIES)})")
    return arch


def read_spec(config: Any) -> DecoderSpec:
    """The spec of the model `config` describes (errors name the field refused)."""
    arch = architecture_of(config)
    return FAMILIES[arch].read(config, arch)


def model_class(spec: DecoderSpec) -> type[DecoderForCausalLM]:
    return FAMILIES[spec.architecture].model()
