"""Small random-weight Hugging Face models, built offline.

pagellm has no network access in tests or CI, yet it has to be compared token for token
against transformers on real model directories. This module makes such directories from
nothing: a byte-level BPE tokenizer trained on text shipped with Python itself
(demo/tokenizer.py), and a llama / qwen2 / qwen3 model with random (but deterministic)
weights, saved exactly the way a checkpoint from the Hub is (config.json, safetensors,
generation_config.json, tokenizer files and a ChatML chat template).

The weights are deliberately not transformers' defaults: the default init (std 0.02) makes
small models repeat one token, and norms at 1 / biases at 0 would let a loader that drops
them still pass a comparison. See ``make_model``.

torch, transformers and tokenizers are imported inside the functions that need them: the
CLI (`pagellm make-model`) and resolving `--model demo` must stay cheap to import.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagellm.demo.tokenizer import (  # re-exported: part of this module's API
    CHAT_TEMPLATE,
    ENDOFTEXT_ID,
    EOS_TOKEN_IDS,
    MIN_VOCAB_SIZE,
    SPECIAL_TOKENS,
    train_tokenizer,
)
from pagellm.protocol.engine_args import EngineArgs

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

__all__ = [
    "ARCHS",
    "CHAT_TEMPLATE",
    "DEMO_SPEC",
    "DEMO_VERSION",
    "DTYPES",
    "EOS_TOKEN_IDS",
    "SPECIAL_TOKENS",
    "ModelSpec",
    "demo_model_dir",
    "make_model",
    "train_tokenizer",
]

ARCHS: tuple[str, ...] = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "qwen2_moe",
                          "mixtral", "olmoe", "gemma2", "gemma3_text", "phi3", "gpt_oss",
                          "deepseek_v2", "deepseek_v3", "glm4_moe", "glm4_moe_lite", "olmo2",
                          "olmo3", "smollm3", "granite", "seed_oss", "minimax_m2",
                          "glm", "glm4", "cohere", "cohere2", "exaone4",
                          "ernie4_5", "ernie4_5_moe", "lfm2", "lfm2_moe", "qwen3_5_text",
                          "qwen3_5_moe_text", "qwen3_next", "granitemoehybrid")
DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class ModelSpec:
    """What model ``make_model`` builds.

    Defaults give a tiny llama (a few hundred K parameters) that builds in well under a
    second, so tests can make several. Invalid values raise ``ValueError`` naming the
    field at construction, before any expensive work.
    """

    arch: str = "llama"
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    # None: hidden_size // num_heads. qwen3 (and llama) may use a different head_dim;
    # qwen2 cannot (its config has no head_dim field).
    head_dim: int | None = None
    intermediate_size: int = 128
    # The tokenizer is trained to exactly this size, so model vocab == tokenizer vocab.
    vocab_size: int = 1024
    max_position_embeddings: int = 2048
    # None: the architecture's usual choice (llama untied, qwen2/qwen3 tied).
    tie_word_embeddings: bool | None = None
    rope_theta: float = 10000.0
    # Extra RoPE parameters, e.g. {"rope_type": "llama3", "factor": 8.0, ...}; also
    # "linear" and "yarn". Merged into transformers 5's config.rope_parameters.
    rope_scaling: dict[str, Any] | None = None
    # Wider than transformers' 0.02 so that greedy decoding is varied.
    init_std: float = 0.08
    seed: int = 0
    # dtype the weights are saved in.
    dtype: str = "float32"
    # e.g. "100KB": forces several model-0000x-of-0000y.safetensors plus an index json.
    max_shard_size: str | None = None
    # The family's own config fields on top (experts, sliding_window, layer_types, ...),
    # as its config.json spells them.
    config_extra: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        """Reject specs transformers would choke on later, or silently get wrong."""
        if self.arch not in ARCHS:
            raise ValueError(f"arch must be one of {', '.join(ARCHS)}; got {self.arch!r}")
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "intermediate_size", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int; got {value!r}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim is None:
            if self.hidden_size % self.num_heads != 0:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) must be divisible by num_heads "
                    f"({self.num_heads}) when head_dim is None"
                )
        elif isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int) \
                or self.head_dim <= 0:
            raise ValueError(f"head_dim must be a positive int or None; got {self.head_dim!r}")
        elif self.arch == "qwen2" and self.head_dim * self.num_heads != self.hidden_size:
            raise ValueError(
                "head_dim must equal hidden_size // num_heads for qwen2 (Qwen2 configs have "
                f"no head_dim field); got head_dim={self.head_dim}"
            )
        if self.effective_head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for RoPE; got {self.effective_head_dim}")
        if isinstance(self.vocab_size, bool) or not isinstance(self.vocab_size, int) \
                or self.vocab_size < MIN_VOCAB_SIZE:
            raise ValueError(
                f"vocab_size must be an int >= {MIN_VOCAB_SIZE} (256 byte symbols + "
                f"{len(SPECIAL_TOKENS)} special tokens + merges); got {self.vocab_size!r}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be positive; got {self.rope_theta!r}")
        if self.rope_scaling is not None:
            if not isinstance(self.rope_scaling, dict):
                raise ValueError(f"rope_scaling must be a dict or None; got {self.rope_scaling!r}")
            if "rope_type" not in self.rope_scaling and "type" not in self.rope_scaling:
                raise ValueError("rope_scaling must name its 'rope_type'")
        if not self.init_std > 0:
            raise ValueError(f"init_std must be positive; got {self.init_std!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative int; got {self.seed!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.max_shard_size is not None and not isinstance(self.max_shard_size, str):
            raise ValueError(f"max_shard_size must be a str or None; got {self.max_shard_size!r}")

    @property
    def effective_head_dim(self) -> int:
        """head_dim with the None default resolved."""
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    @property
    def effective_tie_word_embeddings(self) -> bool:
        """tie_word_embeddings with the per-architecture default resolved."""
        if self.tie_word_embeddings is not None:
            return self.tie_word_embeddings
        return self.arch != "llama"


# The built-in demo model (CLI `--model demo`, benchmarks): llama-shaped, big enough to
# look like a model, small enough (~3.4M parameters) to build in a few seconds.
DEMO_SPEC = ModelSpec(
    arch="llama",
    hidden_size=256,
    num_layers=4,
    num_heads=8,
    num_kv_heads=4,
    intermediate_size=512,
    vocab_size=2048,
    max_position_embeddings=4096,
    seed=0,
)
# Bump when DEMO_SPEC or the way models are built changes, so stale caches are not reused.
DEMO_VERSION = "demo-v1"


# --------------------------------------------------------------------------- model


def _rope_parameters(spec: ModelSpec) -> dict[str, Any]:
    """transformers 5 keeps all RoPE settings in one dict, ``config.rope_parameters``."""
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": float(spec.rope_theta)}
    if spec.rope_scaling is not None:
        extra = dict(spec.rope_scaling)
        # Older checkpoints spell it "type"; accept both.
        if "type" in extra:
            extra.setdefault("rope_type", extra.pop("type"))
        params.update(extra)
    return params


def _build_config(spec: ModelSpec) -> PretrainedConfig:
    """The transformers config for ``spec``, as a Hub checkpoint of that family has it."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common: dict[str, Any] = {
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "max_position_embeddings": spec.max_position_embeddings,
        "rope_parameters": _rope_parameters(spec),
        "tie_word_embeddings": spec.effective_tie_word_embeddings,
        "bos_token_id": None,
        "eos_token_id": ENDOFTEXT_ID,
        "pad_token_id": ENDOFTEXT_ID,
        "use_cache": True,
        "dtype": spec.dtype,
    }
    extra = dict(spec.config_extra or {})
    if spec.arch == "llama":
        return LlamaConfig(**common, head_dim=spec.effective_head_dim, **extra)
    if spec.arch == "qwen2":
        # Qwen2 always has q/k/v biases and no head_dim field.
        return Qwen2Config(**common, **{"max_window_layers": spec.num_layers, **extra})
    if spec.arch == "qwen3":
        # q_norm / k_norm are built in; head_dim is explicit (it often differs from
        # hidden_size // num_heads in real Qwen3 checkpoints).
        return Qwen3Config(**common, head_dim=spec.effective_head_dim,
                           **{"max_window_layers": spec.num_layers, **extra})
    from transformers import AutoConfig

    if spec.arch in ("gemma3_text", "olmo3"):
        # Gemma 3 and OLMo 3 have a RoPE per layer type: `spec`'s for the global layers,
        # the default (10k, unscaled) for the sliding ones. transformers 5.0 needs this
        # nested form (a flat dict is a KeyError there); later releases read it too.
        common["rope_parameters"] = {
            "full_attention": common["rope_parameters"],
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    # these derive head_dim (DeepSeek's is its rotary part, qk_rope_head_dim)
    if spec.arch not in ("qwen2", "qwen2_moe", "olmoe", "phi3", "deepseek_v2", "deepseek_v3",
                         "glm4_moe_lite", "lfm2", "lfm2_moe", "granitemoehybrid"):
        extra.setdefault("head_dim", spec.effective_head_dim)
    return AutoConfig.for_model(spec.arch, **common, **extra)


def _reinit_weights(model: torch.nn.Module, spec: ModelSpec) -> None:
    """Overwrite every parameter from a generator seeded with ``spec.seed``.

    Linear / Embedding weights ~ N(0, init_std) (varied greedy output), RMSNorm weights
    ~ 1 + 0.1 N(0, 1) and biases ~ 0.05 N(0, 1) (so a loader that drops them is caught).
    Values are drawn in fp32 in module order, so they do not depend on the global RNG or
    on the save dtype. Any other kind of parameter is an error rather than left at its
    transformers default.
    """
    import torch

    gen = torch.Generator().manual_seed(spec.seed)
    seen: set[int] = set()
    with torch.no_grad():
        for module_name, module in model.named_modules():
            for param_name, param in module.named_parameters(recurse=False):
                if id(param) in seen:  # tied lm_head / embed_tokens: draw once
                    continue
                seen.add(id(param))
                kind = type(module).__name__
                if param_name == "bias":
                    values = 0.05 * torch.randn(param.shape, generator=gen)
                elif param_name == "weight" and isinstance(
                    module, (torch.nn.Linear, torch.nn.Embedding)
                ):
                    values = torch.randn(param.shape, generator=gen) * spec.init_std
                elif param_name == "weight" and isinstance(module, torch.nn.Conv1d):
                    # LFM2's short convolutions, 3 taps: wide, so the tokens before
                    # each one (a request's carried state) change its output
                    values = 0.5 * torch.randn(param.shape, generator=gen)
                elif param_name == "weight" and kind.endswith(("RMSNorm", "LayerNorm",
                                                                "RMSNormGated")):
                    values = 1.0 + 0.1 * torch.randn(param.shape, generator=gen)
                elif kind.endswith(("Experts", "Router", "NaiveMoe")):  # stacked experts
                    # (DeepSeek-V3's "NaiveMoe" in transformers 5.0), MoE router
                    values = torch.randn(param.shape, generator=gen) * spec.init_std
                elif param_name == "sinks":  # gpt-oss: a logit per head, near the scores'
                    values = torch.randn(param.shape, generator=gen)
                elif param_name == "A_log":  # Qwen3.5's linear attention: decays of
                    # exp(-softplus(.) * A) with A ~ 0.14, a memory of ~10 tokens
                    values = -2.0 + 0.5 * torch.randn(param.shape, generator=gen)
                # Qwen3.5's dt_bias; ERNIE 4.5's e_score_correction_bias (a parameter)
                elif param_name in ("dt_bias", "e_score_correction_bias"):
                    values = 0.1 * torch.randn(param.shape, generator=gen)
                elif param_name == "D":  # Mamba-2's skip connection, near its init of 1
                    values = 1.0 + 0.1 * torch.randn(param.shape, generator=gen)
                else:
                    raise RuntimeError(
                        f"don't know how to initialise {module_name}.{param_name} ({kind})"
                    )
                param.copy_(values)
        for name, buffer in model.named_buffers():
            # DeepSeek-V3's and LFM2-MoE's choice offsets
            if name.endswith(("e_score_correction_bias", "expert_bias")):
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=gen))


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Hide the "Writing model shards" progress bar; restore the caller's setting after."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def make_model(out_dir: str | os.PathLike[str], spec: ModelSpec = ModelSpec()) -> pathlib.Path:
    """Write a complete Hugging Face model directory for ``spec`` to ``out_dir``.

    Contents: config.json (LlamaConfig / Qwen2Config / Qwen3Config), weights as safetensors
    (sharded with model.safetensors.index.json when ``spec.max_shard_size`` is set),
    generation_config.json (eos [0, 2], no bos, no sampling defaults, so engines fall back
    to their own), and tokenizer files with a ChatML chat template. The same spec always
    gives bit-identical tensors. Returns ``out_dir`` as a Path.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(spec.vocab_size)
    config = _build_config(spec)

    # fork_rng: building the model consumes (and we seed) the global RNG; the caller's
    # RNG state must not change because they asked for a test model.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _reinit_weights(model, spec)
    model.to(getattr(torch, spec.dtype))
    model.config.dtype = spec.dtype
    model.eval()
    model.generation_config = GenerationConfig(
        bos_token_id=None,
        eos_token_id=list(EOS_TOKEN_IDS),
        pad_token_id=ENDOFTEXT_ID,
    )

    save_kwargs: dict[str, Any] = {}
    if spec.max_shard_size is not None:
        save_kwargs["max_shard_size"] = spec.max_shard_size
    with _quiet_transformers():
        model.save_pretrained(out, **save_kwargs)

    # PreTrainedTokenizerFast is an alias of transformers 5's TokenizersBackend.
    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=SPECIAL_TOKENS[ENDOFTEXT_ID],
        pad_token=SPECIAL_TOKENS[ENDOFTEXT_ID],
        bos_token=None,
        model_max_length=spec.max_position_embeddings,
        chat_template=CHAT_TEMPLATE,
    )
    # add_bos_token / add_eos_token are left at their default, False: passing them would
    # make transformers install a (no-op) TemplateProcessing post-processor in
    # tokenizer.json, and they are not written to tokenizer_config.json either way.
    hf_tokenizer.save_pretrained(out)
    return out


# --------------------------------------------------------------------------- demo model


def _cache_root() -> pathlib.Path:
    """``$PAGELLM_CACHE_DIR`` if set, else ``~/.cache/pagellm``."""
    env = os.environ.get("PAGELLM_CACHE_DIR")
    return pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "pagellm"


def demo_model_dir() -> pathlib.Path:
    """The built-in demo model's directory, built on first use and reused afterwards.

    The model is built in a temporary sibling directory and renamed into place, so a crash
    or two concurrent builders never leave a half-written model under the final name: the
    directory either does not exist or is complete.
    """
    root = _cache_root()
    final = root / DEMO_VERSION
    if (final / "config.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{DEMO_VERSION}.tmp-", dir=root))
    try:
        make_model(tmp, DEMO_SPEC)
        try:
            os.replace(tmp, final)
        except OSError:
            if (final / "config.json").is_file():
                return final  # another builder won the race; ours is removed below
            if not final.exists():
                raise
            # Something that is not one of our builds sits there (renames are atomic, so it
            # cannot be a half-written build of ours): replace it.
            shutil.rmtree(final)
            os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def resolve_model(args: EngineArgs) -> EngineArgs:
    """`model="demo"` names the built-in random-weight model (built once into a cache
    dir); any other model is a directory and passes through."""
    return args.replace(model=str(demo_model_dir())) if args.model == "demo" else args
