"""Decode steps on the CPU in one C++ call: the CPU's counterpart of CUDA graphs.

A decode step's projections are most of its work, but not of its time: at batch 1 on a
2-core CPU, SmolLM2-135M's int4 projections take 4.7 ms per token, and the ~20 torch
ops per layer between them (norms, rotary, the KV write, paged attention, the
activation; each a few microseconds of dispatch for a row of 576 numbers) took another
9 ms. `CpuDecodeStep` runs a decode-only step's layers in one call of
`torch.ops.pagellm_cpu.decode_layers` (kernels/csrc/cpu_decode.cpp): the decoder's own
arithmetic (decoder.py), in fp32, in the same order, without dispatch in between. The
embedding lookup before it and the LM head and sampling after it stay as they are.

It serves the steps where every request has one query token (decode, and one-token
prompt chunks), for models it computes exactly as the torch path does: the decoder
family (Llama, Mistral, Qwen2/2.5/3, Phi-3) in fp32 with an fp32 KV cache (dense fp32
or the CPU int kernel's int4 / int8 projections), or in bf16 with a bf16 KV cache
(dense bf16 projections: the C++ rounds to bf16 wherever the torch path holds a bf16
tensor), mixture-of-experts layers included (Qwen3-MoE, Mixtral, Qwen2-MoE's shared
experts: dense or int experts), and gpt-oss in fp32 (its sinks, router and expert
biases and clamped SwiGLU; dense or int experts), without tensor parallelism, LoRA,
OLMoE's q/k clipping and norms or soft-capping (Gemma's own classes). A dense projection is a GEMV
for up to `DENSE_ROWS` tokens and the torch path's GEMM above (oneDNN's for fp32,
at::linear for bf16, oneDNN's on the loader's packed copies where it made them), where
the fused step saved 15-18% of a 48-request run against the torch path (fp32 and bf16,
SmolLM2-135M, 2-core AMD EPYC). Everything else takes the torch path, unchanged.

The model's tensors are gathered once into the op's lists (0.3-0.5 ms of attribute reads
for 30 layers: 5-10% of an int4 step) and kept until `forget`, which the worker calls
wherever it drops the CPU's packed weight copies (after weight updates, sleep and
collective_rpc: an extension may have replaced a parameter). Sleep and wake swap the
parameters' storage in place, which the kept tensors see. `PAGELLM_CPU_DECODE=0` turns
the fused step off (a debugging switch, and the benchmarks' side-by-side).
"""

from __future__ import annotations

import logging
import os
from typing import Any, cast

import torch
from torch import nn

from pagellm.executor.model import linear as cpu_linear
from pagellm.executor.model.attention import AttentionMetadata
from pagellm.executor.model.decoder import (
    DecoderAttention,
    DecoderForCausalLM,
    DecoderLayer,
    DecoderMLP,
    DecoderModel,
)
from pagellm.executor.model.gpt_oss import (
    GptOssDecoderLayer,
    GptOssForCausalLM,
    GptOssModel,
    GptOssMoeBlock,
    GptOssRMSNorm,
)
from pagellm.executor.model.layers import Linear, RMSNorm, RowParallelLinear
from pagellm.executor.model.moe import ExpertCodes, SparseMoeBlock
from pagellm.kernels import cpu_ops
from pagellm.kernels.cpu_int_gemm import CpuIntWeight

logger = logging.getLogger("pagellm")

DENSE_ROWS = 4  # tokens up to which dense projections run as the C++ GEMV (cpu_decode.cpp)
_NONE = torch.empty(0)  # an absent bias or q/k norm
# weights, linear_meta, norms, biases, routers, moe_meta, sinks, expert_biases, swiglu:
# decode_layers' per-layer lists
Projection = Linear | RowParallelLinear
Moe = SparseMoeBlock | GptOssMoeBlock
Mlp = DecoderMLP | Moe
_Operands = tuple[list[torch.Tensor], list[int], list[torch.Tensor], list[torch.Tensor],
                  list[torch.Tensor], list[int], list[torch.Tensor], list[torch.Tensor],
                  list[float]]
