"""llama.cpp's GGUF files as models: `LLM("model.gguf")`, `pagellm serve model.gguf`.

A GGUF file holds the config, the tokenizer and the weights, each in llama.cpp's own
terms. It is converted once into a Hugging Face directory in the cache
(~/.cache/pagellm/gguf/<name>-<key>, the key from FORMAT and the file's path, size and
mtime) that every part of the engine then reads as it reads any other: transformers
parses the config and the tokenizer (`gguf_file=`) and dequantizes every tensor, q and
k rows unpermuted (transformers' GGUF loader, so every family it reads is read alike).

The projections stored as blocks of 32 weights with a step and an offset, w = step *
q + offset, stay integer codes: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the K-quants Q4_K and
Q5_K (whose super-blocks of 256 give each block of 32 its own step and minimum). Each
block is written as w = scale * (code - zero) with scale = step and a float zero point
-offset / step, groups of 32: the "gguf" quantization method of
executor/model/quantized_checkpoint.py (codes in kernels/quant.py's layout, scales and
zeros [K / 32, N] fp32; no standard format has float zero points, which Q4_1's and the
K-quants' minimums need), checked against transformers' dequantized weight (exactly for
the symmetric Q8_0, Q4_0 and Q5_0; to fp32 rounding where a zero point stands for a
minimum), with q and k rows unpermuted as transformers does. The other quantized types
(Q6_K, as in the *_K_M mixes' v and down projections, whose sub-blocks of 16 have their
own scales; Q2_K, Q3_K, the IQ types) are re-quantized from that weight to 8-bit codes
per 32 (within half a step of 1/255 of each group's range: finer than their own grids).
Codes are 4 bits for the 4-bit types and 8 for the rest (the kernels' two widths); the
parts of a fused projection (q/k/v, gate/up) take the widest of theirs (4-bit codes fit
8 bits exactly), and a projection is dequantized (fp32) with its fused neighbours when
one of them is stored unquantized (F32, F16, BF16). The CPU's int kernel and the Triton
kernels then compute with the file's own weights.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pagellm.protocol.engine_args import EngineArgs

logger = logging.getLogger("pagellm")

# llama.cpp's tensor name in block i -> transformers' module in layer i
_PROJECTIONS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
# Modules computed as one (their storage must agree): the q/k/v and gate/up of a layer.
_FUSED = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          ("mlp.gate_proj", "mlp.up_proj"))
_PERMUTED = ("llama", "mistral")  # families whose q and k rows llama.cpp permutes
# The oldest transformers whose GGUF reader this was tested with: 5.0-5.17 fail on a
# file with an EOS and no BOS token id (as llama.cpp writes Qwen's), and 5.0 adds a BOS
# the file says not to add.
TRANSFORMERS_FLOOR = (5, 18)
# The converted directory's layout, part of its cache key: 2 keeps quantized projections
# as the "gguf" quantization method (1 kept Q8_0 / Q4_0 as compressed-tensors).
FORMAT = 2


def cache_dir() -> Path:
    return Path(os.environ.get("PAGELLM_CACHE", Path.home() / ".cache" / "pagellm")) / "gguf"


def resolve_gguf(args: EngineArgs) -> EngineArgs:
    """`model` (and a draft model's, in speculative_config) naming a .gguf file becomes
    its converted directory (built once); any other model passes through."""
    if args.model.endswith(".gguf"):
        args = args.replace(model=_converted(args.model))
    draft = (args.speculative_config or {}).get("model")
    if isinstance(draft, str) and draft.endswith(".gguf"):
        args = args.replace(speculative_config={**(args.speculative_config or {}),
                                                "model": _converted(draft)})
    return args


def _converted(model: str) -> str:
    path = Path(model)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {model}")
    return str(gguf_model_dir(path))


def gguf_model_dir(path: Path, dequantized: bool = False) -> Path:
    """The Hugging Face directory `path` converts to, built into the cache if it is not
    there yet (into a temporary directory, renamed when complete: a reader never sees a
    half-built one). `dequantized`: every tensor as transformers dequantizes it, none
    kept as codes (the benchmarks' full-precision baseline of a quantized file)."""
    stat = path.stat()
    key = hashlib.sha256(f"{FORMAT}:{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
                         .encode())
    final = cache_dir() / (f"{path.stem}-{key.hexdigest()[:16]}"
                           + ("-dequantized" if dequantized else ""))
    if (final / "config.json").is_file():
        return final
    tmp = final.with_name(f"{final.name}.tmp{os.getpid()}")
    try:
        convert(path, tmp, dequantized)
        try:
            os.replace(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def transformers_version() -> tuple[int, int]:
    import transformers

    major, minor = [*transformers.__version__.split("."), "0"][:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def convert(path: Path, out: Path, dequantized: bool = False) -> None:
    """Write `path` as a Hugging Face directory at `out` (module docstring; `dequantized`:
    gguf_model_dir's)."""
    import torch
    import transformers
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to a Hugging Face directory at %s", path, out)
    try:
        import gguf  # noqa: F401  (transformers reads GGUF through it)
    except ImportError as e:
        raise ImportError("loading a GGUF file needs the gguf package: "
                          "pip install 'pagellm[gguf]'") from e
    if transformers_version() < TRANSFORMERS_FLOOR:
        raise ImportError(f"loading a GGUF file needs transformers >= "
                          f"{'.'.join(map(str, TRANSFORMERS_FLOOR))} (its GGUF reader), got "
                          f"{transformers.__version__}: pip install -U transformers")
    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                     dtype=torch.float32)
    except (ValueError, KeyError, OSError, RuntimeError) as e:
        raise ValueError(f"cannot read the GGUF file {path}: {e}") from e
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    kept = {} if dequantized else _whole_fused_groups(_kept_projections(path, config, state))
    quantization = None
    if kept:
        widths = _fused_widths({m: c.bits for m, c in kept.items()})
        common = Counter(widths.values()).most_common(1)[0][0]
        for module, codes in kept.items():
            del state[f"{module}.weight"]
            state.update({f"{module}.{k}": v for k, v in codes.tensors(widths[module]).items()})
        ignore = sorted(k.removesuffix(".weight") for k in state
                        if k.endswith("_proj.weight"))
        quantization = {"quant_method": "gguf", "bits": common, "group_size": 32,
                        "ignore": [*ignore, "lm_head"],
                        "module_bits": {m: b for m, b in widths.items() if b != common}}
    out.mkdir(parents=True, exist_ok=True)
    config.dtype = "float32"
    config.save_pretrained(out)
    if quantization is not None:
        saved = json.loads((out / "config.json").read_text())
        saved["quantization_config"] = quantization
        (out / "config.json").write_text(json.dumps(saved, indent=2))
    tokenizer.save_pretrained(out)
    save_file(state, str(out / "model.safetensors"))


@dataclass(frozen=True)
class Codes:
    """A projection [N, K] as w = scale * (code - zero) in groups of 32: codes [N, K],
    scales and zeros [N, K / 32], fp32 arrays; `bits` the narrowest width its codes fit
    (4 or 8)."""

    bits: int
    codes: Any
    scales: Any
    zeros: Any

    def tensors(self, bits: int) -> dict[str, Any]:
        """The "gguf" method's tensors, codes `bits` wide (>= self.bits), in
        kernels/quant.py's layout: qweight [K / (32 / bits), N], scales, zeros [K / 32, N]."""
        import torch

        return {"qweight": torch.from_numpy(_pack_along_k(self.codes, bits)),
                "scales": torch.from_numpy(np.ascontiguousarray(self.scales.T)),
                "zeros": torch.from_numpy(np.ascontiguousarray(self.zeros.T))}


def _kept_projections(path: Path, config: Any, state: dict[str, Any]) -> dict[str, Codes]:
    """transformers module -> its Codes for every projection stored in a quantized type:
    the types of _BLOCKS decoded from their blocks, where they give transformers'
    dequantized weight (exactly for the symmetric types; to fp32 rounding where a float
    zero point stands for a block's minimum); the others (Q6_K's blocks of 16, Q2_K,
    Q3_K, the IQ types) re-quantized from that weight to 8-bit codes (`_requantized`)."""
    import torch
    from gguf import GGUFReader

    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    permuted = config.model_type in _PERMUTED
    kept = {}
    for tensor in GGUFReader(str(path)).tensors:
        qtype = tensor.tensor_type.name
        parts = tensor.name.split(".")
        if qtype in _FULL_PRECISION or len(parts) != 4 or parts[0] != "blk" \
                or parts[2] not in _PROJECTIONS or parts[3] != "weight":
            continue
        module = f"model.layers.{parts[1]}.{_PROJECTIONS[parts[2]]}"
        expected = state.get(f"{module}.weight")
        if expected is None:
            continue
        n, k = expected.shape
        if qtype not in _BLOCKS:
            if k % 32 == 0:
                kept[module] = _requantized(expected.numpy())
            continue
        codes = as_codes(qtype, np.asarray(tensor.data), n, k)
        if permuted and parts[2] in ("attn_q", "attn_k"):
            n_heads = heads if parts[2] == "attn_q" else kv_heads
            codes = Codes(codes.bits, *(_unpermute(a, n_heads) for a in (
                codes.codes, codes.scales, codes.zeros)))
        weight = torch.from_numpy((codes.codes - np.repeat(codes.zeros, 32, axis=1))
                                  * np.repeat(codes.scales, 32, axis=1))
        if not torch.allclose(weight, expected, rtol=1e-5,
                              atol=1e-6 * float(expected.abs().max())):
            logger.warning("%s: its %s blocks do not give transformers' weight; stored "
                           "dequantized", tensor.name, qtype)
            continue
        kept[module] = codes
    return kept


# Each decoder takes a tensor's blocks [N, bytes of its blocks in a row] uint8 and gives
# codes [N, K] (unsigned) and each block of 32's step and offset [N, K / 32]:
# w = step * code + offset (ggml's dequantize_row_* for the type).


def _halves(blocks: Any, at: int) -> Any:
    """The fp16 at byte `at` of each block, as fp32: [N, blocks]."""
    return blocks[..., at:at + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: Any) -> Any:
    """[..., 16] bytes -> [..., 32] codes: the low nibbles are elements 0..15, the high
    ones 16..31 (the legacy types' order)."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1).astype(np.float32)


def _high_bits(qh: Any) -> Any:
    """[..., 4] bytes -> [..., 32] values 0 or 16: bit i of the little-endian word is
    element i's fifth bit (Q5_0, Q5_1)."""
    word = qh.copy().view(np.uint32)  # [..., 1]
    return ((word >> np.arange(32, dtype=np.uint32)) & 1).astype(np.float32) * 16


def _q8_0(x: Any) -> Any:
    b = x.reshape(x.shape[0], -1, 34)
    d = _halves(b, 0)
    return b[..., 2:].copy().view(np.int8).astype(np.float32) + 128, d, -128 * d


def _q4_0(x: Any) -> Any:
    b = x.reshape(x.shape[0], -1, 18)
    d = _halves(b, 0)
    return _nibbles(b[..., 2:]), d, -8 * d


def _q4_1(x: Any) -> Any:
    b = x.reshape(x.shape[0], -1, 20)
    return _nibbles(b[..., 4:]), _halves(b, 0), _halves(b, 2)


def _q5_0(x: Any) -> Any:
    b = x.reshape(x.shape[0], -1, 22)
    d = _halves(b, 0)
    return _nibbles(b[..., 6:]) + _high_bits(b[..., 2:6]), d, -16 * d


def _q5_1(x: Any) -> Any:
    b = x.reshape(x.shape[0], -1, 24)
    return _nibbles(b[..., 8:]) + _high_bits(b[..., 4:8]), _halves(b, 0), _halves(b, 2)


def _k_scales(b: Any) -> tuple[Any, Any]:
    """A K-quant super-block's 8 six-bit scales and mins ([..., 8] each) from its 12
    bytes at offset 4 (ggml's get_scale_min_k4)."""
    q = b[..., 4:16].astype(np.int32)
    sc = np.concatenate([q[..., 0:4] & 63, (q[..., 8:12] & 0xF) | ((q[..., 0:4] >> 6) << 4)], -1)
    mn = np.concatenate([q[..., 4:8] & 63, (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)], -1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_quant(b: Any, qs: Any, qh: Any | None) -> Any:
    """Q4_K / Q5_K: super-blocks of 256 (fp16 d and dmin, then the scales), each 64
    elements' 32 bytes of qs holding sub-block 2j in the low nibbles and 2j + 1 in the
    high ones; Q5_K's fifth bits: bit 2j (and 2j + 1) of byte l of qh for element l."""
    rows, supers = b.shape[:2]
    sc, mn = _k_scales(b)
    step = _halves(b, 0)[..., None] * sc  # [N, supers, 8]
    offset = -_halves(b, 2)[..., None] * mn
    q = qs.reshape(rows, supers, 4, 32)
    codes = np.stack([q & 0xF, q >> 4], axis=3).astype(np.float32)  # [N, S, 4, 2, 32]
    if qh is not None:
        bit = np.arange(8).reshape(4, 2)[..., None]  # sub-block 2j + h uses bit 2j + h
        codes += ((qh[:, :, None, None, :] >> bit) & 1) * 16.0
    return (codes.reshape(rows, -1), step.reshape(rows, -1), offset.reshape(rows, -1))


def _q4_k(x: Any) -> Any:
    b = x.reshape(x.shape[0], -1, 144)
    return _k_quant(b, b[..., 16:], None)


def _q5_k(x: Any) -> Any:
    b = x.reshape(x.shape[0], -1, 176)
    return _k_quant(b, b[..., 48:], b[..., 16:48])


# The block types whose blocks are kept as integer codes: bits of the codes, the decoder.
# 5-bit codes take 8-bit ones (the kernels' two widths). The other quantized types are
# re-quantized to 8-bit codes (`_requantized`); these load as transformers' weights:
_FULL_PRECISION = frozenset({"F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64"})
_BLOCKS = {"Q8_0": (8, _q8_0), "Q4_0": (4, _q4_0), "Q4_1": (4, _q4_1), "Q5_0": (8, _q5_0),
           "Q5_1": (8, _q5_1), "Q4_K": (4, _q4_k), "Q5_K": (8, _q5_k)}


def _pack_along_k(codes: Any, bits: int) -> Any:
    """codes [N, K] -> the "gguf" method's qweight [K / (32 / bits), N] int32, input
    column k's code at bits (k % per_int) * bits of word k // per_int: kernels/quant.py's
    `pack` (not imported: weights/ serves both sides of the socket and imports no side)."""
    per_int = 32 // bits
    n, k = codes.shape
    grouped = codes.T.astype(np.uint32).reshape(k // per_int, per_int, n)
    shifts = (np.arange(per_int, dtype=np.uint32) * bits).reshape(1, per_int, 1)
    return np.ascontiguousarray(np.bitwise_or.reduce(grouped << shifts, axis=1)).view(np.int32)


def as_codes(qtype: str, blocks: Any, n: int, k: int) -> Codes:
    """A tensor [N, K] of block type `qtype` (one of _BLOCKS; its bytes `blocks`, N rows)
    as Codes: scale = step and zero = -offset / step for each block of 32's w = step *
    code + offset."""
    bits, decode = _BLOCKS[qtype]
    codes, step, offset = decode(blocks.reshape(n, -1))
    return _zero_points(bits, codes.reshape(n, k), step, offset)


def _requantized(weight: Any) -> Codes:
    """weight [N, K] fp32 as 8-bit codes over each group of 32's [min, max] (round to
    nearest: within half a step, (max - min) / 510, of each weight): for the block types
    that do not fit groups of 32 (Q6_K's sub-blocks of 16 with their own scales), whose
    coarser grids (64 levels a sub-block for Q6_K) this adds little to."""
    n, k = weight.shape
    groups = weight.reshape(n, k // 32, 32)
    low, high = groups.min(axis=-1), groups.max(axis=-1)
    step = (high - low) / 255
    codes = np.rint((groups - low[..., None]) / np.where(step == 0, 1, step)[..., None])
    return _zero_points(8, np.clip(codes, 0, 255).reshape(n, k), step, low)


def _zero_points(bits: int, codes: Any, step: Any, offset: Any) -> Codes:
    """w = step * code + offset per block of 32 -> Codes (w = scale * (code - zero)); a
    block of step 0 (w = offset throughout) takes codes 0, scale -offset and zero 1."""
    n = codes.shape[0]
    flat = step.reshape(n, -1) == 0
    offset = offset.reshape(n, -1)
    codes = np.where(np.repeat(flat, 32, axis=1), 0, codes)
    scales = np.where(flat, -offset, step.reshape(n, -1))
    zeros = np.where(flat, 1, -offset / np.where(flat, 1, step.reshape(n, -1)))
    return Codes(bits, codes.astype(np.float32), scales.astype(np.float32),
                 zeros.astype(np.float32))


def _unpermute(rows: Any, heads: int) -> Any:
    """llama.cpp's q/k row order back to transformers' (as transformers' GGUF loader):
    [N, ...] rows of interleaved pairs per head -> rotate-half order."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _whole_fused_groups(kept: dict[str, Codes]) -> dict[str, Codes]:
    """`kept` without the modules whose fused neighbours are not all kept."""
    return {module: codes for module, codes in kept.items()
            if all(n in kept for n in _fused_with(module))}


def _fused_widths(bits: dict[str, int]) -> dict[str, int]:
    """Each module's code width: the widest of its fused group's (computed as one
    projection, its parts share one width; 4-bit codes fit 8 bits exactly)."""
    return {m: max(bits[n] for n in _fused_with(m)) for m in bits}


def _fused_with(module: str) -> list[str]:
    """The modules computed as one projection with `module` (itself included)."""
    layer, _, name = module.rpartition(".")
    layer, _, kind = layer.rpartition(".")
    for group in _FUSED:
        if f"{kind}.{name}" in group:
            return [f"{layer}.{m}" for m in group]
    return [module]
