"""llama.cpp's GGUF files as models: `LLM("model.gguf")`, `pagellm serve model.gguf`.

A GGUF file holds the config, the tokenizer and the weights, each in llama.cpp's own
terms. It is converted once into a Hugging Face directory in the cache
(~/.cache/pagellm/gguf/<name>-<key>, the key from FORMAT and the file's path, size and
mtime) that every part of the engine then reads as it reads any other: transformers
parses the config and the tokenizer (`gguf_file=`), and each tensor is dequantized and
named as transformers' GGUF loader does (the gguf package's dequantize, then its
per-architecture TensorProcessor: llama's q and k rows unpermuted, so every family it
reads is read alike), but one tensor at a time, written into safetensors shards as it
comes: converting holds one shard and one tensor, not the whole model in fp32.

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
kernels then compute with the file's own weights. A MoE layer's experts, one stacked
tensor per projection in the file, are written an expert at a time under the
checkpoint's per-expert names (model.layers.N.mlp.experts.E.gate_proj, ...), as codes
the same way, which load packed (moe.ExpertCodes); stored unquantized, as fp32 weights
that the quantization_config ignores by a pattern per layer. A llama file with experts
(Mixtral's, as convert_hf_to_gguf.py writes it) converts as a Mixtral.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pagellm.protocol.engine_args import EngineArgs
from pagellm.weights.gguf_blocks import BLOCKS, FULL_PRECISION, Codes, as_codes, requantized

logger = logging.getLogger("pagellm")

# A layer's projections (transformers' names) a file may store as blocks: Phi-3's q/k/v
# and gate/up are one tensor each in the file and the model alike; a Qwen2-MoE layer's
# shared expert is a gated MLP of its own.
_PROJECTIONS = frozenset({"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                          "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                          "self_attn.qkv_proj", "mlp.gate_up_proj",
                          "mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj",
                          "mlp.shared_expert.down_proj"})
# An expert's projection, as transformers names a checkpoint's (qwen3_moe's)
_EXPERT_PROJECTION = re.compile(r"(model\.layers\.\d+\.mlp)\.experts\.\d+\.(gate|up|down)_proj"
                                r"\.weight")
# llama.cpp's stacked experts [E, N, K] in a file
_FILE_EXPERTS = re.compile(r"(blk\.(\d+)\.ffn_(gate|up|down)_exps)\.weight")
# Modules computed as one (their storage must agree): a layer's (or an expert's) q/k/v
# and gate/up.
_FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
_PERMUTED = ("llama", "mistral", "mixtral")  # families whose q/k rows llama.cpp permutes
# The oldest transformers whose GGUF reader this was tested with: 5.0-5.17 fail on a
# file with an EOS and no BOS token id (as llama.cpp writes Qwen's), and 5.0 adds a BOS
# the file says not to add.
TRANSFORMERS_FLOOR = (5, 18)
# The converted directory's layout, part of its cache key: 4 reads Qwen2-MoE files (the
# widths of their experts and shared expert, the shared expert as codes); 3 writes
# quantized MoE experts as codes an expert at a time (2 wrote them stacked in fp32: a
# converted file is converted again to get them) and Qwen3-MoE's expert width from the
# file; 2 keeps quantized projections as the "gguf" quantization method (1 kept Q8_0 /
# Q4_0 as compressed-tensors).
FORMAT = 4
# What llama.cpp derives from a file's shape and transformers' GGUF reader leaves at its
# default (one of `_as_llama_cpp_runs_it`'s): Gemma 2 and 3 at 27B (46 and 62 layers)
# scale queries by 1 / sqrt(hidden / heads), 144 and 168, not by 1 / sqrt(head_dim)
# (llama.cpp's hparams, after gemma_pytorch's configs; the file has no field for it).
_QUERY_SCALE_BY_WIDTH = {"gemma2": 46, "gemma3_text": 62}
# The size a converted directory's safetensors files grow to before the next begins.
SHARD_BYTES = 256 << 20


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
    gguf_model_dir's), a tensor at a time: memory holds one shard of the output and the
    tensor at hand, never the whole model in fp32 (a 7B file's 28 GB)."""
    import transformers
    from transformers import AutoConfig, AutoTokenizer

    logger.info("converting %s to a Hugging Face directory at %s", path, out)
    try:
        from gguf import GGUFReader
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
        reader = GGUFReader(str(path))
    except (ValueError, KeyError, OSError, RuntimeError) as e:
        raise ValueError(f"cannot read the GGUF file {path}: {e}") from e
    config = _as_llama_cpp_runs_it(config, reader)
    out.mkdir(parents=True, exist_ok=True)
    try:
        quantization = _write_weights(reader, config, out, dequantized)
    except ValueError as e:
        raise ValueError(f"cannot read the GGUF file {path}: {e}") from e
    config.dtype = "float32"
    config.save_pretrained(out)
    if quantization is not None:
        saved = json.loads((out / "config.json").read_text())
        saved["quantization_config"] = quantization
        (out / "config.json").write_text(json.dumps(saved, indent=2))
    tokenizer.save_pretrained(out)


