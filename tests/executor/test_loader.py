"""executor.loader / executor.config / DecoderForCausalLM.load_weights.

The judge of every loaded parameter is the checkpoint itself, read here with
safetensors.torch.load_file and mapped to our merged layout by hand; the judge of the
forward pass is transformers' AutoModelForCausalLM on the same directory.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import MODEL_SPECS
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from pagellm.demo.model import ModelSpec, make_model
from pagellm.executor.model.attention import AttentionMetadata, TorchAttention
from pagellm.executor.model.config import ModelConfig, resolve_model_config
from pagellm.executor.model.decoder import DecoderForCausalLM
from pagellm.executor.model.loader import load_model
from pagellm.protocol.engine_args import EngineArgs

CPU = torch.device("cpu")
SUPPORTED = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")

# Tiny models (vocab 1024: the tokenizer conftest's MODEL_SPECS train is reused).
SPECS: dict[str, ModelSpec] = {
    "llama": ModelSpec(arch="llama", seed=11),  # untied, GQA 4/2
    "llama-tied": ModelSpec(arch="llama", tie_word_embeddings=True, seed=12),
    "qwen2": ModelSpec(arch="qwen2", num_kv_heads=1, seed=13),  # tied, qkv biases
    "qwen2-untied": ModelSpec(arch="qwen2", tie_word_embeddings=False, seed=14),
    "qwen3": ModelSpec(arch="qwen3", head_dim=32, seed=15),  # tied, q/k norm, head_dim != 16
}


Built = Callable[[ModelSpec], Path]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    """A model directory per spec, built once per module: tests must not modify it
    (those that do work on `_copy`)."""
    root = tmp_path_factory.mktemp("loader-models")
    dirs: dict[str, Path] = {}

    def get(spec: ModelSpec) -> Path:
        key = repr(spec)
        if key not in dirs:
            dirs[key] = make_model(root / f"model{len(dirs)}", spec)
        return dirs[key]

    return get


def _copy(model_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(model_dir, tmp_path / model_dir.name))


def _config(model_dir: Path, **kwargs: Any) -> ModelConfig:
    return resolve_model_config(EngineArgs(model=str(model_dir), device="cpu", **kwargs))


def _load(model_dir: Path, **kwargs: Any) -> DecoderForCausalLM:
    return load_model(_config(model_dir, **kwargs), CPU)


def _checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        # Copies: older safetensors map the file, and tests rewrite it afterwards.
        tensors.update({k: v.clone() for k, v in load_file(file).items()})
    return tensors


def _expected_params(ckpt: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our parameter name -> the tensor it must hold: q/k/v and gate/up concatenated in
    that order along dim 0, everything else under its checkpoint name."""
    expected: dict[str, torch.Tensor] = {}
    merged = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    for name, tensor in ckpt.items():
        parts = re.fullmatch(r"(.*)\.(\w+_proj)\.(weight|bias)", name)
        target = next((m for m, srcs in merged.items() if parts and parts[2] in srcs), None)
        if target is None:
            expected[name] = tensor
            continue
        prefix, kind = parts[1], parts[3]
        key = f"{prefix}.{target}.{kind}"
        if key not in expected:
            expected[key] = torch.cat([ckpt[f"{prefix}.{src}.{kind}"] for src in merged[target]])
    return expected


