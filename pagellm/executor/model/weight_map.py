"""Where each checkpoint tensor loads on this rank: a `Destination` per tensor name.

A checkpoint stores q/k/v and gate/up as separate tensors, each whole; the decoder holds
them merged (one GEMM each) and, under tensor parallelism, only its rank's slice
(executor/model/parallel.py: Megatron's layout). `destination` maps one
checkpoint name to the parameter view it fills and the part of the checkpoint tensor
that goes there:

    q_proj / k_proj / v_proj    -> rows of qkv_proj: this rank's heads (KV heads may
                                   be replicated across ranks)
    gate_proj / up_proj         -> rows of gate_up_proj: this rank's MLP columns (a
                                   shared expert's of its own width: Qwen2-MoE, DeepSeek)
    o_proj / down_proj          -> columns (row parallel: the input dimension)
    embed_tokens / lm_head      -> this rank's vocabulary rows (the tail rank's padding
                                   rows load nothing)
    qkv_proj / gate_up_proj     -> (Phi-3's fused checkpoint tensors) the same rows
      (fused_checkpoint)           of ours: whole on one rank; under tensor parallelism
                                   in parts (`Destination.parts`): gate_up in two, this
                                   rank's gate rows and its up rows, qkv in three, its
                                   q, k and v heads' rows, as if the tensor came split
    experts.{e}.gate/up/down    -> expert e's slice of the stacked experts (moe.py),
                                   as `experts.gate_up_proj` [E, 2I, H] and
                                   `experts.down_proj` [E, H, I] (transformers 5's
                                   in-memory names, which RL trainers send) load whole
    self_attn.sinks             -> this rank's heads' entries (gpt-oss)
    everything else             -> the whole parameter (norms, the row-parallel
                                   layers' biases, the MoE router, a shared expert's
                                   gate)

A mixture-of-experts checkpoint names its experts one way per family (`moe_names`):
Qwen3-MoE, Qwen2-MoE and OLMoE `mlp.experts.{e}.gate_proj`, Mixtral and MiniMax-M2
`block_sparse_moe.experts.{e}.w1` (w1 gate, w3 up, w2 down). Either spelling and the
stacked names load; what counts as loaded (`canonical_keys`, for the loader's
completeness check and the weights a sleep dropped) is always the family's own
per-expert names.

Phi-3 checkpoints (`DecoderSpec.fused_checkpoint`) store q/k/v and gate/up fused, under
our own parameter names, GLM-4's gate/up only; theirs are the only names such a model
loads for those modules (and the ones its loader checks a checkpoint for).

Loading (the loader, `load_weights`, the weight-update paths of worker/weight_receiver.py)
goes through these, so every path checks shapes alike, and a fused tensor loads by its
one name at any tensor-parallel size. Apart from the model's modules:
any family with Llama's tensor names reuses it whole.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from pagellm.executor.model.parallel import TensorParallel
from pagellm.executor.model.spec import DecoderSpec

# Checkpoint tensor -> (our parameter, shard) for the merged projections.
_STACKED = (("q_proj", "qkv_proj", "q"), ("k_proj", "qkv_proj", "k"),
            ("v_proj", "qkv_proj", "v"), ("gate_proj", "gate_up_proj", 0),
            ("up_proj", "gate_up_proj", 1))


@dataclass(frozen=True)
class Destination:
    """Where checkpoint tensor `name` loads: `tensor`, a view of a parameter, takes the
    checkpoint tensor's `length` entries from `start` along `dim` (the whole tensor when
    `dim` is None). `shape` is the checkpoint tensor's full shape. `tensor` is None
    for tensors loaded into nothing (computed, or tied). `as_shape`: the checkpoint
    tensor is viewed as this shape first, and `dim` counts in it (the stacked experts'
    gate and up halves: [E, 2I, H] as [E, 2, I, H], narrowed on I). `layout`: what turns
    the checkpoint tensor into the model's layout before that, where they differ
    (gpt-oss's experts: transposed, gate and up interleaved; gpt_oss.py). `parts`: when one
    narrow cannot say it (a fused qkv checkpoint tensor under tensor parallelism: the
    rank's q, k and v rows lie apart in it, and GQA sizes them unequally), the
    destinations, each over the same checkpoint tensor, whose union this is; `tensor`
    is then the whole parameter."""

    tensor: torch.Tensor | None
    shape: tuple[int, ...] = ()
    dim: int | None = None
    start: int = 0
    length: int = 0
    as_shape: tuple[int, ...] | None = None
    parts: tuple[Destination, ...] = ()
    layout: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, compare=False)

    def load(self, checkpoint: torch.Tensor, non_blocking: bool = False) -> None:
        """Copy this rank's part of the full `checkpoint` tensor in (shape checked)."""
        if self.tensor is None:
            return
        if tuple(checkpoint.shape) != self.shape:
            raise ValueError(f"shape {tuple(checkpoint.shape)}, the model's is {self.shape}")
        if self.parts:
            for piece in self.parts:
                piece.load(checkpoint, non_blocking)
            return
        if self.layout is not None:
            checkpoint = self.layout(checkpoint)
        if self.as_shape is not None:
            checkpoint = checkpoint.view(self.as_shape)
        part = checkpoint if self.dim is None else checkpoint.narrow(self.dim, self.start,
                                                                     self.length)
        self.write(part, non_blocking)

    def write(self, part: torch.Tensor, non_blocking: bool = False) -> None:
        """Store this rank's `part` of the checkpoint tensor (shaped as `tensor`)."""
        assert self.tensor is not None
        with torch.no_grad():
            self.tensor.copy_(part, non_blocking=non_blocking)

    def receiver(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """The parameter view itself, when a whole checkpoint tensor of `dtype` on
        `device` can be written straight into it (this rank keeps all of it, same dtype
        and device, contiguous): a broadcast lands there with no copy. Else None."""
        t = self.tensor
        full = self.as_shape or self.shape
        whole = not self.parts and (self.dim is None or (self.start == 0 and
                                                         self.length == full[self.dim]))
        if t is None or not whole or self.layout is not None or t.dtype != dtype \
                or t.device != device or not t.is_contiguous():
            return None
        return t


# A checkpoint tensor that loads into nothing (computed or tied), distinct from None.
SKIP = Destination(None)


# The experts' checkpoint names: (layer, module, expert, projection) and the stacked ones.
_EXPERT = re.compile(r"(.+)\.(mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
_STACKED_EXPERTS = re.compile(r"(.+)\.mlp\.experts\.(gate_up_proj|down_proj)")
_ROUTER = re.compile(r"(.+)\.block_sparse_moe\.gate\.weight")
# Per-expert projection name -> 0 (gate), 1 (up) or "down", in either spelling.
_EXPERT_PART: dict[str, int | str] = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1,
                                      "down_proj": "down", "w2": "down"}


# The families whose checkpoints spell the block Mixtral's way.
_BLOCK_SPARSE_MOE = ("MixtralForCausalLM", "MiniMaxM2ForCausalLM")
# The experts' choice bias, which our router holds (`mlp.gate.e_score_correction_bias`
# [E]), in any family's spelling: DeepSeek-V3's is ours; MiniMax-M2's checkpoint has it
# on the block (`block_sparse_moe.`, transformers `mlp.`); ERNIE 4.5's in its statistics
# module (`mlp.moe_statics.`, transformers `mlp.gate.moe_statics.`; [1, E]: glm4.py).
_SCORE_BIAS = re.compile(r"(.+)\.(?:block_sparse_moe|mlp)(?:\.gate)?(?:\.moe_statics)?"
                         r"\.e_score_correction_bias")
# The family's own name of it (suffix after the layer's prefix), where not ours.
_SCORE_BIAS_NAMES = {"MiniMaxM2ForCausalLM": "block_sparse_moe.e_score_correction_bias",
                     "Ernie4_5_MoeForCausalLM": "mlp.moe_statics.e_score_correction_bias"}


def moe_names(spec: DecoderSpec) -> tuple[str, tuple[str, str, str]]:
    """The family's checkpoint spelling of its MoE block: (module, (gate, up, down))."""
    if spec.architecture in _BLOCK_SPARSE_MOE:
        return "block_sparse_moe", ("w1", "w3", "w2")
    return "mlp", ("gate_proj", "up_proj", "down_proj")


def canonical_keys(name: str, spec: DecoderSpec) -> list[str]:
    """The checkpoint keys (the family's own names) that checkpoint tensor `name`
    fills: itself, except for the experts' other spellings and the stacked tensors."""
    if spec.moe is None or spec.moe.checkpoint_stacked:
        return [name]
    module, (gate, up, down) = moe_names(spec)
    if m := _EXPERT.fullmatch(name):
        part = _EXPERT_PART.get(m[4])
        if part is None:
            return [name]
        proj = down if part == "down" else (gate, up)[int(part)]
        return [f"{m[1]}.{module}.experts.{m[3]}.{proj}.weight"]
    if m := _STACKED_EXPERTS.fullmatch(name):
        projs = (gate, up) if m[2] == "gate_up_proj" else (down,)
        return [f"{m[1]}.{module}.experts.{e}.{proj}.weight"
                for e in range(spec.moe.num_experts) for proj in projs]
    if m := _ROUTER.fullmatch(name) or re.fullmatch(r"(.+)\.mlp\.gate\.weight", name):
        return [f"{m[1]}.{module}.gate.weight"]
    if m := _SCORE_BIAS.fullmatch(name):
        own = _SCORE_BIAS_NAMES.get(spec.architecture, "mlp.gate.e_score_correction_bias")
        return [f"{m[1]}.{own}"]
    return [name]


def checkpoint_keys(param_names: Iterable[str], spec: DecoderSpec) -> set[str]:
    """The checkpoint names parameters named `param_names` load from (merged ones split
    back unless the checkpoint stores them fused, stacked experts as the family's
    per-expert names)."""
    keys: set[str] = set()
    for name in param_names:
        parts = [name.replace(merged, ckpt) for ckpt, merged, _ in _STACKED
                 if f".{merged}." in name and ".experts." not in name
                 and merged not in spec.fused_checkpoint]
        for part in parts or [name]:
            keys.update(canonical_keys(part, spec))
    return keys


def checkpoint_parts(module: str, spec: DecoderSpec) -> list[str]:
    """The checkpoint's names of the modules our `module` merges (q/k/v for qkv_proj,
    gate/up for gate_up_proj, unless the family stores them fused): itself otherwise."""
    prefix, _, last = module.rpartition(".")
    parts = [f"{prefix}.{ckpt}" for ckpt, merged, _ in _STACKED
             if merged == last and merged not in spec.fused_checkpoint]
    return parts or [module]


def _full_norm_destination(target: str, param: nn.Parameter, spec: DecoderSpec,
                           tp: TensorParallel) -> Destination:
    """OLMoE's q/k norms span all heads: this rank's heads' part of the weight."""
    d = spec.head_dim
    if target.endswith("q_norm.weight"):
        return Destination(param, (spec.num_heads * d,), 0, tp.rank * param.shape[0],
                           param.shape[0])
    return Destination(param, (spec.num_kv_heads * d,), 0, tp.kv_head_start * d,
                       param.shape[0])


def _expert_destination(name: str, params: Mapping[str, nn.Parameter], spec: DecoderSpec,
                        tp: TensorParallel) -> Destination | None:
    """Where an expert's or the router's checkpoint tensor loads; None for other names
    (and for a MoE name the model does not have, e.g. an expert index out of range)."""
    assert spec.moe is not None
    size, full, experts = tp.moe_intermediate_size, spec.moe.intermediate_size, \
        spec.moe.num_experts
    if (m := _ROUTER.fullmatch(name)) is not None:
        param = params.get(f"{m[1]}.mlp.gate.weight")
        return None if param is None else Destination(param, tuple(param.shape))
    if (m := _STACKED_EXPERTS.fullmatch(name)) is not None:
        param = params.get(f"{m[1]}.mlp.experts.{m[2]}")
        if param is None:
            return None
        hidden = spec.hidden_size
        if m[2] == "gate_up_proj":  # [E, 2I, H] viewed [E, 2, I, H]: this rank's I-slice
            return Destination(param.view(experts, 2, size, hidden), (experts, 2 * full, hidden),
                               2, tp.rank * size, size, as_shape=(experts, 2, full, hidden))
        return Destination(param, (experts, hidden, full), 2, tp.rank * size, size)
    m = _EXPERT.fullmatch(name)
    if m is None or m[4] not in _EXPERT_PART or int(m[3]) >= experts:
        return None
    part, expert = _EXPERT_PART[m[4]], int(m[3])
    if part == "down":
        param = params.get(f"{m[1]}.mlp.experts.down_proj")
        return None if param is None else Destination(
            param[expert], (spec.hidden_size, full), 1, tp.rank * size, size)
    param = params.get(f"{m[1]}.mlp.experts.gate_up_proj")
    if param is None:
        return None
    half = int(part)
    return Destination(param[expert, half * size:(half + 1) * size],
                       (full, spec.hidden_size), 0, tp.rank * size, size)


def _fused_destination(name: str, param: nn.Parameter, spec: DecoderSpec,
                       tp: TensorParallel) -> Destination:
    """Phi-3's fused checkpoint tensors: qkv_proj [(H + 2 H_kv) D, hidden] (q's rows,
    then k's, then v's) and gate_up_proj [2I, hidden] (gate's rows, then up's), laid out
    as ours; this rank keeps its heads' and its MLP columns' rows of each part."""
    hidden = param.shape[1]
    if name.endswith("gate_up_proj.weight"):
        full, size = spec.intermediate_size, tp.intermediate_size
        shape = (2 * full, hidden)
        if tp.size == 1:
            return Destination(param, shape)
        # Rows, not a [2, I, H] view narrowed on I: a quantized checkpoint's packed
        # tensor (a GGUF's codes) has rows to narrow but no view.
        return Destination(param, shape, parts=(
            Destination(param[:size], shape, 0, tp.rank * size, size),
            Destination(param[size:], shape, 0, full + tp.rank * size, size)))
    d = spec.head_dim
    full_shape = ((spec.num_heads + 2 * spec.num_kv_heads) * d, hidden)
    if tp.size == 1:
        return Destination(param, full_shape)
    q_size, kv_size = tp.num_heads * d, tp.num_kv_heads * d
    q_full, kv_full = spec.num_heads * d, spec.num_kv_heads * d
    kv_start = tp.kv_head_start * d
    parts = (Destination(param[:q_size], full_shape, 0, tp.rank * q_size, q_size),
             Destination(param[q_size:q_size + kv_size], full_shape, 0,
                         q_full + kv_start, kv_size),
             Destination(param[q_size + kv_size:], full_shape, 0,
                         q_full + kv_full + kv_start, kv_size))
    return Destination(param, full_shape, parts=parts)


def _mlp_sizes(name: str, spec: DecoderSpec, tp: TensorParallel) -> tuple[int, int]:
    """(the whole intermediate size, this rank's columns) of the gated MLP that tensor
    `name` belongs to: a MoE layer's shared expert (Qwen2-MoE's `shared_expert`,
    DeepSeek's `shared_experts`, all of them one MLP), else the dense MLP."""
    if spec.moe is not None and (".shared_expert." in name or ".shared_experts." in name):
        full = spec.moe.shared_expert_size
        return full, full // tp.size
    return spec.intermediate_size, tp.intermediate_size


def destination(name: str, params: Mapping[str, nn.Parameter], spec: DecoderSpec,
                tp: TensorParallel, tied: bool) -> Destination | None:
    """Where checkpoint tensor `name` loads on rank `tp` of a model with parameters
    `params` (the slice of a merged or sharded parameter); SKIP for tensors we compute or
    share (`tied`: the LM head is the embedding); None for a name the model does not
    have."""
    if "rotary_emb.inv_freq" in name:
        return SKIP  # older checkpoints store the RoPE table; we compute it
    if name == "lm_head.weight" and tied:
        return SKIP  # some tied checkpoints still carry a copy
    if spec.moe is not None and (m := _SCORE_BIAS.fullmatch(name)):
        param = params.get(f"{m[1]}.mlp.gate.e_score_correction_bias")
        return None if param is None else Destination(param, tuple(param.shape))
    if spec.moe is not None and (".experts." in name or ".block_sparse_moe." in name):
        return _expert_destination(name, params, spec, tp)
    target, shard = name, None
    for ckpt, merged, shard_id in _STACKED:
        if f".{ckpt}." in name:
            if merged in spec.fused_checkpoint:  # its names are ours, not the split ones
                return None
            target, shard = name.replace(ckpt, merged), shard_id
            break
    param = params.get(target)
    if param is None:
        return None
    if any(target.endswith(f".{fused}.weight") for fused in spec.fused_checkpoint):
        return _fused_destination(target, param, spec, tp)
    d = spec.head_dim
    if shard is None:
        if target.endswith(("embed_tokens.weight", "lm_head.weight")):
            rows = max(0, min(tp.vocab_size, spec.vocab_size - tp.vocab_start))
            return Destination(param[:rows], (spec.vocab_size, param.shape[1]), 0,
                               tp.vocab_start, rows)
        if spec.qk_norm == "full" and target.endswith(("q_norm.weight", "k_norm.weight")):
            return _full_norm_destination(target, param, spec, tp)
        if target.endswith("self_attn.sinks"):  # one per head: this rank's heads'
            return Destination(param, (spec.num_heads,), 0, tp.rank * tp.num_heads,
                               tp.num_heads)
        if target.endswith(("o_proj.weight", "down_proj.weight")):  # row parallel
            full = spec.num_heads * d if "o_proj" in target else _mlp_sizes(target, spec, tp)[0]
            width = param.shape[1]
            return Destination(param, (param.shape[0], full), 1, tp.rank * width, width)
        return Destination(param, tuple(param.shape))  # replicated
    if isinstance(shard, int):  # gate (0) / up (1): column parallel
        full, size = _mlp_sizes(target, spec, tp)
        return Destination(param[shard * size:(shard + 1) * size],
                           (full, *param.shape[1:]), 0, tp.rank * size, size)
    q_d = 2 * d if spec.attn_output_gate else d  # q_proj's rows a head (query, gate)
    q_size, kv_size = tp.num_heads * q_d, tp.num_kv_heads * d
    offset, size, full, start = {
        "q": (0, q_size, spec.num_heads * q_d, tp.rank * q_size),
        "k": (q_size, kv_size, spec.num_kv_heads * d, tp.kv_head_start * d),
        "v": (q_size + kv_size, kv_size, spec.num_kv_heads * d, tp.kv_head_start * d),
    }[shard]
    return Destination(param[offset:offset + size], (full, *param.shape[1:]), 0, start,
                       size)
