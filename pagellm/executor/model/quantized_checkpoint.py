"""Quantized checkpoints: the formats vLLM users download, named by `quantization_config`
in config.json, read into the layouts the kernels compute with (kernels/quant.py's
PackedWeight, kernels/fp8.py's Fp8Weight). A projection P's tensors, by quant_method:

    gptq                P.qweight [K/pk, N] int32, codes along K (our own layout)
                        P.qzeros [K/G, N/pk] int32, codes along N (format v1 stores z - 1)
                        P.scales [K/G, N]; P.g_idx [K]: each input column's group
                        (act-order, desc_act=true: not k // G)
    awq (version gemm)  P.qweight [K, N/pk], P.qzeros [K/G, N/pk]: codes along N, in
                        AWQ's order (column 8c + AWQ_ORDER[i] at bits 4i); P.scales
    compressed-tensors  pack-quantized: P.weight_packed [N, K/pk] (codes along K: our
                        layout transposed), stored unsigned (signed + 2^(b-1));
                        P.weight_scale [N, K/G] or [N, 1]; P.weight_shape [2];
                        P.weight_zero_point [N/pk, K/G] packed along N (asymmetric);
                        P.weight_g_idx [K] (actorder "group")
                        int-quantized: P.weight [N, K] int8, signed, P.weight_scale
                        float-quantized: P.weight [N, K] e4m3, P.weight_scale [N, 1] | [1]
    fp8                 P.weight [N, K] e4m3 with P.weight_scale [] (per tensor), or
                        P.weight_scale_inv [N/bn, K/bk] (weight_block_size [bn, bk])
    gguf                pagellm's own, for llama.cpp's blocks (weights/gguf.py writes it):
                        P.qweight [K/pk, N] int32, codes along K (our layout); P.scales,
                        P.zeros [K/32, N] fp32, the zero points floats (a block's minimum);
                        `bits` the common width, `module_bits` the modules of the other

    w[n, k] = (code - zero) * scale for the integers (pk = 32 / bits codes per int32,
    bits 4 or 8; G the group size, or all of K for one scale per output channel), and
    w = e4m3 * scale for FP8.

Where the Triton kernels run (CUDA; the interpreter on the CPU, in tests), each quantized
projection stays packed: `prepare` gives it an empty PackedWeight or Fp8Weight of its
slice's shape before anything is allocated (a 4-bit model needs its 4-bit bytes, never
its 16-bit ones), and `collect` turns each projection's tensors, once all have arrived,
into one such object. That object loads through the weight map like a checkpoint weight
of shape [N, K] (it has `shape` and `narrow`): q/k/v and gate/up into their rows of the
fused projection, tensor-parallel slices narrowed on N, or on K in whole groups
(quantize.RequantizingDestination writes it: `place`). What stays unpacked loads
dequantized to the model's dtype: block-wise FP8 (no block-scaled GEMM here yet), a
quantized MoE expert or LM head, and on the CPU (no Triton) FP8 and act-order weights.
The CPU keeps integer weights (GPTQ, AWQ, compressed-tensors, GGUF's blocks) in its
int kernel's tiled layout (kernels/cpu_int_gemm.py: activations quantized per token and
block of 32, as llama.cpp); a W8A8 int8 checkpoint's groups are whole rows (its
per-channel scales). With the Triton kernels W8A8 runs weight-only (more accurate than
the checkpoint's scheme, as fast where decode reads weights), and static FP8 input
scales give way to per-token dynamic ones (kernels/fp8.py).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, fields, replace
from enum import Enum
from typing import Any

import torch
from torch import nn

from pagellm.executor.model import host_memory
from pagellm.executor.model.quantize import (
    PROJECTIONS,
    empty_cpu_int,
    empty_fp8,
    empty_packed,
)
from pagellm.kernels.cpu_int_gemm import CpuIntWeight
from pagellm.kernels.fp8 import FP8, Fp8Weight
from pagellm.kernels.quant import GROUP_SIZES, PackedWeight, dequantize, pack, unpack

# vLLM's names for the methods (its Marlin variants are kernels, not formats).
METHODS = {"gptq": "gptq", "gptq_marlin": "gptq", "awq": "awq", "awq_marlin": "awq",
           "compressed-tensors": "compressed-tensors", "fp8": "fp8", "gguf": "gguf"}
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # bits 4i of an AWQ int32 hold column AWQ_ORDER[i]
# A projection's tensors that load into nothing here: activation and KV-cache scales
# (activations are quantized per token, the KV cache keeps the model's dtype).
DROPPED = frozenset({"input_scale", "input_zero_point", "k_scale", "v_scale", "kv_scale",
                     "output_scale"})
Converted = PackedWeight | Fp8Weight | torch.Tensor


class Kind(Enum):
    INT = "int"  # weight-only integers: PackedWeight
    FP8 = "fp8"  # e4m3 with a scale per output channel (or tensor): Fp8Weight
    FP8_BLOCK = "fp8_block"  # e4m3 with a scale per [bn, bk] block: loaded dequantized


@dataclass(frozen=True)
class CheckpointQuant:
    """What `quantization_config` says, checked once (`read_quantization_config`)."""

    method: str  # gptq, awq, compressed-tensors, fp8, gguf
    kind: Kind
    bits: int = 8
    group_size: int | None = None  # None: one group per output channel (all of K)
    symmetric: bool = True  # compressed-tensors: no zero-point tensor
    act_order: bool = False  # g_idx orders the input columns (GPTQ desc_act)
    # compressed-tensors' W8A8 int8: symmetric int8 per output channel, and activations
    # quantized per token at run time (the CPU's int kernel: per block of 32, finer)
    w8a8: bool = False
    zeros_minus_one: bool = False  # GPTQ format v1 stores each zero point minus one
    block: tuple[int, int] | None = None  # FP8_BLOCK: [bn, bk]
    ignore: tuple[str, ...] = ()  # module names left in full precision
    tensors: frozenset[str] = frozenset()  # a quantized projection's tensor suffixes
    # gguf: modules whose codes are not `bits` wide, with their own width
    module_bits: tuple[tuple[str, int], ...] = ()

    def bits_of(self, modules: list[str]) -> int:
        """The code width of the projection computed from checkpoint `modules` (its
        parts, which must agree)."""
        own = dict(self.module_bits)
        widths = {own.get(m, self.bits) for m in modules}
        if len(widths) > 1:
            raise ValueError(f"quantization_config gives {modules} codes of {sorted(widths)} "
                             "bits; pagellm computes them as one projection")
        return widths.pop()

    def ignores(self, module: str) -> bool:
        """Whether the checkpoint keeps `module` (transformers' name) unquantized:
        compressed-tensors and gguf name modules exactly (or by "re:" patterns); AWQ and
        FP8 (transformers' modules_to_not_convert) by substring."""
        exact = self.method in ("compressed-tensors", "gguf")
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.match(entry[3:], module):
                    return True
            elif module == entry or (not exact and entry in module):
                return True
        return False

    def drops(self, suffix: str) -> bool:
        """Whether a projection's `<P>.<suffix>` loads into nothing: DROPPED, and a
        g_idx where it only restates k // G (no act-order)."""
        return suffix in DROPPED or (suffix in ("g_idx", "weight_g_idx")
                                     and suffix not in self.tensors)

    def is_piece(self, suffix: str, tensor: torch.Tensor) -> bool:
        """Whether checkpoint tensor `<P>.<suffix>` is one of a quantized projection's:
        for the formats that keep the name `weight`, only when it holds codes."""
        if suffix == "weight":
            return "weight" in self.tensors and tensor.dtype in (torch.int8, FP8)
        return suffix in self.tensors

    def holds_codes(self, module: str, names: Collection[str]) -> bool:
        """Whether a checkpoint of tensor `names` stores `module` quantized: it has a
        tensor only a quantized module has (qweight, weight_packed, weight_scale, ...),
        not just a plain weight."""
        return any(f"{module}.{t}" in names for t in self.tensors - {"weight"})

    def missing(self, pieces: dict[str, torch.Tensor]) -> set[str]:
        return set(self.tensors) - set(pieces)


def _refuse(field: str, value: Any, why: str) -> ValueError:
    return ValueError(f"quantization_config.{field}={value!r}: {why}")


def _group(value: Any, field: str) -> int | None:
    """A group size: None for one per output channel (-1 or absent); else a multiple of
    32, so that one of the kernel's group sizes divides it."""
    if value is None or value == -1:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0 or value % 32:
        raise _refuse(field, value, "group sizes must be -1 (per channel) or a positive "
                      "multiple of 32")
    return value


def _bits(value: Any, field: str, allowed: tuple[int, ...] = (4, 8)) -> int:
    if value not in allowed:
        raise _refuse(field, value, f"pagellm reads {' and '.join(map(str, allowed))}-bit "
                      "weights")
    return int(value)


def _gptq(config: dict[str, Any]) -> CheckpointQuant:
    fmt = config.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse("checkpoint_format", fmt, "pagellm reads 'gptq' and 'gptq_v2'")
    if config.get("dynamic"):
        raise _refuse("dynamic", config["dynamic"], "per-module overrides are not supported")
    act_order = bool(config.get("desc_act", False))
    tensors = {"qweight", "qzeros", "scales"} | ({"g_idx"} if act_order else set())
    return CheckpointQuant("gptq", Kind.INT, _bits(config.get("bits"), "bits"),
                           _group(config.get("group_size", -1), "group_size"),
                           act_order=act_order, zeros_minus_one=fmt == "gptq",
                           tensors=frozenset(tensors))


def _awq(config: dict[str, Any]) -> CheckpointQuant:
    version = str(config.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse("version", config.get("version"), "pagellm reads AWQ's 'gemm' layout")
    if not config.get("zero_point", True):
        raise _refuse("zero_point", config["zero_point"], "AWQ's gemm layout has zero points")
    return CheckpointQuant("awq", Kind.INT, _bits(config.get("bits", 4), "bits", (4,)),
                           _group(config.get("group_size", 128), "group_size"),
                           ignore=tuple(config.get("modules_to_not_convert") or ()),
                           tensors=frozenset({"qweight", "qzeros", "scales"}))


def _compressed_tensors(config: dict[str, Any]) -> CheckpointQuant:
    fmt = config.get("format")
    formats = ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized")
    if fmt not in formats:
        raise _refuse("format", fmt, f"pagellm reads {', '.join(formats)}")
    if config.get("sparsity_config"):
        raise _refuse("sparsity_config", "...", "sparse checkpoints are not supported")
    groups = list((config.get("config_groups") or {}).values())
    schemes = {repr(g.get("weights")) for g in groups}
    if len(schemes) != 1:
        raise _refuse("config_groups", f"{len(schemes)} weight schemes",
                      "pagellm reads checkpoints with one weight scheme")
    weights = groups[0].get("weights") or {}
    kind, strategy = weights.get("type"), weights.get("strategy")
    ignore = tuple(config.get("ignore") or ())
    symmetric = bool(weights.get("symmetric", True))
    if weights.get("dynamic"):
        raise _refuse("config_groups.weights.dynamic", True, "weights must be quantized ahead")
    if kind == "float":
        _bits(weights.get("num_bits"), "config_groups.weights.num_bits", (8,))
        if strategy == "block":
            block = weights.get("block_structure") or [128, 128]
            return CheckpointQuant("compressed-tensors", Kind.FP8_BLOCK, block=tuple(block),
                                   ignore=ignore, tensors=frozenset({"weight", "weight_scale"}))
        if strategy not in ("channel", "tensor") or not symmetric:
            raise _refuse("config_groups.weights.strategy", strategy, "FP8 weights take a "
                          "symmetric per-channel, per-tensor or block scale here")
        return CheckpointQuant("compressed-tensors", Kind.FP8, ignore=ignore,
                               tensors=frozenset({"weight", "weight_scale"}))
    if kind != "int":
        raise _refuse("config_groups.weights.type", kind, "pagellm reads int and float")
    if strategy not in ("group", "channel", "tensor"):
        raise _refuse("config_groups.weights.strategy", strategy,
                      "integer weights take group, channel or tensor scales here")
    actorder = weights.get("actorder")
    if actorder not in (None, "group", "weight", "static"):
        raise _refuse("config_groups.weights.actorder", actorder, "unknown act order")
    packed = fmt == "pack-quantized"
    bits = _bits(weights.get("num_bits"), "config_groups.weights.num_bits",
                 (4, 8) if packed else (8,))
    tensors = {"weight_packed", "weight_shape"} if packed else {"weight"}
    tensors |= {"weight_scale"} | (set() if symmetric else {"weight_zero_point"})
    tensors |= {"weight_g_idx"} if actorder == "group" else set()
    group = _group(weights.get("group_size"), "config_groups.weights.group_size") \
        if strategy == "group" else None
    acts = groups[0].get("input_activations") or {}
    w8a8 = (bits == 8 and group is None and symmetric and actorder != "group"
            and acts.get("type") == "int" and acts.get("num_bits") == 8
            and acts.get("dynamic") is True and acts.get("strategy") == "token"
            and acts.get("symmetric", True))
    return CheckpointQuant("compressed-tensors", Kind.INT, bits, group, symmetric=symmetric,
                           act_order=actorder == "group", w8a8=w8a8, ignore=ignore,
                           tensors=frozenset(tensors))


def _fp8(config: dict[str, Any]) -> CheckpointQuant:
    ignore = tuple(config.get("modules_to_not_convert") or config.get("ignored_layers") or ())
    block = config.get("weight_block_size")
    if block is not None:
        if (not isinstance(block, list) or len(block) != 2
                or not all(isinstance(b, int) and b > 0 for b in block)):
            raise _refuse("weight_block_size", block, "two positive block sizes [bn, bk]")
        return CheckpointQuant("fp8", Kind.FP8_BLOCK, block=(block[0], block[1]),
                               ignore=ignore, tensors=frozenset({"weight",
                                                                 "weight_scale_inv"}))
    return CheckpointQuant("fp8", Kind.FP8, ignore=ignore,
                           tensors=frozenset({"weight", "weight_scale"}))


def _gguf(config: dict[str, Any]) -> CheckpointQuant:
    if config.get("group_size") != 32:
        raise _refuse("group_size", config.get("group_size"), "llama.cpp's blocks are 32")
    ignore = config.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(m, str) for m in ignore):
        raise _refuse("ignore", ignore, "a list of module names")
    widths = config.get("module_bits") or {}
    if not isinstance(widths, dict) or not all(isinstance(m, str) for m in widths):
        raise _refuse("module_bits", widths, "module names and their code widths")
    module_bits = tuple((m, _bits(b, f"module_bits[{m!r}]")) for m, b in widths.items())
    return CheckpointQuant("gguf", Kind.INT, _bits(config.get("bits"), "bits"), 32,
                           symmetric=False, ignore=tuple(ignore), module_bits=module_bits,
                           tensors=frozenset({"qweight", "scales", "zeros"}))


_READERS: dict[str, Callable[[dict[str, Any]], CheckpointQuant]] = {
    "gptq": _gptq, "awq": _awq, "compressed-tensors": _compressed_tensors, "fp8": _fp8,
    "gguf": _gguf}


def read_quantization_config(config: Any) -> CheckpointQuant | None:
    """config.json's `quantization_config` (a dict, or transformers' config object) as a
    CheckpointQuant; None when the checkpoint is not quantized. Raises ValueError naming
    the field and value pagellm cannot read."""
    if config is None:
        return None
    if not isinstance(config, dict):
        config = config.to_dict()
    method = config.get("quant_method")
    if method not in _READERS:
        raise _refuse("quant_method", method, f"pagellm reads {', '.join(_READERS)}")
    return _READERS[method](config)


# -- conversion: one projection's tensors -> PackedWeight / Fp8Weight -----------------


def _sorted_by_group(codes: torch.Tensor, g_idx: torch.Tensor, group: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Act-order: codes [K, N] with input column k in group g_idx[k] -> (codes with
    their rows sorted by group, perm [K]: row j is column perm[j])."""
    perm = torch.argsort(g_idx.to(torch.int64), stable=True)
    expected = torch.arange(len(perm)) // group
    if not torch.equal(g_idx.to(torch.int64)[perm].cpu(), expected):
        raise ValueError(f"g_idx does not place {group} input columns in each group")
    return codes[perm], perm


def _packed(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
            g_idx: torch.Tensor | None) -> PackedWeight:
    """codes [K, N] unsigned, scales and zeros [K/G, N] (G from their shape) -> a
    PackedWeight; with g_idx (act-order), its rows sorted by group."""
    k, n = codes.shape
    if scales.shape != zeros.shape or scales.shape[1] != n or k % scales.shape[0]:
        raise ValueError(f"scales {tuple(scales.shape)} and zero points "
                         f"{tuple(zeros.shape)} do not fit a weight of {n} x {k}")
    group = k // scales.shape[0]
    perm = None
    if g_idx is not None:
        codes, perm = _sorted_by_group(codes, g_idx, group)
        if torch.equal(perm, torch.arange(k)):
            perm = None  # in order after all: no gather
    return PackedWeight(pack(codes, bits), scales.contiguous(),
                        zeros.to(scales.dtype).contiguous(), bits, group, perm)


def _unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """[R / pk, C] int32 with codes along dim 0 -> [R, C] int64 codes."""
    return unpack(packed.contiguous(), bits)


def _from_gptq(p: dict[str, torch.Tensor], q: CheckpointQuant) -> PackedWeight:
    codes = _unpack_rows(p["qweight"], q.bits)  # [K, N]
    zeros = _unpack_rows(p["qzeros"].t(), q.bits).t()  # [N, K/G] -> [K/G, N]
    if q.zeros_minus_one:
        zeros = zeros + 1
    return _packed(codes, p["scales"], zeros, q.bits, p.get("g_idx") if q.act_order else None)


def _awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """[R, C/8] int32, codes along dim 1 in AWQ's order -> [R, C] int64."""
    shifts = torch.arange(0, 32, 4, device=packed.device)
    nibbles = (packed.to(torch.int64).unsqueeze(-1) >> shifts) & 0xF  # [R, C/8, 8]
    inverse = [AWQ_ORDER.index(c) for c in range(8)]  # column c sits at nibble inverse[c]
    return nibbles[..., inverse].reshape(packed.shape[0], -1)


def _from_awq(p: dict[str, torch.Tensor], q: CheckpointQuant) -> PackedWeight:
    return _packed(_awq_unpack(p["qweight"]), p["scales"], _awq_unpack(p["qzeros"]), 4, None)


def _from_compressed_tensors(p: dict[str, torch.Tensor], q: CheckpointQuant) -> Converted:
    if q.kind is not Kind.INT:
        return _from_fp8(p, q)
    offset = 2 ** (q.bits - 1)
    if "weight_packed" in p:
        codes = _unpack_rows(p["weight_packed"].t(), q.bits)  # [K, N], stored unsigned
        n, k = (int(d) for d in p["weight_shape"].tolist())
        if codes.shape != (k, n):
            raise ValueError(f"weight_packed holds {tuple(codes.shape[::-1])}, weight_shape "
                             f"says {(n, k)}")
    else:
        codes = p["weight"].t().to(torch.int64) + offset  # signed int8 -> unsigned
    scale = p["weight_scale"]
    scales = (scale.reshape(1, 1) if scale.numel() == 1 else scale).t()  # [K/G | 1, N]
    if "weight_zero_point" in p:
        zp = p["weight_zero_point"]
        zeros = (_unpack_rows(zp, q.bits).t() if zp.dtype == torch.int32  # packed along N
                 else zp.t().to(torch.int64) + offset)
    else:
        zeros = torch.full(scales.shape, offset, dtype=torch.int64)
    if scales.shape[0] == 1 and scales.shape[1] == 1:  # one scale per tensor
        scales, zeros = scales.expand(1, codes.shape[1]), zeros.expand(1, codes.shape[1])
    return _packed(codes, scales, zeros, q.bits, p.get("weight_g_idx"))


def _from_fp8(p: dict[str, torch.Tensor], q: CheckpointQuant) -> Converted:
    weight = p["weight"]
    if weight.dtype != FP8:
        raise ValueError(f"weight is {weight.dtype}, not float8_e4m3fn")
    n, k = weight.shape
    if q.kind is Kind.FP8_BLOCK:  # dequantized: no block-scaled GEMM here
        assert q.block is not None
        (bn, bk), scale = q.block, p.get("weight_scale_inv", p.get("weight_scale"))
        assert scale is not None
        if scale.shape != (math.ceil(n / bn), math.ceil(k / bk)):
            raise ValueError(f"block scales {tuple(scale.shape)} do not fit a weight of "
                             f"{n} x {k} in blocks of {bn} x {bk}")
        full = scale.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
        return weight.float() * full
    scale = p["weight_scale"].float().reshape(1, -1)
    if scale.shape[1] not in (1, n):
        raise ValueError(f"weight_scale has {scale.shape[1]} values for {n} output channels")
    return Fp8Weight(weight, scale.expand(1, n).contiguous())


def _from_gguf(p: dict[str, torch.Tensor], q: CheckpointQuant) -> PackedWeight:
    """Codes of 4 or 8 bits (a module's own width: the rows of qweight per group say
    which), fp32 scales and float zero points."""
    for name in ("scales", "zeros"):
        if p[name].dtype != torch.float32:
            raise ValueError(f"{name} is {p[name].dtype}, not float32")
    words, groups = p["qweight"].shape[0], p["scales"].shape[0]
    bits = words // groups if groups else 0  # a group's 32 codes take `bits` int32 rows
    if bits not in (4, 8) or words != groups * bits:
        raise ValueError(f"qweight's {words} rows do not hold 4- or 8-bit codes of "
                         f"{groups} groups of 32")
    return _packed(_unpack_rows(p["qweight"], bits), p["scales"], p["zeros"], bits, None)


_CONVERTERS: dict[str, Callable[[dict[str, torch.Tensor], CheckpointQuant], Converted]] = {
    "gptq": _from_gptq, "awq": _from_awq, "compressed-tensors": _from_compressed_tensors,
    "fp8": _from_fp8, "gguf": _from_gguf}


def dequantized(weight: Converted) -> torch.Tensor:
    """A converted projection as a plain [N, K] fp32 weight."""
    if isinstance(weight, PackedWeight):
        return dequantize(weight)
    if isinstance(weight, Fp8Weight):
        return weight.weight.float() * weight.scale.t()
    return weight


def collect(weights: Iterable[tuple[str, torch.Tensor]], quant: CheckpointQuant,
            packed: Callable[[str], bool], known: Callable[[str], bool]
            ) -> Iterator[tuple[str, Converted]]:
    """The checkpoint's tensors with each quantized projection's (module docstring)
    gathered into one `<P>.weight`: packed where `packed(name)` says its module keeps
    it so, else dequantized. Other tensors pass through; a full-precision weight of a
    module kept packed is refused (config.json says the checkpoint quantizes it). GPTQ
    checkpoints may carry biases the model has not (`known`: AutoGPTQ saves zeros for
    them): skipped, as vLLM does."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        prefix, _, suffix = name.rpartition(".")
        if quant.drops(suffix) or (quant.method == "gptq" and suffix == "bias"
                                   and not known(name)):
            continue
        if not quant.is_piece(suffix, tensor):
            if suffix == "weight" and packed(name):
                raise ValueError(f"{name} is {tensor.dtype}, but quantization_config "
                                 f"quantizes it ({quant.method}) and does not ignore it")
            yield name, tensor
            continue
        pieces = pending.setdefault(prefix, {})
        pieces[suffix] = tensor
        if quant.missing(pieces):
            continue
        del pending[prefix]
        try:
            weight = _CONVERTERS[quant.method](pieces, quant)
        except (ValueError, RuntimeError) as e:
            raise ValueError(f"{prefix}: {e}") from None
        name = f"{prefix}.weight"
        yield name, weight if packed(name) else dequantized(weight)
    for prefix, pieces in pending.items():
        raise ValueError(f"{prefix}: the checkpoint has {sorted(pieces)} of this "
                         f"{quant.method} projection but not {sorted(quant.missing(pieces))}")


# -- the model's side: packed projections before loading ------------------------------


def _target_group(quant: CheckpointQuant, in_features: int, full_in: int) -> int:
    """The kernel's group size for a projection slice of `in_features` input columns
    (of `full_in`): the largest of GROUP_SIZES dividing both the checkpoint's groups
    (all of K when per channel) and the slice; their scales repeat to fill it."""
    group = quant.group_size or full_in
    common = math.gcd(group, in_features)
    for size in sorted(GROUP_SIZES, reverse=True):
        if common % size == 0:
            return size
    raise ValueError(f"a projection slice of {in_features} input columns (groups of "
                     f"{group}) cannot be split into groups of {min(GROUP_SIZES)} or more")


def prepare(model: nn.Module, quant: CheckpointQuant, part_names: Callable[[str], list[str]],
            dtype: torch.dtype, triton: bool = True, names: Collection[str] | None = None
            ) -> dict[int, nn.Module]:
    """On the meta model: give each projection the checkpoint quantizes (PROJECTIONS of
    quantize.py whose checkpoint parts `part_names(name)` are not ignored) an empty
    packed form of its slice's shape, on meta, and a fresh meta placeholder weight;
    returns the modules holding packed forms, by their placeholder's id (the model's
    `quantized`). Nothing for block-wise FP8 (loaded dequantized). Without the Triton
    kernels (`triton` False), integer weights take the CPU int kernel's layout
    (kernels/cpu_int_gemm.py; a W8A8 checkpoint in groups of whole rows: its scales),
    MoE experts included (`_prepare_experts`; with the checkpoint's tensor `names`, only
    experts it stores quantized), except act-order ones, which load dequantized as FP8
    does."""
    if quant.kind is Kind.FP8_BLOCK or (not triton and (quant.kind is not Kind.INT
                                                         or quant.act_order)):
        return {}
    modules: dict[int, nn.Module] = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] not in PROJECTIONS:
            continue
        parts = part_names(name)
        if _ignored(quant, parts):
            continue
        bits = quant.bits_of(parts)
        n, k = module.weight.shape
        shards = module.tp.size if hasattr(module, "tp") else 1  # row-parallel: K sliced
        with torch.device("meta"):
            if not triton:
                group = k if quant.w8a8 and k % 32 == 0 else _target_group(quant, k, k * shards)
                module.quant = empty_cpu_int(n, k, bits, group)
            elif quant.kind is Kind.FP8:
                module.quant = empty_fp8(n, k)
            else:
                module.quant = empty_packed(n, k, bits, _target_group(quant, k, k * shards),
                                             dtype, act_order=quant.act_order and shards == 1)
            module.weight = nn.Parameter(torch.empty(n, k, dtype=module.weight.dtype),
                                         requires_grad=False)
        modules[id(module.weight)] = module
    # Integer experts (no FP8 expert kernel; the fused MoE kernel reads the input columns
    # in order: no act-order)
    if quant.kind is Kind.INT and not quant.act_order:
        modules.update(_prepare_experts(model, quant, dtype, triton, names))
    return modules


def _ignored(quant: CheckpointQuant, parts: list[str]) -> bool:
    """Whether the checkpoint keeps the modules `parts` (computed as one) unquantized;
    ValueError if it keeps some of them only."""
    ignored = {quant.ignores(p) for p in parts}
    if len(ignored) > 1:
        raise ValueError(f"quantization_config ignores some of {parts} but not all; "
                         "pagellm computes them as one projection")
    return ignored.pop()


def _prepare_experts(model: nn.Module, quant: CheckpointQuant, dtype: torch.dtype,
                     triton: bool, names: Collection[str] | None) -> dict[int, nn.Module]:
    """Packed experts (moe.ExpertCodes: the CPU int kernel's layout, or with `triton` a
    PackedWeight for the fused MoE kernel, scales in `dtype`) for every MoE layer whose
    experts the checkpoint quantizes (all of a layer's experts or none: they are one
    packed weight per projection, of one width), empty on meta, their stacked
    parameters meta placeholders; by placeholder id. Each expert's checkpoint tensors
    then load into their rows (quantize.place). Experts that the checkpoint's tensor
    `names` hold as plain weights stay stacked weights, though no `ignore` names them:
    quantizers that pick modules by name (AutoGPTQ's `w1`/`w2`/`w3` of Mixtral's
    experts are not its `*_proj`) leave them so, and they load as they did before
    experts were packed."""
    from pagellm.executor.model.moe import stacked_experts
    from pagellm.executor.model.weight_map import moe_names

    # The family's spelling of its experts' names, or transformers' own (a GGUF file's
    # Mixtral experts: weights/gguf.py writes transformers' names for every family)
    spellings = (moe_names(model.spec),  # type: ignore[arg-type]
                 ("mlp", ("gate_proj", "up_proj", "down_proj")))
    modules: dict[int, nn.Module] = {}
    for layer, experts, attr, shards in stacked_experts(model, cpu=not triton):
        count, rows, k = getattr(experts, attr).shape
        for module_name, (gate, up, down) in spellings:
            parts = [f"{layer}.{module_name}.experts.{e}.{p}" for e in range(count)
                     for p in ((gate, up) if attr == "gate_up_proj" else (down,))]
            if names is None or quant.holds_codes(parts[0], names):
                break
        else:
            continue  # stored as plain weights
        if _ignored(quant, parts):
            continue
        bits, group = quant.bits_of(parts), _target_group(quant, k, k * shards)
        with torch.device("meta"):
            empty = empty_packed(count * rows, k, bits, group, dtype) if triton else \
                empty_cpu_int(count * rows, k, bits, group)
        modules.update([experts.pack(attr, empty)])
    return modules


def materialize(module: nn.Module, device: torch.device) -> None:
    """Allocate `module.quant`'s tensors on `device` (prepare made them on meta). An
    act-order permutation starts as -1: not yet loaded (quantize.place)."""
    quant: PackedWeight | Fp8Weight | CpuIntWeight = module.quant  # type: ignore[assignment]
    tensors = {f.name: host_memory.empty_like(getattr(quant, f.name), device)
               for f in fields(quant) if isinstance(getattr(quant, f.name), torch.Tensor)}
    if tensors.get("perm") is not None:
        tensors["perm"].fill_(-1)
    if isinstance(quant, CpuIntWeight):  # the last tile's rows past N are never loaded:
        for t in tensors.values():  # zeros, not whatever the pages held
            t.zero_()
    module.quant = replace(quant, **tensors)  # type: ignore[arg-type,assignment]