def _as_llama_cpp_runs_it(config: Any, reader: Any) -> Any:
    """`config` with what llama.cpp takes from the file, or assumes of its architecture,
    and transformers' GGUF reader leaves at the config class's default: a llama file
    with experts (`llama.expert_count`: Mixtral's, as convert_hf_to_gguf.py writes it) is
    a Mixtral, which the reader reads as a dense Llama; Gemma 2 and 3 at 27B scale
    queries by 1 / sqrt(hidden / heads) (_QUERY_SCALE_BY_WIDTH); Qwen3-MoE's and
    Qwen2-MoE's experts are `expert_feed_forward_length` wide and Qwen2-MoE's shared
    expert `expert_shared_feed_forward_length` (the reader keeps the config classes'
    768, 1408 and 5632: Qwen3-30B-A3B's and Qwen1.5-MoE-A2.7B's only; Qwen3-235B-A22B's
    experts are 1536, Qwen2-57B-A14B's 2560 and its shared expert 20480)."""
    from transformers import MixtralConfig
    from transformers.modeling_gguf_pytorch_utils import read_field

    experts = read_field(reader, "llama.expert_count")
    if config.model_type == "llama" and experts and int(experts[0]) > 0:
        fields = {k: v for k, v in config.to_dict().items()
                  if k not in ("model_type", "architectures", "transformers_version")}
        config = MixtralConfig(**fields, num_local_experts=int(experts[0]),
                               num_experts_per_tok=int(read_field(
                                   reader, "llama.expert_used_count")[0]))
    if _QUERY_SCALE_BY_WIDTH.get(config.model_type) == config.num_hidden_layers:
        config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads
    if config.model_type in ("qwen3_moe", "qwen2_moe"):
        arch = config.model_type.replace("_", "")
        for field, attr in (("expert_feed_forward_length", "moe_intermediate_size"),
                            ("expert_shared_feed_forward_length",
                             "shared_expert_intermediate_size")):
            width = read_field(reader, f"{arch}.{field}")
            if width and hasattr(config, attr):
                setattr(config, attr, int(width[0]))
    return config


def _write_weights(reader: Any, config: Any, out: Path, dequantized: bool
                   ) -> dict[str, Any] | None:
    """The file's tensors into safetensors shards at `out`, the projections as codes
    (none if `dequantized`); the config's quantization_config for them (None: no codes).
    ValueError naming a weight the model expects and the file lacks."""
    tied = getattr(config, "tie_word_embeddings", False)
    shards = _Shards(out)
    projections = _Projections(config)
    tensors, expected = _file_tensors(reader, config)
    seen = set()
    for name, weight, tensor in tensors:
        if tied and name == "lm_head.weight":
            continue
        expert = _EXPERT_PROJECTION.fullmatch(name)  # the model's name: its experts stacked
        seen.add(name if expert is None else
                 f"{expert[1]}.experts.{'down' if expert[2] == 'down' else 'gate_up'}_proj")
        if dequantized or tensor is None or not _is_projection(name):
            shards.add(name, weight)
        else:
            for written in projections.add(name.removesuffix(".weight"), weight, tensor):
                shards.add(*written)
    for written in projections.rest():
        shards.add(*written)
    missing = sorted(expected - seen - ({"lm_head.weight"} if tied else set()))
    if missing:
        raise ValueError(f"it has no tensor for {', '.join(missing[:4])}"
                         f"{' ...' if len(missing) > 4 else ''}")
    shards.close()
    ignore, plain_experts = [], set()
    for name in sorted(n for n in shards.where if n.endswith("_proj.weight")):
        if expert := _EXPERT_PROJECTION.fullmatch(name):
            plain_experts.add((expert[1], "down" if expert[2] == "down" else "(gate|up)"))
        else:
            ignore.append(name.removesuffix(".weight"))
    # A layer's experts are one packed weight per projection: a pattern for all of them
    ignore += [f"re:{re.escape(mlp)}\\.experts\\.\\d+\\.{parts}_proj$"
               for mlp, parts in sorted(plain_experts)]
    return projections.quantization(ignore)