# moe_meta's flags (cpu_decode.cpp's kRenormalize, kWeightsInModelDtype, kTopkSoftmax)
RENORMALIZE, WEIGHTS_IN_MODEL_DTYPE, TOPK_SOFTMAX = 1, 2, 4
DTYPES = (torch.float32, torch.bfloat16)  # a model's; its KV cache's is it or bf16


def unsupported(model: nn.Module, dtype: torch.dtype, cache_dtype: torch.dtype,
                attention: str, lora: bool) -> str | None:
    """Why `model` cannot take the fused step (None: it can)."""
    if os.environ.get("PAGELLM_CPU_DECODE") == "0":
        return "PAGELLM_CPU_DECODE=0"
    if attention != "torch" or dtype not in DTYPES or cache_dtype not in (dtype,
                                                                          torch.bfloat16):
        return ("only fp32 or bf16 models, a KV cache of the model's dtype or bf16, torch "
                "attention")
    gpt_oss = type(model) is GptOssForCausalLM and type(model.model) is GptOssModel
    if not gpt_oss and (type(model) is not DecoderForCausalLM
                        or type(model.model) is not DecoderModel
                        or type(model.model.norm) is not RMSNorm):
        return f"{type(model).__name__} computes more than the decoder family"
    if gpt_oss and dtype != torch.float32:  # its norms and experts round as the shared
        return "gpt-oss in fp32 only"  # decoder's do not (GptOssRMSNorm)
    assert isinstance(model, DecoderForCausalLM)
    spec = model.spec
    if model.tp.size != 1 or lora:
        return "tensor parallelism and LoRA take the torch path"
    if (spec.clip_qkv is not None or spec.qk_norm not in (None, "head")
            or spec.attn_softcap is not None or spec.hidden_act != "silu"):
        return "q/k clipping or norms over all heads, soft-capping or GeGLU"
    if not all(spec.rotates(i) for i in range(spec.num_layers)):
        return "layers without RoPE (the fused step rotates every layer)"
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        norm = GptOssRMSNorm if gpt_oss else RMSNorm  # (the same in fp32)
        if (type(layer) is not (GptOssDecoderLayer if gpt_oss else DecoderLayer)
                or type(attn) is not DecoderAttention
                or type(mlp) not in (DecoderMLP, SparseMoeBlock, GptOssMoeBlock)
                or type(layer.input_layernorm) is not norm
                or type(layer.post_attention_layernorm) is not norm):
            return "a layer of another kind"
        if any(g.quant is not None for g in _gates(cast(Mlp, mlp))):
            return "a quantized router or shared expert gate"
        weights: list[tuple[object, torch.Tensor]] = [
            (proj.quant, proj.weight) for proj in (attn.qkv_proj, attn.o_proj)]
        for quant, weight in weights + _mlp_weights(cast(Mlp, mlp)):
            if not ((quant is None and weight.dtype == dtype)
                    or (isinstance(quant, CpuIntWeight) and dtype == torch.float32)):
                return f"a {type(quant).__name__} projection in {dtype}"
    return None


