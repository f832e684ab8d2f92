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
from pathlib import Path
from typing import Any

import numpy as np

from pagellm.protocol.engine_args import EngineArgs
from pagellm.weights.gguf_blocks import BLOCKS, FULL_PRECISION, Codes, as_codes, requantized

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


def _kept_projections(path: Path, config: Any, state: dict[str, Any]) -> dict[str, Codes]:
    """transformers module -> its Codes for every projection stored in a quantized type:
    the types of BLOCKS decoded from their blocks, where they give transformers'
    dequantized weight (exactly for the symmetric types; to fp32 rounding where a float
    zero point stands for a block's minimum); the others (Q6_K's blocks of 16, Q2_K,
    Q3_K, the IQ types) re-quantized from that weight to 8-bit codes (`requantized`)."""
    import torch
    from gguf import GGUFReader

    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    permuted = config.model_type in _PERMUTED
    kept = {}
    for tensor in GGUFReader(str(path)).tensors:
        qtype = tensor.tensor_type.name
        parts = tensor.name.split(".")
        if qtype in FULL_PRECISION or len(parts) != 4 or parts[0] != "blk" \
                or parts[2] not in _PROJECTIONS or parts[3] != "weight":
            continue
        module = f"model.layers.{parts[1]}.{_PROJECTIONS[parts[2]]}"
        expected = state.get(f"{module}.weight")
        if expected is None:
            continue
        n, k = expected.shape
        if qtype not in BLOCKS:
            if k % 32 == 0:
                kept[module] = requantized(expected.numpy())
            continue
        codes = as_codes(qtype, np.asarray(tensor.data), n, k)
        if permuted and parts[2] in ("attn_q", "attn_k"):
            n_heads = heads if parts[2] == "attn_q" else kv_heads
            codes = Codes(codes.bits, *(_unpermute(a, n_heads) for a in (
                codes.codes, codes.scales, codes.zeros)))
        if not torch.allclose(torch.from_numpy(codes.weight()), expected, rtol=1e-5,
                              atol=1e-6 * float(expected.abs().max())):
            logger.warning("%s: its %s blocks do not give transformers' weight; stored "
                           "dequantized", tensor.name, qtype)
            continue
        kept[module] = codes
    return kept


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