def _file_tensors(reader: Any, config: Any) -> tuple[Iterator[tuple[str, Any, Any]],
                                                     set[str]]:
    """The file's tensors as transformers loads them, one at a time: each (its name in
    transformers' model, its fp32 weight [numpy], the file's tensor, None for a tensor
    a TensorProcessor assembled from several), transformers' own per-architecture steps
    (its GGUF loader's TensorProcessor: llama's q/k rows unpermuted, Gemma's norms less
    1, MoE experts stacked) on the gguf package's dequantized tensor; and the names the
    model expects. transformers' loader does the same over the whole file at once, and
    every family pagellm serves goes through it (its newer GGUF path covers none).
    A layer's stacked experts come an expert at a time instead, each under the
    checkpoint's per-expert name with its slice of the file's tensor (what transformers'
    Qwen-MoE processor stacks, unstacked: the same values; its llama processor, which
    Mixtral's files take, stacks none)."""
    import torch
    from gguf import MODEL_ARCH_NAMES, dequantize, get_tensor_name_map
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        read_field,
    )

    architecture = read_field(reader, "general.architecture")[0]
    arch = next((a for a, name in MODEL_ARCH_NAMES.items() if name == architecture), None)
    if arch is None:
        raise ValueError(f"the gguf package does not know its architecture {architecture!r}")
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())
    with torch.device("meta"):
        expected = list(AutoModelForCausalLM.from_config(config).state_dict())
    table = get_tensor_name_map(arch, config.num_hidden_layers)
    to_model: dict[str, str] = {}  # file's name -> model's (transformers' own mapping)
    for name in map(processor.preprocess_name, expected):
        base, dot, kind = name.rpartition(".") if name.endswith((".weight", ".bias")) \
            else (name, "", "")
        found = table.get_name(base)
        if found is None:
            processor.perform_fallback_tensor_mapping(to_model, dot + kind, "", name)
        else:
            to_model[found + dot + kind] = name

    def tensors() -> Iterator[tuple[str, Any, Any]]:
        assembled: dict[str, Any] = {"tensors": {}}  # what a processor stacks (experts)
        for tensor in reader.tensors:
            experts = _FILE_EXPERTS.fullmatch(tensor.name)
            if experts is not None:
                stacked = dequantize(tensor.data, tensor.tensor_type)  # [E, N, K]
                for e, weight in enumerate(stacked):
                    yield (f"model.layers.{experts[2]}.mlp.experts.{e}.{experts[3]}_proj.weight",
                           np.asarray(weight, np.float32),
                           _Slice(f"{tensor.name}[{e}]", tensor.tensor_type, tensor.data[e]))
                continue
            result = processor.process(
                weights=dequantize(tensor.data, tensor.tensor_type), name=tensor.name,
                tensor_key_mapping=to_model, parsed_parameters=assembled)
            if result.name in to_model:
                yield to_model[result.name], np.asarray(result.weights, np.float32), tensor
        for name, stacked in assembled["tensors"].items():
            yield name, stacked.float().numpy(), None

    return tensors(), set(expected)


def _is_projection(name: str) -> bool:
    """A layer's attention or MLP projection weight, or an expert's (a shared one's too),
    one a file may store as blocks."""
    parts = name.split(".")
    return (len(parts) > 5 and parts[:2] == ["model", "layers"] and parts[-1] == "weight"
            and ".".join(parts[3:-1]) in _PROJECTIONS) or bool(_EXPERT_PROJECTION.fullmatch(name))


@dataclass(frozen=True)
class _Slice:
    """One expert's part of a file's stacked experts tensor, as _Projections reads a
    tensor: its name (for messages), type and blocks [N, bytes of a row's blocks]."""

    name: str
    tensor_type: Any
    data: Any