class CpuDecodeStep:
    """`model`'s layers for decode-only steps in one C++ call (module docstring)."""

    def __init__(self, model: DecoderForCausalLM, ops: Any) -> None:
        self.model = model
        self.ops = ops
        layers = [cast(DecoderLayer, layer) for layer in model.model.layers]
        # Per layer: its norms' module, attention block and MLP, dense or sparse
        # (`unsupported` checked their types).
        self.layers = [(layer, cast(DecoderAttention, layer.self_attn), cast(Mlp, layer.mlp))
                       for layer in layers]
        # Per layer, its projections qkv, o, gate_up, down (None: a MoE layer's experts)
        # and a shared expert's gate_up and down (None: none)
        self.projections: list[tuple[Projection | None, ...]] = [
            (a.qkv_proj, a.o_proj, *_mlp_projections(mlp)) for _, a, mlp in self.layers]
        # Dense projections of more tokens than the GEMV takes run as the torch path runs
        # them (linear.py): fp32 through oneDNN's GEMM, bf16 through at::linear or, where
        # the loader packed the weights (CPUs with AMX or AVX512-BF16), oneDNN's GEMM on
        # the packed copies, looked up at every such step (`PACKED_WEIGHTS.get` packs
        # again a weight written in place since).
        dtype = model.model.norm.weight.dtype  # the model's
        packs = cpu_linear.packs_weights(dtype, torch.device("cpu"))
        self.packable = [  # (index in decode_layers' weights, projection)
            (3 * i, proj) for i, proj in enumerate(p for ps in self.projections for p in ps)
            if packs and proj is not None and proj.quant is None]
        self.windows = [a.attn.sliding_window or 0 for _, a, _ in self.layers]
        self.scales = [a.attn.scale for _, a, _ in self.layers]
        first = self.layers[0][1]
        self.heads = (first.num_heads, first.num_kv_heads, first.head_dim)
        self._operands: _Operands | None = None  # gathered by the first call after forget

    @classmethod
    def for_model(cls, model: nn.Module, dtype: torch.dtype, cache_dtype: torch.dtype,
                  attention: str, lora: bool) -> CpuDecodeStep | None:
        """The fused step for `model`, or None where it takes the torch path (why, in the
        debug log; a CPU without a C++ compiler, in a warning)."""
        why = unsupported(model, dtype, cache_dtype, attention, lora)
        if why is not None:
            logger.debug("decode steps take the torch path: %s", why)
            return None
        try:
            ops = cpu_ops.load()
        except RuntimeError as e:
            logger.warning("decode steps take the torch path (slower): %s", e)
            return None
        assert isinstance(model, DecoderForCausalLM)
        return cls(model, ops)

    def takes(self, max_query_len: int) -> bool:
        """Whether a step whose queries are at most `max_query_len` tokens long is one
        this runs: every decode-only step, whatever its batch."""
        return max_query_len == 1

    def forget(self) -> None:
        """The model's tensors may have been replaced: gather them again next step."""
        self._operands = None

    def operands(self) -> _Operands:
        """The layers' tensors as decode_layers takes them (cpu_decode.cpp's comment)."""
        weights: list[torch.Tensor] = []
        meta: list[int] = []
        norms: list[torch.Tensor] = []
        biases: list[torch.Tensor] = []
        routers: list[torch.Tensor] = []
        moe_meta: list[int] = []
        sinks: list[torch.Tensor] = []
        expert_biases: list[torch.Tensor] = []
        swiglu: list[float] = []
        for (layer, attn, mlp), projections in zip(self.layers, self.projections, strict=True):
            for slot, proj in enumerate(projections):
                if isinstance(mlp, Moe) and slot in (2, 3):  # the experts
                    experts = mlp.experts
                    codes, stacked = ((experts.gate_up_codes, experts.gate_up_proj)
                                      if slot == 2 else (experts.down_codes, experts.down_proj))
                    weights += _experts(codes, stacked)
                    meta += ((0, 0, stacked.shape[1]) if codes is None else
                             (codes.quant.bits, codes.quant.group_size, codes.rows))
                elif proj is None:  # no shared expert
                    weights += (_NONE, _NONE, _NONE)
                    meta += (0, 0, 0)
                elif isinstance(quant := proj.quant, CpuIntWeight):
                    weights += (quant.codes, quant.scales, quant.zeros)
                    meta += (quant.bits, quant.group_size, quant.out_features)
                else:
                    weights += (proj.weight, _NONE, _NONE)
                    meta += (0, 0, proj.weight.shape[0])
            if isinstance(mlp, SparseMoeBlock):
                moe = mlp.moe
                routers += (mlp.gate.weight, _NONE if mlp.shared_expert_gate is None
                            else mlp.shared_expert_gate.weight)
                moe_meta += (moe.num_experts, moe.top_k,
                             RENORMALIZE * moe.renormalize
                             + WEIGHTS_IN_MODEL_DTYPE * moe.weights_in_model_dtype)
            elif isinstance(mlp, GptOssMoeBlock):
                routers += (mlp.router.weight, _NONE)
                moe_meta += (mlp.moe.num_experts, mlp.moe.top_k, TOPK_SOFTMAX)
            else:
                routers += (_NONE, _NONE)
                moe_meta += (0, 0, 0)
            if isinstance(mlp, GptOssMoeBlock):
                experts = mlp.experts
                expert_biases += (_bias(mlp.router), experts.gate_up_proj_bias,
                                  experts.down_proj_bias)
                swiglu += (experts.alpha, experts.limit)
            else:
                expert_biases += (_NONE, _NONE, _NONE)
                swiglu += (0.0, 0.0)
            sinks.append(_NONE if attn.sinks is None else attn.sinks.float())
            norms += (layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                      _NONE if attn.q_norm is None else attn.q_norm.weight,
                      _NONE if attn.k_norm is None else attn.k_norm.weight)
            biases += (_bias(attn.qkv_proj), _bias(attn.o_proj))
        return weights, meta, norms, biases, routers, moe_meta, sinks, expert_biases, swiglu

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """input_ids, positions [T] (one token per request) -> the final norm's output
        [T, hidden], as DecoderModel.forward returns it."""
        decoder = self.model.model
        x = decoder.embed_tokens(input_ids)  # [T, hidden]
        rope = decoder.rotary_emb
        if self._operands is None:
            self._operands = self.operands()
        (weights, linear_meta, norms, biases, routers, moe_meta, sinks, expert_biases,
         swiglu) = self._operands
        if len(input_ids) > DENSE_ROWS and self.packable:  # packed copies in scales' slot
            weights = list(weights)
            for i, proj in self.packable:
                packed = cpu_linear.PACKED_WEIGHTS.get(proj.weight)
                weights[i + 1] = _NONE if packed is None else packed
        num_heads, num_kv_heads, head_dim = self.heads
        hidden: torch.Tensor = self.ops.decode_layers(
            x, positions, rope.cos_cache, rope.sin_cache, meta.slot_mapping,
            meta.block_tables, meta.seq_lens, weights, linear_meta, norms, biases, routers,
            moe_meta, kv_caches[:len(self.windows)],  # (a draft model's layers follow the model's)
            self.windows, self.scales, num_heads, num_kv_heads, head_dim,
            self.model.spec.rms_norm_eps, decoder.norm.weight, sinks, expert_biases, swiglu)
        return hidden


