"""Tests for pagellm.demo.model: offline tokenizer training and random-weight HF models.

The rest of the suite trusts these models as references (our engine vs transformers on
the same weights), so these tests check what a reference needs: transformers loads them
cleanly, every weight (norms and biases included) is non-default, greedy output is varied,
and building is deterministic.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import time
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagellm.demo import model as demo_model
from pagellm.demo import tokenizer as demo_tokenizer
from pagellm.demo.model import (
    DEMO_SPEC,
    DEMO_VERSION,
    ModelSpec,
    demo_model_dir,
    make_model,
    train_tokenizer,
)

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
QWEN3_HEAD_DIM = 32  # != hidden_size // num_heads (64 // 4 = 16), as in real Qwen3 models

SPECS: dict[str, ModelSpec] = {
    "llama": ModelSpec(arch="llama"),
    "qwen2": ModelSpec(arch="qwen2"),
    "qwen3": ModelSpec(arch="qwen3", head_dim=QWEN3_HEAD_DIM),
}
EXPECTED_TIED = {"llama": False, "qwen2": True, "qwen3": True}


def _load(model_dir: pathlib.Path) -> torch.nn.Module:
    """Load in fp32 and fail on any missing / unexpected / mismatched weight."""
    model, info = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"], info
    assert not info["unexpected_keys"], info
    assert not info.get("mismatched_keys"), info
    return model.eval()


def _weights(model_dir: pathlib.Path) -> dict[str, torch.Tensor]:
    """All tensors of a (possibly sharded) safetensors checkpoint."""
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def _read_json(path: pathlib.Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    """One tiny model per architecture, built once for the module."""
    root = tmp_path_factory.mktemp("demo_models")
    return {arch: make_model(root / arch, spec) for arch, spec in SPECS.items()}


# --------------------------------------------------------------------------- tokenizer


def test_tokenizer_vocab_and_special_ids() -> None:
    tok = train_tokenizer(1024)
    assert tok.get_vocab_size() == 1024
    assert sorted(tok.get_vocab().values()) == list(range(1024))
    assert tok.token_to_id("<|endoftext|>") == 0
    assert tok.token_to_id("<|im_start|>") == 1
    assert tok.token_to_id("<|im_end|>") == 2
    # Special tokens in text map to their ids; plain text gets nothing added.
    assert tok.encode("<|im_start|>user\nhi<|im_end|>").ids[0] == 1
    assert tok.encode("<|im_start|>user\nhi<|im_end|>").ids[-1] == 2
    assert not {0, 1, 2} & set(tok.encode("hello world").ids)


@pytest.mark.parametrize(
    "text",
    [
        "def main() -> None:\n    print('hello, world')  # ASCII\n",
        "héllo wörld ✓ 日本語",
        "Съешь же ещё этих мягких французских булок 🚀🎉",
        "  leading spaces,\ttabs and\r\nnewlines  ",
        "\x00\x7f control bytes",
        "",
    ],
)
def test_tokenizer_round_trips(text: str) -> None:
    tok = train_tokenizer(1024)
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text


def test_tokenizer_merges_multibyte_characters() -> None:
    """The multilingual block gives multi-byte characters their own merged tokens."""
    tok = train_tokenizer(1024)
    assert len(tok.encode("é").ids) == 1  # 2 UTF-8 bytes, one token
    assert len(tok.encode("日本語").ids) < len("日本語".encode())


def test_tokenizer_is_deterministic_and_copied() -> None:
    first = train_tokenizer(1024)
    again = train_tokenizer(1024)
    assert first is not again  # callers may mutate their copy
    fresh = demo_tokenizer._trained_tokenizer_json.__wrapped__(1024)  # bypass the cache
    assert first.to_str() == fresh == again.to_str()


def test_tokenizer_other_sizes() -> None:
    assert train_tokenizer(300).get_vocab_size() == 300
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(299)


# --------------------------------------------------------------------------- spec


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"arch": "gpt2"}, "arch"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"num_layers": -1}, "num_layers"),
        ({"num_heads": 4, "num_kv_heads": 3}, "num_kv_heads"),
        ({"hidden_size": 66, "num_heads": 4}, "hidden_size"),
        ({"head_dim": 0}, "head_dim"),
        ({"arch": "qwen2", "head_dim": 32}, "head_dim"),
        ({"intermediate_size": 0}, "intermediate_size"),
        ({"vocab_size": 299}, "vocab_size"),
        ({"max_position_embeddings": 0}, "max_position_embeddings"),
        ({"dtype": "float64"}, "dtype"),
        ({"init_std": 0.0}, "init_std"),
        ({"rope_scaling": {"factor": 2.0}}, "rope_type"),
    ],
)
def test_spec_validation(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ModelSpec(**kwargs)


def test_arch_error_names_allowed_values() -> None:
    with pytest.raises(ValueError, match="llama, qwen2, qwen3, mistral, qwen3_moe"):
        ModelSpec(arch="jamba")


# --------------------------------------------------------------------------- model dirs


def test_tokenizer_files_and_chat_template(model_dirs: dict[str, pathlib.Path]) -> None:
    model_dir = model_dirs["llama"]
    hf_tok = AutoTokenizer.from_pretrained(model_dir)
    assert len(hf_tok) == 1024
    assert hf_tok.eos_token == "<|endoftext|>" and hf_tok.eos_token_id == 0
    assert hf_tok.pad_token_id == 0
    assert hf_tok.bos_token is None
    raw = train_tokenizer(1024)
    assert hf_tok("hello world")["input_ids"] == raw.encode("hello world").ids

    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "héllo ✓"},
    ]
    expected = (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nhéllo ✓<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    text = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == expected
    no_prompt = hf_tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert no_prompt == expected.removesuffix("<|im_start|>assistant\n")
    ids = hf_tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert list(ids) == raw.encode(expected).ids


@pytest.mark.parametrize("arch", list(SPECS))
def test_config_and_generation_config_files(model_dirs: dict[str, pathlib.Path], arch: str) -> None:
    model_dir = model_dirs[arch]
    gen = _read_json(model_dir / "generation_config.json")
    assert gen["eos_token_id"] == [0, 2]
    assert gen.get("bos_token_id") is None
    for key in ("do_sample", "temperature", "top_p", "top_k"):
        assert key not in gen, key

    config = _read_json(model_dir / "config.json")
    assert config["model_type"] == arch
    assert config["vocab_size"] == 1024
    assert config["tie_word_embeddings"] is EXPECTED_TIED[arch]
    assert config["rope_parameters"]["rope_theta"] == 10000.0
    if arch == "qwen2":
        assert "head_dim" not in config
    if arch == "qwen3":
        assert config["head_dim"] == QWEN3_HEAD_DIM
    assert (model_dir / "model.safetensors").is_file()
    assert (model_dir / "tokenizer.json").is_file()


@pytest.mark.parametrize("arch", list(SPECS))
def test_loads_in_transformers(model_dirs: dict[str, pathlib.Path], arch: str) -> None:
    spec = SPECS[arch]
    model = _load(model_dirs[arch])
    cfg = model.config
    assert cfg.model_type == arch
    assert cfg.hidden_size == spec.hidden_size
    assert cfg.num_hidden_layers == spec.num_layers
    assert cfg.num_attention_heads == spec.num_heads
    assert cfg.num_key_value_heads == spec.num_kv_heads
    assert cfg.vocab_size == spec.vocab_size
    assert cfg.max_position_embeddings == spec.max_position_embeddings
    assert cfg.tie_word_embeddings is EXPECTED_TIED[arch]

    attn = model.model.layers[0].self_attn
    if arch == "qwen2":
        assert attn.q_proj.bias is not None
        assert attn.k_proj.bias.abs().sum() > 0
    else:
        assert attn.q_proj.bias is None
    if arch == "qwen3":
        assert cfg.head_dim == QWEN3_HEAD_DIM
        assert attn.q_proj.out_features == spec.num_heads * QWEN3_HEAD_DIM
        assert not torch.all(attn.q_norm.weight == 1)
        assert not torch.all(attn.k_norm.weight == 1)

    # Norms are perturbed around 1, so a loader that drops them is caught.
    for norm in (model.model.norm, model.model.layers[0].input_layernorm):
        assert not torch.all(norm.weight == 1)
        assert abs(norm.weight.mean().item() - 1.0) < 0.1
    # Linear weights use the wide init_std, not transformers' 0.02.
    std = model.model.layers[0].mlp.up_proj.weight.std().item()
    assert 0.06 < std < 0.1

    saved = _weights(model_dirs[arch])
    if EXPECTED_TIED[arch]:
        assert "lm_head.weight" not in saved
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    else:
        assert "lm_head.weight" in saved
        assert not torch.equal(saved["lm_head.weight"], saved["model.embed_tokens.weight"])


VARIED_PROMPTS = ["def fibonacci(n):", "The capital of France is", "import numpy as np\n",
                  "Hello, my name is"]


@pytest.mark.parametrize("arch", list(SPECS))
def test_greedy_generation_is_varied(model_dirs: dict[str, pathlib.Path], arch: str) -> None:
    """transformers' default init (std 0.02) makes the tied-embedding demo models repeat
    one token after every prompt. Over several prompts, ours must not: one prompt alone
    repeats by chance on some Python versions (the tokenizer, trained on the standard
    library's source, differs between them)."""
    model = _load(model_dirs[arch])
    hf_tok = AutoTokenizer.from_pretrained(model_dirs[arch])
    prompts = hf_tok(VARIED_PROMPTS, return_tensors="pt", padding=True, padding_side="left")
    with torch.no_grad():
        out = model.generate(**prompts, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    new = out[:, prompts["input_ids"].shape[1]:].tolist()
    assert all(len(row) == 16 for row in new)
    assert any(len(set(row)) > 1 for row in new), new


def test_sharded_save_loads_identically(tmp_path: pathlib.Path) -> None:
    spec = ModelSpec(arch="qwen2", seed=3)
    single = make_model(tmp_path / "single", spec)
    sharded = make_model(tmp_path / "sharded", dataclasses.replace(spec, max_shard_size="100KB"))
    shards = sorted(sharded.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1
    assert not (sharded / "model.safetensors").exists()
    index = _read_json(sharded / "model.safetensors.index.json")
    assert set(index["weight_map"].values()) == {p.name for p in shards}

    single_weights, sharded_weights = _weights(single), _weights(sharded)
    assert set(index["weight_map"]) == set(sharded_weights) == set(single_weights)
    ids = torch.tensor([[5, 17, 300, 42, 7]])
    with torch.no_grad():
        logits_single = _load(single)(ids).logits
        logits_sharded = _load(sharded)(ids).logits
    assert torch.equal(logits_single, logits_sharded)


@pytest.mark.parametrize(
    "rope_scaling",
    [
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 512,
        },
        {"rope_type": "linear", "factor": 2.0},
        {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
    ],
)
def test_rope_scaling_survives(tmp_path: pathlib.Path, rope_scaling: dict[str, Any]) -> None:
    spec = ModelSpec(rope_scaling=rope_scaling, rope_theta=500000.0)
    model = _load(make_model(tmp_path / "m", spec))
    params = model.config.rope_parameters
    expected = dict(rope_scaling)
    expected.setdefault("rope_type", expected.pop("type", None))
    for key, value in expected.items():
        assert params[key] == value, key
    assert params["rope_theta"] == 500000.0
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[3, 4, 5]])).logits).all()