class _Projections:
    """The projections as they arrive, kept as codes a fused group (q/k/v, gate/up) at a
    time: held until the group is whole, then written as codes at the widest of their
    widths when every part has codes, else (one stored unquantized, or blocks that do
    not give transformers' weight) all as fp32 weights."""

    def __init__(self, config: Any) -> None:
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.permuted = config.model_type in _PERMUTED
        self.pending: dict[str, dict[str, tuple[Any, Codes | None]]] = {}
        self.widths: dict[str, int] = {}  # module -> the code width it was written at

    def add(self, module: str, weight: Any, tensor: Any) -> list[tuple[str, Any]]:
        """`module`'s weight [N, K] fp32 and its file tensor -> the tensors to write
        (none until its fused group is whole)."""
        group = _fused_with(module)
        parts = self.pending.setdefault(group[0], {})
        parts[module] = (weight, self._codes(module, weight, tensor))
        return self._written(self.pending.pop(group[0])) if len(parts) == len(group) else []

    def rest(self) -> list[tuple[str, Any]]:
        """The parts of groups the file does not hold whole: written as weights."""
        return [t for group in self.pending.values() for t in self._written(group, whole=False)]

    def quantization(self, ignore: list[str]) -> dict[str, Any] | None:
        """The config's quantization_config for what was written (None: no codes)."""
        if not self.widths:
            return None
        common = Counter(self.widths.values()).most_common(1)[0][0]
        return {"quant_method": "gguf", "bits": common, "group_size": 32,
                "ignore": [*ignore, "lm_head"],
                "module_bits": {m: b for m, b in sorted(self.widths.items()) if b != common}}

    def _written(self, parts: dict[str, tuple[Any, Codes | None]],
                 whole: bool = True) -> list[tuple[str, Any]]:
        if not whole or any(codes is None for _, codes in parts.values()):
            return [(f"{m}.weight", weight) for m, (weight, _) in parts.items()]
        # Computed as one projection, the parts share one width (4-bit codes fit 8 bits).
        width = max(codes.bits for _, codes in parts.values() if codes is not None)
        written = []
        for module, (_, codes) in parts.items():
            assert codes is not None
            self.widths[module] = width
            written += [(f"{module}.{k}", v) for k, v in codes.tensors(width).items()]
        return written

    def _codes(self, module: str, expected: Any, tensor: Any) -> Codes | None:
        """The projection's Codes (None: stored as its weight): the types of BLOCKS
        decoded from their blocks, where they give transformers' dequantized weight
        `expected` (exactly for the symmetric types; to fp32 rounding where a float zero
        point stands for a block's minimum); the others (Q6_K's blocks of 16, Q2_K, Q3_K,
        the IQ types) re-quantized from that weight to 8-bit codes (`requantized`)."""
        qtype = tensor.tensor_type.name
        n, k = expected.shape
        if qtype in FULL_PRECISION:
            return None
        if qtype not in BLOCKS:
            return requantized(expected) if k % 32 == 0 else None
        codes = as_codes(qtype, np.asarray(tensor.data), n, k)
        name = module.rpartition(".")[2]
        if self.permuted and name in ("q_proj", "k_proj"):
            heads = self.heads if name == "q_proj" else self.kv_heads
            codes = Codes(codes.bits, *(_unpermute(a, heads) for a in (
                codes.codes, codes.scales, codes.zeros)))
        if not np.allclose(codes.weight(), expected, rtol=1e-5,
                           atol=1e-6 * float(np.abs(expected).max())):
            logger.warning("%s: its %s blocks do not give transformers' weight; stored "
                           "dequantized", tensor.name, qtype)
            return None
        return codes


class _Shards:
    """safetensors files of about SHARD_BYTES each, written as the tensors arrive (one
    file model.safetensors, else model-0000i-of-0000n.safetensors and their index, as
    transformers shards a checkpoint): conversion memory stays one shard whatever the
    model's size."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.buffer: dict[str, Any] = {}
        self.bytes = 0
        self.files: list[Path] = []
        self.where: dict[str, int] = {}  # tensor name -> its file's index (once written)

    def add(self, name: str, tensor: Any) -> None:
        import torch

        if isinstance(tensor, np.ndarray):  # an F32 tensor may be the file's read-only map
            writable = tensor.flags.writeable and tensor.flags.c_contiguous
            tensor = torch.from_numpy(tensor if writable else np.array(tensor))
        self.buffer[name] = tensor.contiguous()
        self.bytes += tensor.numel() * tensor.element_size()
        if self.bytes >= SHARD_BYTES:
            self._flush()

    def close(self) -> None:
        if self.buffer or not self.files:
            self._flush()
        if len(self.files) == 1:
            self.files[0].rename(self.out / "model.safetensors")
            return
        names = [f"model-{i + 1:05d}-of-{len(self.files):05d}.safetensors"
                 for i in range(len(self.files))]
        for file, name in zip(self.files, names, strict=True):
            file.rename(self.out / name)
        index = {"metadata": {"total_size": sum(f.stat().st_size for f in
                                                map(self.out.joinpath, names))},
                 "weight_map": {t: names[i] for t, i in sorted(self.where.items())}}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))

    def _flush(self) -> None:
        from safetensors.torch import save_file

        file = self.out / f"part{len(self.files)}.safetensors"
        save_file(self.buffer, str(file))
        self.where.update(dict.fromkeys(self.buffer, len(self.files)))
        self.files.append(file)
        self.buffer, self.bytes = {}, 0


def _unpermute(rows: Any, heads: int) -> Any:
    """llama.cpp's q/k row order back to transformers' (as transformers' GGUF loader):
    [N, ...] rows of interleaved pairs per head -> rotate-half order."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _fused_with(module: str) -> list[str]:
    """The modules computed as one projection with `module` (itself included): its
    siblings in one of _FUSED."""
    parent, _, name = module.rpartition(".")
    for group in _FUSED:
        if name in group:
            return [f"{parent}.{m}" for m in group]
    return [module]