def _bias(proj: Projection) -> torch.Tensor:
    return _NONE if proj.bias is None else proj.bias


def _mlp_projections(mlp: Mlp) -> tuple[Projection | None, ...]:
    """gate_up, down (None: a MoE layer's experts) and a shared expert's gate_up, down
    (None: none)."""
    if isinstance(mlp, DecoderMLP):
        return mlp.gate_up_proj, mlp.down_proj, None, None
    if isinstance(mlp, GptOssMoeBlock):
        return None, None, None, None
    shared = mlp.shared_expert
    return (None, None) + ((None, None) if shared is None
                           else (shared.gate_up_proj, shared.down_proj))


def _gates(mlp: Mlp) -> list[Linear]:
    """A MoE layer's router and shared expert's gate (where it has one)."""
    if isinstance(mlp, GptOssMoeBlock):
        return [mlp.router]
    if isinstance(mlp, SparseMoeBlock):
        return [g for g in (mlp.gate, mlp.shared_expert_gate) if g is not None]
    return []


def _mlp_weights(mlp: Mlp) -> list[tuple[object, torch.Tensor]]:
    """(packed form or None, weight) of each of the MLP's weights: its projections and,
    in a MoE layer, its router, shared expert's gate and stacked experts (their
    ExpertCodes' `quant`)."""
    weights: list[tuple[object, torch.Tensor]] = [
        (p.quant, p.weight) for p in _mlp_projections(mlp) if p is not None]
    if isinstance(mlp, Moe):
        experts = mlp.experts
        weights += [(g.quant, g.weight) for g in _gates(mlp)]
        weights += [(None if codes is None else codes.quant, stacked)
                    for codes, stacked in ((experts.gate_up_codes, experts.gate_up_proj),
                                           (experts.down_codes, experts.down_proj))]
    return weights


def _experts(codes: ExpertCodes | None, stacked: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A stacked expert weight as decode_layers takes it: its codes, scales and zeros
    (all E * N rows) where packed, else the dense [E, N, K] weight."""
    if codes is None:
        return stacked, _NONE, _NONE
    quant = codes.quant
    assert isinstance(quant, CpuIntWeight)
    return quant.codes, quant.scales, quant.zeros