def _rewrite_single_file(model_dir: Path, edit: Callable[[dict[str, torch.Tensor]], None]
                         ) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _edit_config_json(model_dir: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    path = model_dir / "config.json"
    raw = json.loads(path.read_text())
    edit(raw)
    path.write_text(json.dumps(raw))


# --------------------------------------------------------------------------- correct loads


@pytest.mark.parametrize("name", list(SPECS))
def test_every_parameter_equals_its_checkpoint_tensor(built: Built, name: str) -> None:
    spec = SPECS[name]
    model_dir = built(spec)
    ckpt = _checkpoint(model_dir)
    if spec.arch == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in ckpt
    if spec.arch == "qwen3":
        assert "model.layers.1.self_attn.k_norm.weight" in ckpt
    assert ("lm_head.weight" in ckpt) != spec.effective_tie_word_embeddings

    model = _load(model_dir)

    params = dict(model.named_parameters())
    expected = _expected_params(ckpt)
    assert set(params) == set(expected)
    for param_name, tensor in expected.items():
        assert params[param_name].dtype == torch.float32, param_name
        assert torch.equal(params[param_name], tensor), param_name


def test_a_bf16_model_is_never_materialized_in_fp32(built: Built, monkeypatch) -> None:
    """Weights are materialized in the model's dtype: built on the meta device in
    fp32, materialized and only then cast, a bf16 model would briefly need twice its
    memory (one that fits in bf16 could fail to load). The loader materializes through
    `host_memory.empty` (2 MB pages on the CPU): every tensor it makes must be bf16,
    covering every parameter."""
    from pagellm.executor.model import host_memory

    made: list[tuple[torch.dtype, int]] = []
    real = host_memory.empty

    def recording(shape, dtype, device="cpu"):  # type: ignore[no-untyped-def]
        out = real(shape, dtype, device)
        made.append((out.dtype, out.numel()))
        return out

    monkeypatch.setattr(host_memory, "empty", recording)
    model_dir = built(SPECS[next(iter(SPECS))])
    args = EngineArgs(model=str(model_dir), dtype="bfloat16", load_format="dummy")
    model = load_model(resolve_model_config(args), torch.device("cpu"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {dtype for dtype, _ in made} == {torch.bfloat16}
    assert sum(n for _, n in made) >= sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", list(SPECS))
def test_compute_logits_uses_lm_head_or_tied_embeddings(built: Built, name: str) -> None:
    spec = SPECS[name]
    model_dir = built(spec)
    ckpt = _checkpoint(model_dir)
    model = _load(model_dir)
    hidden = torch.randn(3, spec.hidden_size, generator=torch.Generator().manual_seed(0))

    logits = model.compute_logits(hidden)

    via_embed = hidden @ ckpt["model.embed_tokens.weight"].T
    if spec.effective_tie_word_embeddings:
        assert model.lm_head is None
        torch.testing.assert_close(logits, via_embed, rtol=1e-6, atol=1e-6)
    else:
        torch.testing.assert_close(logits, hidden @ ckpt["lm_head.weight"].T, rtol=1e-6,
                                   atol=1e-6)
        assert not torch.allclose(logits, via_embed)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_sharded_and_single_file_checkpoints_load_identically(built: Built, arch: str) -> None:
    spec = ModelSpec(arch=arch, head_dim=32 if arch == "qwen3" else None, seed=21)
    single = built(spec)
    sharded = built(dataclasses.replace(spec, max_shard_size="100KB"))
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    assert not (single / "model.safetensors.index.json").exists()

    from_single, from_shards = _load(single), _load(sharded)

    single_params = dict(from_single.named_parameters())
    shard_params = dict(from_shards.named_parameters())
    assert set(single_params) == set(shard_params)
    for name, param in single_params.items():
        assert torch.equal(param, shard_params[name]), name
    expected = _expected_params(_checkpoint(sharded))
    for name, param in shard_params.items():
        assert torch.equal(param, expected[name]), name


# --------------------------------------------------------------------------- bad checkpoints

PLAIN_KEYS = ["model.norm.weight", "model.layers.1.mlp.down_proj.weight",
              "model.layers.0.input_layernorm.weight", "lm_head.weight"]
MERGED_KEYS = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.v_proj.weight",
               "model.layers.1.mlp.up_proj.weight"]


@pytest.mark.parametrize("key", PLAIN_KEYS)
def test_missing_tensor_raises_naming_it(built: Built, tmp_path: Path, key: str) -> None:
    model_dir = _copy(built(SPECS["llama"]), tmp_path)
    _rewrite_single_file(model_dir, lambda t: t.pop(key))
    config = _config(model_dir)
    with pytest.raises(ValueError, match=re.escape(key)):
        load_model(config, CPU)


@pytest.mark.parametrize("key", [*MERGED_KEYS, "model.layers.0.self_attn.k_proj.bias"])
def test_missing_merged_tensor_raises_naming_its_checkpoint_key(
        built: Built, tmp_path: Path, key: str) -> None:
    """q/k/v and gate/up are merged in our model; the error must still name the tensor
    as the checkpoint spells it, not our internal "...qkv_proj.weight:q"."""
    model_dir = _copy(built(SPECS["qwen2"]), tmp_path)
    _rewrite_single_file(model_dir, lambda t: t.pop(key))
    config = _config(model_dir)
    with pytest.raises(ValueError, match=re.escape(key)):
        load_model(config, CPU)


@pytest.mark.parametrize("key", ["model.layers.0.self_attn.extra_proj.weight",
                                 "model.layers.2.mlp.down_proj.weight",  # layer 2 of 2
                                 "model.visual.weight"])
def test_unknown_tensor_raises_naming_it(built: Built, tmp_path: Path, key: str) -> None:
    model_dir = _copy(built(SPECS["llama"]), tmp_path)
    _rewrite_single_file(model_dir, lambda t: t.update({key: torch.zeros(4, 4)}))
    config = _config(model_dir)
    with pytest.raises(ValueError, match=re.escape(key)):
        load_model(config, CPU)


def test_tied_checkpoint_carrying_an_lm_head_copy_loads(built: Built, tmp_path: Path) -> None:
    model_dir = _copy(built(SPECS["qwen3"]), tmp_path)
    ckpt = _checkpoint(model_dir)
    _rewrite_single_file(model_dir, lambda t: t.update(
        {"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    model = _load(model_dir)
    assert model.lm_head is None
    assert torch.equal(model.model.embed_tokens.weight, ckpt["model.embed_tokens.weight"])


@pytest.mark.parametrize("key", ["model.norm.weight", "model.embed_tokens.weight"])
def test_shape_mismatch_raises_naming_the_tensor(built: Built, tmp_path: Path, key: str) -> None:
    model_dir = _copy(built(SPECS["llama"]), tmp_path)
    _rewrite_single_file(model_dir, lambda t: t.update(
        {key: torch.zeros(t[key].shape[0] + 1, *t[key].shape[1:])}))
    config = _config(model_dir)
    with pytest.raises(ValueError, match=re.escape(key)):
        load_model(config, CPU)


@pytest.mark.parametrize("key", MERGED_KEYS)
def test_shape_mismatch_in_merged_tensor_raises_naming_its_checkpoint_key(
        built: Built, tmp_path: Path, key: str) -> None:
    model_dir = _copy(built(SPECS["llama"]), tmp_path)
    _rewrite_single_file(model_dir, lambda t: t.update({key: t[key][1:].clone()}))
    config = _config(model_dir)
    with pytest.raises(ValueError, match=re.escape(key)):
        load_model(config, CPU)


def test_index_naming_a_missing_shard_raises(built: Built, tmp_path: Path) -> None:
    model_dir = _copy(built(ModelSpec(max_shard_size="100KB", seed=31)), tmp_path)
    shards = sorted(model_dir.glob("model-*.safetensors"))
    assert len(shards) > 2
    shards[1].unlink()
    config = _config(model_dir)
    with pytest.raises(FileNotFoundError, match=re.escape(shards[1].name)):
        load_model(config, CPU)


@pytest.mark.parametrize("keep", [
    lambda size: size // 2,  # an interrupted download: the header's JSON cut short
    lambda size: 4,  # shorter than the header's length prefix
], ids=["half", "4-bytes"])
def test_a_truncated_shard_raises_naming_its_file_and_the_reason(
        built: Built, tmp_path: Path, keep: Callable[[int], int]) -> None:
    """Issue 37: a truncated file failed with "Error while deserializing header:
    incomplete metadata", naming no file (of however many shards). The reason is the
    library's own words, which differ between safetensors releases ("incomplete metadata"
    in 0.8, "MetadataIncompleteBuffer" at our floor): the message must carry them whole."""
    model_dir = _copy(built(ModelSpec(max_shard_size="100KB", seed=31)), tmp_path)
    shard = sorted(model_dir.glob("model-*.safetensors"))[1]
    with open(shard, "r+b") as f:
        f.truncate(keep(shard.stat().st_size))
    config = _config(model_dir)
    with pytest.raises(ValueError, match=re.escape(str(shard))) as raised:
        load_model(config, CPU)
    cause = raised.value.__cause__
    assert cause is not None and "header" in str(cause).lower()
    assert str(cause) in str(raised.value)


def test_directory_without_weights_raises_pointing_at_dummy(built: Built, tmp_path: Path) -> None:
    model_dir = _copy(built(SPECS["llama"]), tmp_path)
    (model_dir / "model.safetensors").unlink()
    config = _config(model_dir)  # config.json alone is enough to resolve
    with pytest.raises(FileNotFoundError, match="load_format='dummy'"):
        load_model(config, CPU)


# --------------------------------------------------------------------------- resolve_model_config


def test_missing_model_directory_raises_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        _config(missing)


def test_directory_without_config_json_raises_naming_it(tmp_path: Path) -> None:
    model_dir = tmp_path / "empty-model"
    model_dir.mkdir()
    with pytest.raises(FileNotFoundError, match=re.escape(str(model_dir))) as info:
        _config(model_dir)
    assert "config.json" in str(info.value)


def test_unsupported_architecture_raises_listing_supported(built: Built, tmp_path: Path) -> None:
    model_dir = _copy(built(SPECS["llama"]), tmp_path)
    _edit_config_json(model_dir, lambda raw: raw.update(architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as info:
        _config(model_dir)
    for arch in SUPPORTED:
        assert arch in str(info.value)


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_config_without_architectures_falls_back_to_model_type(
        built: Built, tmp_path: Path, name: str) -> None:
    """Configs written by `XConfig().save_pretrained()` carry no "architectures"; the
    model_type ("llama", "qwen2", "qwen3") still identifies the family."""
    model_dir = _copy(built(SPECS[name]), tmp_path)
    _edit_config_json(model_dir, lambda raw: raw.pop("architectures"))

    model = _load(model_dir)

    expected = _expected_params(_checkpoint(model_dir))
    params = dict(model.named_parameters())
    assert set(params) == set(expected)  # qwen2 biases, qwen3 q/k norms included
    for param_name, tensor in expected.items():
        assert torch.equal(params[param_name], tensor), param_name


def test_max_model_len_is_checked_against_max_position_embeddings(built: Built) -> None:
    model_dir = built(ModelSpec(max_position_embeddings=512, seed=32))
    assert _config(model_dir).max_model_len == 512
    assert _config(model_dir, max_model_len=512).max_model_len == 512
    assert _config(model_dir, max_model_len=100).max_model_len == 100
    with pytest.raises(ValueError, match="max_model_len=513") as info:
        _config(model_dir, max_model_len=513)
    assert "512" in str(info.value)


# --------------------------------------------------------------------------- dtype


@pytest.mark.parametrize("saved", ["float32", "float16", "bfloat16"])
def test_auto_dtype_takes_the_checkpoint_dtype(built: Built, saved: str) -> None:
    model_dir = built(ModelSpec(arch="qwen2", dtype=saved, seed=33))
    want = getattr(torch, saved)
    ckpt = _checkpoint(model_dir)
    assert all(t.dtype == want for t in ckpt.values())

    config = _config(model_dir)  # dtype="auto" is the default
    model = load_model(config, CPU)

    assert config.dtype == want
    expected = _expected_params(ckpt)
    for name, param in model.named_parameters():
        assert param.dtype == want, name
        assert torch.equal(param, expected[name]), name


@pytest.mark.parametrize(("saved", "asked"), [("float32", "bfloat16"), ("float32", "float16"),
                                              ("bfloat16", "float32")])
def test_explicit_dtype_overrides_the_checkpoint(built: Built, saved: str, asked: str) -> None:
    model_dir = built(ModelSpec(arch="qwen3", head_dim=32, dtype=saved, seed=34))
    want = getattr(torch, asked)
    expected = _expected_params(_checkpoint(model_dir))

    config = _config(model_dir, dtype=asked)
    model = load_model(config, CPU)

    assert config.dtype == want
    for name, param in model.named_parameters():
        assert param.dtype == want, name
        assert torch.equal(param, expected[name].to(want)), name


def test_rope_tables_stay_fp32_and_exact_in_a_bf16_model(built: Built) -> None:
    """The loader casts the whole module to bf16; the RoPE tables must be recomputed in
    fp32 afterwards, equal to transformers' cos/sin."""
    model_dir = built(ModelSpec(
        dtype="bfloat16", max_position_embeddings=1024, seed=35,
        rope_scaling={"rope_type": "yarn", "factor": 4.0,
                      "original_max_position_embeddings": 256}))
    config = _config(model_dir)
    model = load_model(config, CPU)
    rotary = model.model.rotary_emb
    assert rotary.cos_cache.dtype == torch.float32

    hf_rotary = LlamaRotaryEmbedding(config.hf_config)
    positions = torch.arange(1024)[None]
    cos, sin = hf_rotary(torch.zeros(1, dtype=torch.float32), positions)
    assert hf_rotary.attention_scaling != 1.0
    assert torch.equal(rotary.cos_cache, cos[0])
    assert torch.equal(rotary.sin_cache, sin[0])


# --------------------------------------------------------------------------- dummy weights


def _dummy(model_dir: Path, seed: int, **kwargs: Any) -> DecoderForCausalLM:
    return _load(model_dir, load_format="dummy", seed=seed, **kwargs)


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_dummy_weights_need_no_safetensors(built: Built, tmp_path: Path, name: str) -> None:
    model_dir = _copy(built(SPECS[name]), tmp_path)
    shapes = {n: t.shape for n, t in _expected_params(_checkpoint(model_dir)).items()}
    for file in model_dir.glob("*.safetensors"):
        file.unlink()

    model = _dummy(model_dir, seed=0)

    params = dict(model.named_parameters())
    assert {n: p.shape for n, p in params.items()} == shapes
    for param_name, param in params.items():
        assert param.dtype == torch.float32, param_name
        assert bool(torch.isfinite(param).all()), param_name
        if param_name.endswith("norm.weight"):
            assert bool((param == 1).all()), param_name
        elif param_name.endswith(".bias"):
            assert bool((param == 0).all()), param_name
        elif param.numel() >= 4096:  # N(0, 0.02) per the loader's docstring
            assert 0.015 < param.std().item() < 0.025, param_name
            assert abs(param.mean().item()) < 0.005, param_name


def test_dummy_weights_are_seeded(built: Built, tmp_path: Path) -> None:
    model_dir = _copy(built(SPECS["qwen2"]), tmp_path)
    (model_dir / "model.safetensors").unlink()

    first, again, other = (_dummy(model_dir, seed=s) for s in (0, 0, 1))

    again_params, other_params = dict(again.named_parameters()), dict(other.named_parameters())
    for param_name, param in first.named_parameters():
        assert torch.equal(param, again_params[param_name]), param_name
        if not param_name.endswith(("norm.weight", ".bias")):
            assert not torch.equal(param, other_params[param_name]), param_name


def test_dummy_weights_are_drawn_a_chunk_at_a_time(built: Built, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The fp32 draws stay within DUMMY_CHUNK elements, however large a parameter: a
    whole fp32 copy of a big embedding (vocab_size 20M: 5 GB) on top of the weights
    took the load's peak to 1.5x what the memory check had allowed. Every element is
    still drawn (none left at to_empty's garbage) and the parameters differ chunk to
    chunk (the generator moves on)."""
    from torch.overrides import TorchFunctionMode

    import pagellm.executor.model.loader as loader

    model_dir = _copy(built(SPECS["llama"]), tmp_path)
    (model_dir / "model.safetensors").unlink()
    monkeypatch.setattr(loader, "DUMMY_CHUNK", 1000)
    drawn: list[int] = []

    class Draws(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            if func is torch.Tensor.normal_ and out.dtype == torch.float32:  # a draw
                drawn.append(out.numel())
            return out

    with Draws():
        model = _dummy(model_dir, seed=0)
    random = {n: p for n, p in model.named_parameters()
              if not n.endswith(("norm.weight", ".bias"))}
    assert max(p.numel() for p in random.values()) > 8 * 1000  # several chunks each
    assert max(drawn) <= 1000
    assert sum(drawn) == sum(p.numel() for p in random.values())
    embed = model.model.embed_tokens.weight.view(-1)
    assert not torch.equal(embed[:1000], embed[1000:2000])
    for param_name, param in random.items():
        assert 0.015 < param.std().item() < 0.025, param_name


def test_dummy_weights_take_the_asked_dtype(built: Built, tmp_path: Path) -> None:
    model_dir = _copy(built(SPECS["qwen3"]), tmp_path)
    (model_dir / "model.safetensors").unlink()
    model = _dummy(model_dir, seed=0, dtype="bfloat16")
    fp32 = dict(_dummy(model_dir, seed=0).named_parameters())
    for param_name, param in model.named_parameters():
        assert param.dtype == torch.bfloat16, param_name
        assert torch.equal(param, fp32[param_name].to(torch.bfloat16)), param_name


# --------------------------------------------------------------------------- end to end

BLOCK_SIZE = 16


def _forward_paged(model: DecoderForCausalLM, prompt: list[int],
                   steps: list[tuple[int, int]]) -> torch.Tensor:
    """Run `prompt` through the model in `steps` ([start, end) slices: chunks of a prompt,
    then decodes) on a paged cache with a shuffled block table; return the logits of
    every position [len(prompt), vocab]. The cache is zeroed, as the model runner does
    (tests/kernels/test_kernels_reference.py checks that unwritten slots are never read)."""
    spec = model.spec
    num_blocks = math.ceil(len(prompt) / BLOCK_SIZE) + 3
    gen = torch.Generator().manual_seed(0)
    table = torch.randperm(num_blocks, generator=gen).to(torch.int32)  # padded with spares
    kv_caches = [torch.zeros(2, num_blocks, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim)
                 for _ in range(spec.num_layers)]
    logits = []
    for start, end in steps:
        positions = torch.arange(start, end)
        slots = table[positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE
        meta = AttentionMetadata(
            slot_mapping=slots, block_tables=table[None],
            query_start_loc=torch.tensor([0, end - start], dtype=torch.int32),
            seq_lens=torch.tensor([end], dtype=torch.int32),
            query_start_loc_cpu=np.array([0, end - start]), seq_lens_cpu=np.array([end]),
            max_query_len=end - start, backend=TorchAttention(BLOCK_SIZE))
        meta.backend.prepare(meta)
        with torch.inference_mode():
            hidden = model(torch.tensor(prompt[start:end]), positions, meta, kv_caches)
            logits.append(model.compute_logits(hidden))
    return torch.cat(logits)


@pytest.mark.parametrize("name", list(MODEL_SPECS))
def test_logits_match_transformers_at_every_position(model_dirs: dict[str, Path],
                                                     name: str) -> None:
    model_dir = model_dirs[name]
    vocab = MODEL_SPECS[name].vocab_size
    prompt = torch.randint(0, vocab, (41,), generator=torch.Generator().manual_seed(7)).tolist()
    # A chunk ending mid-block, a chunk ending exactly on a block boundary, then decodes.
    steps = [(0, 21), (21, 32), (32, 39), (39, 40), (40, 41)]

    ours = _forward_paged(_load(model_dir, dtype="float32"), prompt, steps)

    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = hf_model(torch.tensor([prompt])).logits[0]
    assert ours.shape == reference.shape == (len(prompt), vocab)
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-4)


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_attention_bias_on_all_four_projections_matches_transformers(
        tmp_path: Path, model_type: str) -> None:
    """Llama and Qwen3 configs with attention_bias=True put biases on q, k, v and o."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    config_cls, model_cls = ((LlamaConfig, LlamaForCausalLM) if model_type == "llama"
                             else (Qwen3Config, Qwen3ForCausalLM))
    config = config_cls(vocab_size=300, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=8, max_position_embeddings=128, attention_bias=True)
    torch.manual_seed(0)
    hf_model = model_cls(config).eval()
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            param.copy_(torch.randn_like(param) * (0.1 if "bias" in name else 0.2))
    hf_model.save_pretrained(tmp_path)
    assert "model.layers.0.self_attn.o_proj.bias" in _checkpoint(tmp_path)
    prompt = list(range(3, 40))
    ours = _forward_paged(_load(tmp_path, dtype="float32"), prompt, [(0, 20), (20, 37)])
    with torch.no_grad():
        reference = hf_model(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-4)


WAYS_SEEN: set[tuple[str, str, str]] = set()  # (CPU, dtype, way) the cases took
# (intel_mkl, packed_bf16, packed_fp32, avx512)
CPUS = {"amd": (False, False, True, True), "avx2": (False, False, True, False),
        "intel": (True, False, False, True), "intel-amx": (True, True, False, True)}


@pytest.mark.parametrize("cpu", list(CPUS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 48, 300])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("in_features", [40, 2048])
def test_cpu_linear_equals_f_linear_on_every_path(rows: int, bias: bool, in_features: int,
                                                   dtype: torch.dtype, cpu: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """cpu_linear.linear picks W @ x^T (one row padded to two), oneDNN on plain or packed
    weights, or F.linear by CPU, dtype, rows and width: each must compute x W^T + b to
    the dtype's rounding, and non-contiguous x (a view with a row stride) must work.
    Every CPU's rules run here, whatever this CPU is (the choice is a flag; every way
    runs on any x86 CPU)."""
    from pagellm.executor.model import linear as cpu_linear

    if (CPUS[cpu][1] or CPUS[cpu][2]) and cpu_linear.REORDER_WEIGHT is None:
        pytest.skip("this torch has no oneDNN packed weights")
    assert in_features in (40, cpu_linear.SMALL_BATCH_ONEDNN_MIN_IN)  # both sides of it
    monkeypatch.setattr(cpu_linear, "THIS_CPU", cpu_linear.Cpu(*CPUS[cpu]))
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, in_features, generator=gen, dtype=torch.float64)
    b = torch.randn(96, generator=gen, dtype=torch.float64) if bias else None
    wide = torch.randn(rows, 2 * in_features, generator=gen, dtype=torch.float64)
    x = wide[:, :in_features]  # rows 2 * in_features apart
    xs, ws = x.to(dtype), weight.to(dtype)
    bs = None if b is None else b.to(dtype)
    cpu_linear.PACKED_WEIGHTS.pack([ws])  # as the loader does (unused off the PACKED way)
    # The exact answer for the rounded inputs; sums of in_features products of N(0, 1)
    # values, in fp32 (or bf16 accumulated in fp32 and rounded to bf16): a wrong path,
    # transpose, stride or bias is off by O(1).
    expected = torch.nn.functional.linear(xs.double(), ws.double(),
                                          None if bs is None else bs.double())
    y = cpu_linear.linear(xs, ws, bs)
    assert y.shape == (rows, 96) and y.dtype == dtype and y.is_contiguous()
    if dtype == torch.float32:
        rtol = atol = 2.5e-7 * in_features
    else:  # bf16 keeps 8 bits: the result's rounding, the bias add's, |y| ~ sqrt(in)
        rtol, atol = 1e-2, 1e-2 * in_features ** 0.5
    torch.testing.assert_close(y.double(), expected, rtol=rtol, atol=atol)
    way = cpu_linear.choose(rows, in_features, dtype, cpu_linear.THIS_CPU)
    WAYS_SEEN.add((cpu, str(dtype), way.name))


def test_cpu_linear_cases_took_every_way_each_cpu_rule_names() -> None:
    """The cases above (run first: same module, earlier in the file) covered each way
    that each CPU's rules use: W @ x^T, oneDNN (1-4 rows of 2048 features up) and packed
    oneDNN for fp32 off Intel, F.linear and oneDNN for fp32 on Intel; the bf16 GEMV
    (W @ x^T without AVX-512) and F.linear for bf16, packed oneDNN in place of F.linear
    with AMX."""
    from pagellm.executor.model.linear import ONEDNN_LINEAR, REORDER_WEIGHT

    if not WAYS_SEEN:
        pytest.skip("run with the linear cases (-k cpu_linear)")
    fp32, bf16 = str(torch.float32), str(torch.bfloat16)
    many_rows = "ONEDNN" if ONEDNN_LINEAR is not None else "ATEN"  # (torch without it)
    for cpu in ("amd", "avx2"):  # (their cases skip without packing)
        assert {w for c, d, w in WAYS_SEEN if c == cpu and d == fp32} == (
            {"W_XT", "ONEDNN", "PACKED"} if REORDER_WEIGHT else set())
    amx = ("intel-amx",) if REORDER_WEIGHT else ()  # (its cases skip without packing)
    for intel in ("intel", *amx):
        assert {w for c, d, w in WAYS_SEEN if c == intel and d == fp32} == {"ATEN", many_rows}
    for cpu, bf16_ways in (("amd", {"GEMV", "ATEN"}), ("avx2", {"W_XT", "ATEN"}),
                           ("intel", {"GEMV", "ATEN"}),
                           ("intel-amx", {"GEMV", "PACKED"} if REORDER_WEIGHT else set())):
        assert {w for c, d, w in WAYS_SEEN if c == cpu and d == bf16} == bf16_ways


def test_packed_weights_follow_every_write_to_the_weight(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """A packed copy is a cache of its parameter: an in-place write through the
    parameter or a view of it (what load_weights does), a new storage (sleep's .data
    swap) and `drop_packed` (for writes no version counter sees: a collective's receive)
    must each make the next GEMM use the new values, and a collected weight must take
    its copy with it."""
    import gc

    from pagellm.executor.model import linear as cpu_linear

    if cpu_linear.REORDER_WEIGHT is None:
        pytest.skip("this torch has no oneDNN packed weights")
    monkeypatch.setattr(cpu_linear, "THIS_CPU",
                        dataclasses.replace(cpu_linear.THIS_CPU, intel_mkl=True, packed_bf16=True))
    packs = cpu_linear.PACKED_WEIGHTS
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 64, generator=gen).bfloat16()  # 8 rows: the PACKED way

    def check(weight: torch.Tensor) -> None:
        expected = torch.nn.functional.linear(x.double(), weight.detach().double())
        torch.testing.assert_close(cpu_linear.linear(x, weight).double(), expected,
                                   rtol=1e-2, atol=1e-1)

    weight = torch.nn.Parameter(torch.randn(32, 64, generator=gen).bfloat16(),
                                requires_grad=False)
    assert packs.get(weight) is None  # not registered: F.linear's way
    check(weight)
    before = len(packs)
    packs.pack([weight])  # as the loader does
    assert len(packs) == before + 1
    check(weight)
    with torch.no_grad():  # load_weights: a copy into a view (a fused q/k/v slice)
        weight[8:16].copy_(torch.randn(8, 64, generator=gen))
    check(weight)
    weight.data = torch.randn(32, 64, generator=gen).bfloat16()  # sleep / wake's swap
    check(weight)
    weight.data.mul_(-1)  # no version counter sees this ...
    cpu_linear.drop_packed()  # ... the worker drops every copy after such writes
    assert len(packs) == 0
    check(weight)
    del weight
    gc.collect()
    assert len(packs) == 0


def test_an_int8_copy_serves_a_registered_weight_and_follows_its_writes():
    """INT_WEIGHTS (the CPU's LM head of an int4/int8 model): `linear` computes a
    registered weight through the int kernel on its int8 copy, at any number of rows,
    and a write to the weight makes the next call quantize it again."""
    from pagellm.executor.model import linear as cpu_linear
    from pagellm.kernels import cpu_int_gemm
    from pagellm.kernels.quant import quantize

    gen = torch.Generator().manual_seed(1)
    weight = torch.nn.Parameter(torch.randn(40, 128, generator=gen), requires_grad=False)

    def check(rows: int) -> None:
        x = torch.randn(rows, 128, generator=gen)
        int8 = cpu_int_gemm.pack(quantize(weight.detach(), 8, 128, torch.float32))
        expected = cpu_int_gemm.reference_linear(x, int8)
        got = cpu_linear.linear(x, weight)
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
        assert (torch.nn.functional.linear(x, weight) - got).abs().max() > 1e-4  # not fp32

    cpu_linear.INT_WEIGHTS.pack([weight])
    try:
        check(1)
        check(9)
        with torch.no_grad():
            weight[3:20].copy_(torch.randn(17, 128, generator=gen))
        check(1)
    finally:
        cpu_linear.drop_packed()
    assert len(cpu_linear.INT_WEIGHTS) == 0


# ------------------------------------------------------------ refused before allocating


@pytest.fixture
def no_materializing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if the loader materializes the model (the refusal must come first)."""
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the model was materialized before the refusal")

    monkeypatch.setattr(torch.nn.Module, "to_empty", refuse)


def test_dummy_model_larger_than_available_memory_is_refused_naming_the_fields(
        built: Built, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        no_materializing: None) -> None:
    from pagellm.executor.model import loader

    model_dir = _copy(built(SPECS["llama"]), tmp_path)
    monkeypatch.setattr(loader, "available_memory", lambda device: 10**6)
    with pytest.raises(ValueError, match="available on cpu") as info:
        _dummy(model_dir, seed=1)
    for field in ("vocab_size=1024", "hidden_size=", "num_hidden_layers=2",
                  "intermediate_size="):
        assert field in str(info.value)


def test_weights_are_packed_only_where_their_copies_fit(built: Built, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    """Where bf16 GEMMs run on packed copies, the loader packs a model's linear weights
    (and the LM head's) only if weights and copies take at most half of this worker's
    share of the memory available; a model too big for that still loads, on its plain
    weights."""
    from pagellm.executor.model import linear as cpu_linear
    from pagellm.executor.model import loader

    if cpu_linear.REORDER_WEIGHT is None:
        pytest.skip("this torch has no oneDNN packed weights")
    model_dir = _copy(built(SPECS["llama"]), tmp_path)
    config = _config(model_dir, load_format="dummy", dtype="bfloat16")
    copies = sum(w.numel() * 2 for w in loader._meta_model(config, None).linear_weights())
    both = loader.weight_bytes(config) + copies
    monkeypatch.setattr(cpu_linear, "THIS_CPU",
                        dataclasses.replace(cpu_linear.THIS_CPU, intel_mkl=False, packed_bf16=True))
    monkeypatch.setattr(loader, "available_memory", lambda device: 2 * both - 1024)
    tight = load_model(config, CPU)
    assert all(cpu_linear.PACKED_WEIGHTS.get(w) is None for w in tight.linear_weights())
    monkeypatch.setattr(loader, "available_memory", lambda device: 2 * both + 1024)
    roomy = load_model(config, CPU)
    assert all(cpu_linear.PACKED_WEIGHTS.get(w) is not None for w in roomy.linear_weights())
    # Two workers on this host (tensor or data parallel) load at once: half each.
    shared = load_model(config, CPU, host_ranks=2)
    assert all(cpu_linear.PACKED_WEIGHTS.get(w) is None for w in shared.linear_weights())
    assert {w.shape[0] for w in roomy.linear_weights()} >= {config.spec.vocab_size}


def test_a_vocabulary_beyond_any_memory_is_refused_naming_it(
        built: Built, tmp_path: Path, no_materializing: None) -> None:
    model_dir = _copy(built(SPECS["llama"]), tmp_path)
    _edit_config_json(model_dir, lambda raw: raw.update(vocab_size=10**9))
    with pytest.raises(ValueError, match="vocab_size=1000000000,"):
        _dummy(model_dir, seed=1)


@pytest.mark.parametrize("name", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_weight_bytes_equal_the_materialized_model(built: Built, name: str,
                                                   dtype: str) -> None:
    from pagellm.executor.model.loader import weight_bytes

    config = _config(built(SPECS[name]), dtype=dtype, max_model_len=300)
    model = load_model(config, CPU)
    actual = sum(t.numel() * t.element_size()
                 for t in (*model.parameters(), *model.buffers()))
    assert weight_bytes(config) == actual


def test_rope_tables_have_max_model_len_rows(built: Built) -> None:
    """Sized by the positions that can occur, not the config's max_position_embeddings;
    the scaling math (yarn, original length 256, max 1024) is unchanged."""
    model_dir = built(ModelSpec(
        max_position_embeddings=1024, seed=36,
        rope_scaling={"rope_type": "yarn", "factor": 4.0,
                      "original_max_position_embeddings": 256}))
    config = _config(model_dir, max_model_len=100)
    rotary = load_model(config, CPU).model.rotary_emb
    assert rotary.cos_cache.shape == rotary.sin_cache.shape == (100, 16)
    cos, sin = LlamaRotaryEmbedding(config.hf_config)(torch.zeros(1), torch.arange(100)[None])
    assert torch.equal(rotary.cos_cache, cos[0]) and torch.equal(rotary.sin_cache, sin[0])


# --------------------------------------------------------------------------- quantize on load

# top-2 of 8 experts of 32 columns (whole tiles of the CPU int kernel's 16 rows)
QUANT_SPECS = {"llama": (SPECS["llama"], "float32"),
               # a bf16 file into an fp32 model, an fp32 file into a bf16 model: each
               # tensor in the model's dtype before it is quantized
               "llama-bf16-file": (ModelSpec(arch="llama", seed=11, dtype="bfloat16"),
                                   "float32"),
               "llama-bf16-model": (SPECS["llama"], "bfloat16"),
               "qwen3_moe": (ModelSpec(arch="qwen3_moe", seed=16, config_extra=dict(
                   num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)),
                   "float32")}


def _packed_tensors(model: DecoderForCausalLM) -> dict[str, torch.Tensor]:
    """Every packed form's tensors, by their module's name and field."""
    out: dict[str, torch.Tensor] = {}
    packed = {id(m) for m in model.quantized.values()}
    for name, module in model.named_modules():
        quant = getattr(module, "quant", None)
        if quant is not None and id(module) in packed:
            for f in dataclasses.fields(quant):
                value = getattr(quant, f.name)
                if isinstance(value, torch.Tensor):
                    out[f"{name}.{f.name}"] = value
    return out


@pytest.mark.parametrize("name", list(QUANT_SPECS))
@pytest.mark.parametrize("quantization", ["int4", "int8"])
@pytest.mark.parametrize("triton", [False, True], ids=["cpu-kernel", "triton-layout"])
def test_quantize_on_load_packs_each_tensor_as_it_arrives_as_quantizing_after_would(
        built: Built, name: str, quantization: str, triton: bool) -> None:
    """quantization= quantizes while loading (each checkpoint tensor into its rows of
    the packed forms laid out on the meta model): every packed tensor equals what
    quantizing the whole loaded full-precision model gives, for the projections (q, k
    and v arriving apart into one qkv_proj) and the experts (one per tensor), in the
    CPU int kernel's layout and the Triton kernels'."""
    from pagellm.executor.model.loader import quantize_on_load

    spec, dtype = QUANT_SPECS[name]
    model_dir = built(spec)
    streamed = load_model(_config(model_dir, quantization=quantization, dtype=dtype), CPU,
                          kernels=triton)
    whole = _load(model_dir, dtype=dtype)
    whole.quantized = quantize_on_load(whole, quantization, triton)
    ours, expected = _packed_tensors(streamed), _packed_tensors(whole)
    assert ours.keys() == expected.keys() and any(".experts." in k for k in ours) == (
        name == "qwen3_moe")
    for key, tensor in expected.items():
        assert torch.equal(ours[key], tensor), key
    placeholders = {id(p) for p in streamed.parameters() if p.is_meta}
    assert placeholders == set(streamed.quantized)


def test_a_model_that_fits_only_quantized_loads_with_quantization(
        built: Built, monkeypatch: pytest.MonkeyPatch) -> None:
    """The memory check counts the packed forms: with less memory than the fp32 weights
    take, the fp32 model is refused naming its bytes, the int4 one loads; what it
    allocates (through host_memory.empty) stays below the fp32 weights' bytes: they
    never all exist at once."""
    from pagellm.executor.model import host_memory, loader

    model_dir = built(QUANT_SPECS["qwen3_moe"][0])
    full = loader.weight_bytes(_config(model_dir))
    monkeypatch.setattr(loader, "available_memory", lambda device: int(0.8 * full))
    with pytest.raises(ValueError, match="the model's weights need"):
        _load(model_dir)
    made: list[int] = []
    real = host_memory.empty

    def recording(shape, dtype, device="cpu"):  # type: ignore[no-untyped-def]
        out = real(shape, dtype, device)
        made.append(out.numel() * out.element_size())
        return out

    monkeypatch.setattr(host_memory, "empty", recording)
    model = _load(model_dir, quantization="int4")
    assert model.quantized and sum(made) < 0.8 * full