def test_same_seed_gives_identical_weights(tmp_path: pathlib.Path) -> None:
    spec = ModelSpec(arch="qwen3", head_dim=QWEN3_HEAD_DIM, seed=7)
    torch.manual_seed(1234)  # the global RNG state must not matter
    first = _weights(make_model(tmp_path / "a", spec))
    torch.manual_seed(4321)
    second = _weights(make_model(tmp_path / "b", spec))
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name
    other = _weights(make_model(tmp_path / "c", dataclasses.replace(spec, seed=8)))
    assert not torch.equal(first["model.norm.weight"], other["model.norm.weight"])


def test_make_model_leaves_global_rng_alone(tmp_path: pathlib.Path) -> None:
    torch.manual_seed(99)
    expected = torch.rand(4)
    torch.manual_seed(99)
    make_model(tmp_path / "m", ModelSpec())
    assert torch.equal(torch.rand(4), expected)


def test_save_dtype(tmp_path: pathlib.Path) -> None:
    """Half-precision weights are the fp32 ones cast, not a different draw."""
    fp32 = _weights(make_model(tmp_path / "fp32", ModelSpec()))
    bf16_dir = make_model(tmp_path / "bf16", ModelSpec(dtype="bfloat16"))
    bf16 = _weights(bf16_dir)
    assert _read_json(bf16_dir / "config.json")["dtype"] == "bfloat16"
    for name, tensor in bf16.items():
        assert tensor.dtype == torch.bfloat16, name
        assert torch.equal(tensor, fp32[name].to(torch.bfloat16)), name


