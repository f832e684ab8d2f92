"""llama.cpp's GGUF files as models: `LLM("model.gguf")`, `pagellm serve model.gguf`.

A GGUF file holds the config, the tokenizer and the weights, each in llama.cpp's own
terms. It is converted once into a Hugging Face directory in the cache
(~/.cache/pagellm/gguf/<name>-<key>, the key from the file's path, size and mtime) that
every part of the engine then reads as it reads any other: transformers parses the
config and the tokenizer (`gguf_file=`) and dequantizes every tensor, q and k rows
unpermuted (transformers' GGUF loader, so every family it reads is read alike).

Q8_0 and Q4_0 projections are kept quantized: their blocks are 32 weights sharing one
fp16 scale d, w = d * q with q in -127..127 (Q8_0) or d * (q - 8) with q in 0..15
(Q4_0), exactly compressed-tensors' symmetric pack-quantized scheme with groups of 32.
The directory stores them so (executor/model/quantized_checkpoint.py reads them: packed
for the Triton kernels, dequantized elsewhere), checked against transformers'
dequantized weight bit for bit, with q and k rows unpermuted as transformers does; a
projection that is not, or whose fused neighbours (q/k/v, gate/up) are not, of the
file's most common of the two types is stored dequantized. Other types (Q4_1, K-quants,
...) load dequantized (fp32).
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

from pagellm.protocol.engine_args import EngineArgs

logger = logging.getLogger("pagellm")

# llama.cpp's tensor name in block i -> transformers' module in layer i
_PROJECTIONS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
# Modules computed as one (their storage must agree): the q/k/v and gate/up of a layer.
_FUSED = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          ("mlp.gate_proj", "mlp.up_proj"))
_BITS = {"Q8_0": 8, "Q4_0": 4}  # block types stored packed
_PERMUTED = ("llama", "mistral")  # families whose q and k rows llama.cpp permutes
# The oldest transformers whose GGUF reader this was tested with: 5.0-5.17 fail on a
# file with an EOS and no BOS token id (as llama.cpp writes Qwen's), and 5.0 adds a BOS
# the file says not to add.
TRANSFORMERS_FLOOR = (5, 18)


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


def gguf_model_dir(path: Path) -> Path:
    """The Hugging Face directory `path` converts to, built into the cache if it is not
    there yet (into a temporary directory, renamed when complete: a reader never sees a
    half-built one)."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    final = cache_dir() / f"{path.stem}-{key.hexdigest()[:16]}"
    if (final / "config.json").is_file():
        return final
    tmp = final.with_name(f"{final.name}.tmp{os.getpid()}")
    try:
        convert(path, tmp)
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


def convert(path: Path, out: Path) -> None:
    """Write `path` as a Hugging Face directory at `out` (module docstring)."""
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
    packed = _packed_projections(path, config, state)
    bits = Counter(b for b, _ in packed.values()).most_common(1)
    quantization = None
    if bits:
        chosen = bits[0][0]
        packed = {m: p for m, p in packed.items() if p[0] == chosen}
        packed = _whole_fused_groups(packed, state)
        for module, (_, tensors) in packed.items():
            del state[f"{module}.weight"]
            state.update({f"{module}.{k}": v for k, v in tensors.items()})
        ignore = sorted(k.removesuffix(".weight") for k in state
                        if k.endswith("_proj.weight"))
        quantization = _compressed_tensors_config(chosen, [*ignore, "lm_head"])
    out.mkdir(parents=True, exist_ok=True)
    config.dtype = "float32"
    config.save_pretrained(out)
    if quantization is not None:
        saved = json.loads((out / "config.json").read_text())
        saved["quantization_config"] = quantization
        (out / "config.json").write_text(json.dumps(saved, indent=2))
    tokenizer.save_pretrained(out)
    save_file(state, str(out / "model.safetensors"))


def _packed_projections(path: Path, config: Any, state: dict[str, Any]
                        ) -> dict[str, tuple[int, dict[str, Any]]]:
    """transformers module -> (bits, compressed-tensors' tensors) for every Q8_0 / Q4_0
    projection whose blocks give transformers' dequantized weight exactly."""
    import numpy as np
    import torch
    from gguf import GGUFReader

    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    permuted = config.model_type in _PERMUTED
    packed = {}
    for tensor in GGUFReader(str(path)).tensors:
        qtype = tensor.tensor_type.name
        parts = tensor.name.split(".")
        if qtype not in _BITS or len(parts) != 4 or parts[0] != "blk" \
                or parts[2] not in _PROJECTIONS or parts[3] != "weight":
            continue
        module = f"model.layers.{parts[1]}.{_PROJECTIONS[parts[2]]}"
        expected = state.get(f"{module}.weight")
        if expected is None:
            continue
        n, k = expected.shape
        blocks = np.asarray(tensor.data).reshape(n, k // 32, -1)  # [N, K/32, block bytes]
        scale = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, K/32]
        if qtype == "Q8_0":  # signed codes
            codes = blocks[..., 2:].copy().view(np.int8).astype(np.int64)
        else:  # 16 bytes: weights 0..15 in the low nibbles, 16..31 in the high ones
            nibbles = blocks[..., 2:].astype(np.int64)
            codes = np.concatenate([nibbles & 0xF, nibbles >> 4], axis=-1) - 8
        codes = codes.reshape(n, k)  # signed: w = d * code
        if permuted and parts[2] in ("attn_q", "attn_k"):
            n_heads = heads if parts[2] == "attn_q" else kv_heads
            codes, scale = _unpermute(codes, n_heads), _unpermute(scale, n_heads)
        weight = codes.astype(np.float32) * np.repeat(scale, 32, axis=1)
        if not torch.equal(torch.from_numpy(weight), expected):
            logger.warning("%s: its %s blocks do not give transformers' weight; stored "
                           "dequantized", tensor.name, qtype)
            continue
        bits = _BITS[qtype]
        packed[module] = (bits, {
            "weight_packed": torch.from_numpy(_pack_rows(codes + 2 ** (bits - 1), bits)),
            "weight_scale": torch.from_numpy(np.ascontiguousarray(scale)),
            "weight_shape": torch.tensor([n, k])})
    return packed


def _pack_rows(codes: Any, bits: int) -> Any:
    """codes [N, K] unsigned -> [N, K / (32 / bits)] int32, code j of each word at bits
    j * bits (compressed-tensors' pack-quantized layout)."""
    import numpy as np

    per_int = 32 // bits
    words = np.zeros((codes.shape[0], codes.shape[1] // per_int), dtype=np.uint32)
    for j in range(per_int):
        words |= codes[:, j::per_int].astype(np.uint32) << np.uint32(bits * j)
    return words.view(np.int32)


def _unpermute(rows: Any, heads: int) -> Any:
    """llama.cpp's q/k row order back to transformers' (as transformers' GGUF loader):
    [N, ...] rows of interleaved pairs per head -> rotate-half order."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _whole_fused_groups(packed: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
    """`packed` without the modules whose fused neighbours are not all packed."""
    keep = dict(packed)
    for module in packed:
        layer = module.rsplit(".", 2)[0]
        for group in _FUSED:
            names = [f"{layer}.{m}" for m in group]
            if module in names and not all(n in packed for n in names):
                keep.pop(module, None)
    return keep


def _compressed_tensors_config(bits: int, ignore: list[str]) -> dict[str, Any]:
    weights = {"num_bits": bits, "type": "int", "strategy": "group", "group_size": 32,
               "symmetric": True, "dynamic": False, "actorder": None}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "quantization_status": "compressed", "ignore": ignore,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": None}}}