# --------------------------------------------------------------------------- demo model


def test_demo_model_dir_builds_once(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path))
    path = demo_model_dir()
    assert path == tmp_path / DEMO_VERSION
    assert (path / "config.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == [DEMO_VERSION]  # no temp dirs left
    config = _read_json(path / "config.json")
    assert config["hidden_size"] == DEMO_SPEC.hidden_size
    assert config["vocab_size"] == DEMO_SPEC.vocab_size == len(AutoTokenizer.from_pretrained(path))

    def no_rebuild(*args: object, **kwargs: object) -> pathlib.Path:
        raise AssertionError("demo model rebuilt")

    monkeypatch.setattr(demo_model, "make_model", no_rebuild)
    mtime = (path / "config.json").stat().st_mtime_ns
    start = time.perf_counter()
    assert demo_model_dir() == path
    assert time.perf_counter() - start < 0.5
    assert (path / "config.json").stat().st_mtime_ns == mtime


def test_demo_model_dir_failed_build_leaves_nothing(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path))

    def crash(out_dir: os.PathLike[str], spec: ModelSpec) -> pathlib.Path:
        (pathlib.Path(out_dir) / "config.json").write_text("{}")  # half-written
        raise RuntimeError("simulated crash")

    monkeypatch.setattr(demo_model, "make_model", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        demo_model_dir()
    assert list(tmp_path.iterdir()) == []


def test_demo_model_dir_lost_race_keeps_winner(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second builder finishing first: its complete model stays, ours is discarded."""
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path))
    real_make_model = demo_model.make_model
    final = tmp_path / DEMO_VERSION

    def racing(out_dir: os.PathLike[str], spec: ModelSpec) -> pathlib.Path:
        real_make_model(final, spec)  # the other builder wins while we build
        (final / "winner").write_text("1")
        return real_make_model(out_dir, spec)

    monkeypatch.setattr(demo_model, "make_model", racing)
    assert demo_model_dir() == final
    assert (final / "winner").is_file()
    assert [p.name for p in tmp_path.iterdir()] == [DEMO_VERSION]


def test_module_import_is_cheap() -> None:
    """The CLI must not pull in torch / transformers just by importing this module."""
    code = (
        "import sys, pagellm.demo.model\n"
        "heavy = {'torch', 'transformers', 'tokenizers'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=REPO_ROOT)
