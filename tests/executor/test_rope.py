"""executor.models.rope against transformers' own RoPE code, run on real configs.

transformers 5.23 keeps the non-default initialisers in
`transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS` ("linear", "llama3", "yarn", ...);
"default" is not in that dict: each model's rotary class carries it as a static method
(`LlamaRotaryEmbedding.compute_default_rope_parameters`). Both take a config, so the
references below are computed from LlamaConfig / Qwen2Config objects, after
transformers has standardised their `rope_parameters`.

Every comparison here is exact (torch.equal / ==): our code uses the same float32
operations as transformers, so fp32 results must agree bit for bit.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, LlamaConfig, Qwen2Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from pagellm.executor.model.registry import read_spec
from pagellm.executor.model.rope import RopeSpec, RotaryEmbedding, apply_rotary, compute_inv_freq

NUM_HEADS = 4


def _hf_config(rope_parameters: dict[str, Any] | None, head_dim: int, max_position: int,
               arch: str = "llama", **legacy: Any) -> LlamaConfig | Qwen2Config:
    """A real transformers config; it gets a copy (transformers fills the dict in)."""
    common: dict[str, Any] = {
        "hidden_size": NUM_HEADS * head_dim, "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": 2, "intermediate_size": 64, "num_hidden_layers": 1,
        "vocab_size": 300, "max_position_embeddings": max_position, **legacy,
    }
    if rope_parameters is not None:
        common["rope_parameters"] = copy.deepcopy(rope_parameters)
    if arch == "qwen2":  # no head_dim field: derived from hidden_size / num_heads
        return Qwen2Config(**common)
    return LlamaConfig(**common, head_dim=head_dim)


def _hf_inv_freq(config: LlamaConfig | Qwen2Config) -> tuple[torch.Tensor, float]:
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[rope_type](config)


def _ours(rope_parameters: dict[str, Any], head_dim: int, max_position: int
          ) -> tuple[torch.Tensor, float]:
    spec = RopeSpec.from_hf(copy.deepcopy(rope_parameters), None, None)
    return compute_inv_freq(spec, head_dim, max_position)


LLAMA3_8B = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 8192}
YARN_QWEN = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
             "original_max_position_embeddings": 32768}

# id -> (rope_parameters, head_dim, max_position_embeddings, arch)
INV_FREQ_CASES: dict[str, tuple[dict[str, Any], int, int, str]] = {
    "default": ({"rope_type": "default", "rope_theta": 10000.0}, 64, 2048, "llama"),
    "default-int-theta": ({"rope_type": "default", "rope_theta": 1000000}, 128, 32768, "llama"),
    "default-qwen2": ({"rope_type": "default", "rope_theta": 1000000.0}, 64, 32768, "qwen2"),
    "linear": ({"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}, 64, 4096,
               "llama"),
    "linear-int-factor": ({"rope_type": "linear", "rope_theta": 500000.0, "factor": 4}, 128,
                          8192, "llama"),
    "llama3-8b": (LLAMA3_8B, 128, 131072, "llama"),
    "llama3-tiny": ({"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0,
                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 256}, 16, 2048, "llama"),
    "yarn": (YARN_QWEN, 128, 131072, "llama"),
    "yarn-qwen2": (YARN_QWEN, 64, 131072, "qwen2"),
    "yarn-attention-factor": ({**YARN_QWEN, "attention_factor": 0.8}, 128, 131072, "llama"),
    "yarn-mscale-equal": ({**YARN_QWEN, "mscale": 1.0, "mscale_all_dim": 1.0}, 64, 131072,
                          "llama"),
    "yarn-mscale-differ": ({**YARN_QWEN, "factor": 40.0, "mscale": 1.0,
                            "mscale_all_dim": 0.707}, 64, 131072, "llama"),
    "yarn-mscale-only": ({**YARN_QWEN, "mscale": 0.707}, 64, 131072, "llama"),
    "yarn-truncate-false": ({"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                             "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                             "original_max_position_embeddings": 4096}, 64, 131072, "llama"),
    "yarn-truncate-true": ({**YARN_QWEN, "truncate": True}, 64, 131072, "llama"),
    "yarn-betas": ({**YARN_QWEN, "beta_fast": 16, "beta_slow": 2}, 64, 131072, "llama"),
    "yarn-no-original-max": ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}, 64,
                             4096, "llama"),
    "yarn-factor-none": ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": None,
                          "original_max_position_embeddings": 1024}, 64, 4096, "llama"),
}


@pytest.mark.parametrize("case", list(INV_FREQ_CASES))
def test_compute_inv_freq_equals_transformers_exactly(case: str) -> None:
    rope_parameters, head_dim, max_position, arch = INV_FREQ_CASES[case]
    config = _hf_config(rope_parameters, head_dim, max_position, arch)
    hf_inv_freq, hf_scaling = _hf_inv_freq(config)

    inv_freq, scaling = _ours(rope_parameters, head_dim, max_position)

    assert inv_freq.dtype == torch.float32 and inv_freq.shape == (head_dim // 2,)
    assert torch.equal(inv_freq, hf_inv_freq.float()), (inv_freq - hf_inv_freq).abs().max()
    assert scaling == hf_scaling


def test_cases_exercise_what_they_claim() -> None:
    """Guard the table above: the scaled types really change inv_freq / the scaling."""
    default, _ = _ours({"rope_type": "default", "rope_theta": 1000000.0}, 128, 131072)
    for name in ("llama3-8b", "yarn"):
        params, head_dim, max_position, _ = INV_FREQ_CASES[name]
        assert not torch.equal(_ours(params, head_dim, max_position)[0],
                               _ours({**params, "rope_type": "default"}, head_dim,
                                     max_position)[0])
    assert not torch.equal(_ours(YARN_QWEN, 128, 131072)[0], default)
    assert _ours(YARN_QWEN, 128, 131072)[1] != 1.0
    truncated = _ours({**INV_FREQ_CASES["yarn-truncate-false"][0], "truncate": True}, 64,
                      131072)[0]
    assert not torch.equal(truncated, _ours(*INV_FREQ_CASES["yarn-truncate-false"][:3])[0])


def test_llama3_without_original_max_position_falls_back_like_transformers() -> None:
    """transformers uses max_position_embeddings when a llama3 config omits
    original_max_position_embeddings (as it does for yarn); RopeSpec.from_hf accepts such
    a config, so compute_inv_freq must handle it too rather than raise KeyError."""
    params = {k: v for k, v in LLAMA3_8B.items() if k != "original_max_position_embeddings"}
    config = _hf_config(params, 128, 8192)
    hf_inv_freq, hf_scaling = _hf_inv_freq(config)

    inv_freq, scaling = _ours(params, 128, 8192)

    assert torch.equal(inv_freq, hf_inv_freq)
    assert scaling == hf_scaling


# --------------------------------------------------------------------------- RopeSpec.from_hf


def test_from_hf_reads_transformers5_rope_parameters() -> None:
    spec = RopeSpec.from_hf(dict(LLAMA3_8B), None, None)
    assert spec.rope_type == "llama3"
    assert spec.theta == 500000.0
    assert spec.params == {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192}


def test_from_hf_rope_parameters_theta_wins_over_top_level() -> None:
    spec = RopeSpec.from_hf({"rope_type": "default", "rope_theta": 1000000.0}, 10000.0, None)
    assert spec.theta == 1000000.0


def test_from_hf_without_any_rope_settings_is_default_10000() -> None:
    spec = RopeSpec.from_hf(None, None, None)
    assert (spec.rope_type, spec.theta, spec.params) == ("default", 10000.0, {})


def test_from_hf_top_level_theta_only() -> None:
    spec = RopeSpec.from_hf(None, 500000, None)
    assert (spec.rope_type, spec.theta) == ("default", 500000.0)
    assert isinstance(spec.theta, float)


@pytest.mark.parametrize("type_key", ["rope_type", "type"])
@pytest.mark.parametrize("scaling", [
    {"factor": 2.0, "_type": "linear"},
    {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192, "_type": "llama3"},
    {"factor": 4.0, "original_max_position_embeddings": 4096, "_type": "yarn"},
], ids=["linear", "llama3", "yarn"])
def test_from_hf_old_top_level_rope_theta_and_rope_scaling(type_key: str,
                                                           scaling: dict[str, Any]) -> None:
    """Old configs: top-level rope_theta + rope_scaling, possibly with the legacy key
    `type`. The reference is transformers converting the same legacy kwargs."""
    scaling = dict(scaling)
    rope_type = scaling.pop("_type")
    rope_scaling = {type_key: rope_type, **scaling}
    head_dim, max_position, theta = 64, 32768, 250000.0
    config = _hf_config(None, head_dim, max_position, rope_theta=theta,
                        rope_scaling=copy.deepcopy(rope_scaling))
    assert config.rope_parameters["rope_type"] == rope_type  # transformers understood it
    hf_inv_freq, hf_scaling = _hf_inv_freq(config)

    spec = RopeSpec.from_hf(None, theta, rope_scaling)

    assert spec.rope_type == rope_type
    assert spec.theta == theta
    assert "type" not in spec.params and "rope_type" not in spec.params
    inv_freq, scaling_factor = compute_inv_freq(spec, head_dim, max_position)
    assert torch.equal(inv_freq, hf_inv_freq)
    assert scaling_factor == hf_scaling


def test_decoder_spec_reads_a_legacy_config_json(tmp_path: Path) -> None:
    """A Hub-style config.json with top-level rope_theta and rope_scaling {"type": ...},
    loaded through AutoConfig as the engine does."""
    config = _hf_config(None, 64, 131072)
    raw = config.to_dict()
    raw.pop("rope_parameters", None)
    raw.update(rope_theta=1000000.0, architectures=["LlamaForCausalLM"],
               rope_scaling={"type": "yarn", "factor": 4.0,
                             "original_max_position_embeddings": 32768})
    (tmp_path / "config.json").write_text(json.dumps(raw))
    loaded = AutoConfig.from_pretrained(tmp_path)

    spec = read_spec(loaded).rope

    assert (spec.rope_type, spec.theta) == ("yarn", 1000000.0)
    inv_freq, scaling = compute_inv_freq(spec, 64, 131072)
    hf_inv_freq, hf_scaling = _hf_inv_freq(loaded)
    assert torch.equal(inv_freq, hf_inv_freq)
    assert scaling == hf_scaling != 1.0


@pytest.mark.parametrize("rope_type", ["dynamic", "proportional"])
@pytest.mark.parametrize("where", ["rope_parameters", "rope_scaling-type"])
def test_from_hf_rejects_unsupported_types(rope_type: str, where: str) -> None:
    params = {"factor": 2.0, "original_max_position_embeddings": 4096}
    with pytest.raises(ValueError, match=rope_type):
        if where == "rope_parameters":
            RopeSpec.from_hf({"rope_type": rope_type, "rope_theta": 10000.0, **params},
                             None, None)
        else:
            RopeSpec.from_hf(None, 10000.0, {"type": rope_type, **params})


def test_from_hf_rejects_partial_rotary_factor() -> None:
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        RopeSpec.from_hf({"rope_type": "default", "rope_theta": 10000.0,
                          "partial_rotary_factor": 0.5}, None, None)
    spec = RopeSpec.from_hf({"rope_type": "default", "rope_theta": 10000.0,
                             "partial_rotary_factor": 1.0}, None, None)
    assert spec.rope_type == "default"


# --------------------------------------------------------------------------- RotaryEmbedding

ROTARY_CASES: dict[str, dict[str, Any]] = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "llama3": {**LLAMA3_8B, "original_max_position_embeddings": 512},
    "yarn": {**YARN_QWEN, "original_max_position_embeddings": 1024},  # scaling != 1
}


def _hf_rotate(rope_parameters: dict[str, Any], head_dim: int, max_position: int,
               q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """transformers' rotary embedding on our flat [T, H, D] layout: (q, k, cos, sin)."""
    rotary = LlamaRotaryEmbedding(_hf_config(rope_parameters, head_dim, max_position))
    cos, sin = rotary(q, positions[None])  # [1, T, D]
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                      cos, sin)  # [1, H, T, D]
    return q_hf[0].transpose(0, 1), k_hf[0].transpose(0, 1), cos[0], sin[0]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("case", list(ROTARY_CASES))
def test_rotary_embedding_equals_transformers_exactly_fp32(case: str, head_dim: int) -> None:
    rope_parameters, max_position = ROTARY_CASES[case], 4096
    gen = torch.Generator().manual_seed(head_dim)
    positions = torch.cat([torch.tensor([0, 1, max_position - 1]),
                           torch.randint(0, max_position, (45,), generator=gen)])
    q = torch.randn(len(positions), NUM_HEADS, head_dim, generator=gen)
    k = torch.randn(len(positions), 2, head_dim, generator=gen)
    q_hf, k_hf, cos_hf, sin_hf = _hf_rotate(rope_parameters, head_dim, max_position, q, k,
                                            positions)

    rotary = RotaryEmbedding(RopeSpec.from_hf(dict(rope_parameters), None, None), head_dim,
                             max_position)
    cos, sin = rotary.cos_sin(positions, torch.float32)

    assert cos.shape == sin.shape == (len(positions), 1, head_dim)
    half = head_dim // 2  # the sine comes with its first half negated (rotate_half's sign)
    assert torch.equal(cos[:, 0], cos_hf)
    assert torch.equal(sin[:, 0], torch.cat((-sin_hf[:, :half], sin_hf[:, half:]), dim=-1))
    assert torch.equal(apply_rotary(q, cos, sin), q_hf)
    assert torch.equal(apply_rotary(k, cos, sin), k_hf)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rotary_embedding_half_precision_matches_transformers(dtype: torch.dtype) -> None:
    """cos/sin are cast to the activation dtype as transformers does; then the same ops."""
    rope_parameters, head_dim, max_position = ROTARY_CASES["yarn"], 64, 2048
    gen = torch.Generator().manual_seed(5)
    positions = torch.randint(0, max_position, (33,), generator=gen)
    q = torch.randn(33, NUM_HEADS, head_dim, generator=gen).to(dtype)
    k = torch.randn(33, 2, head_dim, generator=gen).to(dtype)
    q_hf, k_hf, _, _ = _hf_rotate(rope_parameters, head_dim, max_position, q, k, positions)

    rotary = RotaryEmbedding(RopeSpec.from_hf(dict(rope_parameters), None, None), head_dim,
                             max_position)
    cos, sin = rotary.cos_sin(positions, dtype)

    assert cos.dtype == sin.dtype == dtype
    assert torch.equal(apply_rotary(q, cos, sin), q_hf)
    assert torch.equal(apply_rotary(k, cos, sin), k_hf)


def test_rotary_embedding_built_on_meta_then_materialized() -> None:
    """The loader builds models on the meta device, then to_empty + reset_cache."""
    rope_parameters, head_dim, max_position = ROTARY_CASES["yarn"], 64, 2048
    with torch.device("meta"):
        rotary = RotaryEmbedding(RopeSpec.from_hf(dict(rope_parameters), None, None),
                                 head_dim, max_position)
    assert rotary.cos_cache.is_meta and rotary.sin_cache.is_meta

    rotary.to_empty(device="cpu")
    rotary.reset_cache()

    assert rotary.cos_cache.device.type == "cpu" and rotary.cos_cache.dtype == torch.float32
    positions = torch.arange(max_position)
    x = torch.zeros(max_position, 1, head_dim)
    _, _, cos_hf, sin_hf = _hf_rotate(rope_parameters, head_dim, max_position, x, x, positions)
    assert torch.equal(rotary.cos_cache, cos_hf)
    assert torch.equal(rotary.sin_cache, sin_hf)


def test_rotary_buffers_stay_out_of_the_state_dict() -> None:
    rotary = RotaryEmbedding(RopeSpec("default", 10000.0), 32, 64)
    assert rotary.state_dict() == {}
    assert {name for name, _ in rotary.named_buffers()} == {"cos_cache", "sin_cache"}


@pytest.mark.parametrize("case", list(ROTARY_CASES))
def test_rotary_tables_have_max_model_len_rows_with_unchanged_scaling(case: str) -> None:
    """The tables cover the positions the engine can reach (max_model_len), not the
    config's max_position_embeddings, which still drives the scaling: the rows equal
    transformers' for a model of max_position_embeddings 4096."""
    rope_parameters, head_dim, max_position, rows = ROTARY_CASES[case], 64, 4096, 100
    rotary = RotaryEmbedding(RopeSpec.from_hf(dict(rope_parameters), None, None), head_dim,
                             max_position, rows)
    assert rotary.cos_cache.shape == rotary.sin_cache.shape == (rows, head_dim)
    x = torch.zeros(rows, 1, head_dim)
    _, _, cos_hf, sin_hf = _hf_rotate(rope_parameters, head_dim, max_position, x, x,
                                      torch.arange(rows))
    assert torch.equal(rotary.cos_cache, cos_hf) and torch.equal(rotary.sin_cache, sin_hf)


def test_decoder_sizes_rope_tables_by_max_model_len() -> None:
    from pagellm.executor.model.decoder import DecoderForCausalLM
    from pagellm.executor.model.spec import DecoderSpec

    spec = DecoderSpec(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                       num_heads=2, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6,
                       qkv_bias=False, o_bias=False, qk_norm=None, tie_word_embeddings=True,
                       max_position=30_000_000, rope=RopeSpec("default", 10000.0))
    with torch.device("meta"):
        model = DecoderForCausalLM(spec, max_model_len=512)
    assert model.model.rotary_emb.cos_cache.shape == (512, 16)


# --------------------------------------------------------------------------- Phi-3: LongRoPE
# and partial rotary

# head_dim 16 at partial_rotary_factor 0.75: 12 rotated dimensions, 6 frequencies.
PHI_LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0,
                "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                "long_factor": [1.5, 2.0, 3.0, 5.0, 8.0, 12.0]}
PHI_ORIGINAL = 48


def _phi3_config(rope_parameters: dict[str, Any], partial: float = 0.75,
                 max_position: int = 2048) -> Any:
    from transformers import Phi3Config

    return Phi3Config(hidden_size=NUM_HEADS * 16, num_attention_heads=NUM_HEADS,
                      num_key_value_heads=2, intermediate_size=64, num_hidden_layers=1,
                      vocab_size=300, max_position_embeddings=max_position,
                      original_max_position_embeddings=PHI_ORIGINAL,
                      partial_rotary_factor=partial,
                      rope_parameters=copy.deepcopy(rope_parameters))


def _phi3_ours(config: Any) -> RopeSpec:
    return RopeSpec.from_hf(copy.deepcopy(config.rope_parameters), None, None,
                            partial_rotary=True)


@pytest.mark.parametrize("extra", [{}, {"factor": 8.0}, {"attention_factor": 1.25}],
                         ids=["ratio", "factor", "attention-factor"])
@pytest.mark.parametrize("partial", [1.0, 0.75])
def test_longrope_short_and_long_inv_freq_equal_transformers(
        extra: dict[str, Any], partial: float) -> None:
    """transformers computes the short factors by default and the long ones for a
    sequence past original_max_position_embeddings; we pick by max_model_len (the
    engine's longest sequence): within the original context short, beyond it long. The
    attention scaling is the same in both."""
    params = {**PHI_LONGROPE, **extra}
    if partial == 1.0:  # 16 rotated dimensions: 8 frequencies
        params = {**params, "short_factor": params["short_factor"] + [3.0, 3.5],
                  "long_factor": params["long_factor"] + [16.0, 20.0]}
    config = _phi3_config(params, partial)
    hf_short, hf_short_scaling = ROPE_INIT_FUNCTIONS["longrope"](config)
    hf_long, hf_long_scaling = ROPE_INIT_FUNCTIONS["longrope"](config,
                                                               seq_len=PHI_ORIGINAL + 1)
    spec = _phi3_ours(config)

    short, short_scaling = compute_inv_freq(spec, 16, 2048, max_model_len=PHI_ORIGINAL)
    long, long_scaling = compute_inv_freq(spec, 16, 2048, max_model_len=PHI_ORIGINAL + 1)

    assert short.shape == (int(16 * partial) // 2,)
    assert torch.equal(short, hf_short) and torch.equal(long, hf_long)
    assert short_scaling == hf_short_scaling and long_scaling == hf_long_scaling != 1.0
    assert not torch.equal(short, long)
    # max_model_len defaults to max_position_embeddings (2048 > 48): long
    assert torch.equal(compute_inv_freq(spec, 16, 2048)[0], hf_long)


@pytest.mark.parametrize("regime", ["short", "long"])
def test_partial_rotary_longrope_rotation_equals_transformers_phi3(regime: str) -> None:
    """The rotation of Phi-4-mini's shape: the first 12 of 16 dimensions of each head
    rotate, the last 4 pass. transformers' Phi3RotaryEmbedding picks its factors from the
    positions it is given (long past the original context); our tables from the rows
    the engine can reach."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
    from transformers.models.phi3.modeling_phi3 import (
        apply_rotary_pos_emb as phi3_apply_rotary_pos_emb,
    )

    config = _phi3_config(PHI_LONGROPE)
    rows = PHI_ORIGINAL if regime == "short" else 512
    gen = torch.Generator().manual_seed(7)
    positions = torch.cat([torch.tensor([0, rows - 1]),
                           torch.randint(0, rows, (30,), generator=gen)])
    q = torch.randn(len(positions), NUM_HEADS, 16, generator=gen)
    k = torch.randn(len(positions), 2, 16, generator=gen)
    hf_rotary = Phi3RotaryEmbedding(config)
    cos_hf, sin_hf = hf_rotary(q, positions[None])  # [1, T, 12]
    q_hf, k_hf = phi3_apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                           cos_hf, sin_hf)

    rotary = RotaryEmbedding(_phi3_ours(config), 16, 2048, rows)
    cos, sin = rotary.cos_sin(positions, torch.float32)

    assert cos.shape == (len(positions), 1, 12)
    assert torch.equal(cos[:, 0], cos_hf[0])
    assert torch.equal(apply_rotary(q, cos, sin), q_hf[0].transpose(0, 1))
    assert torch.equal(apply_rotary(k, cos, sin), k_hf[0].transpose(0, 1))
    assert torch.equal(apply_rotary(q, cos, sin)[..., 12:], q[..., 12:])


def test_phi3_config_reads_partial_rotary_longrope_and_the_fused_checkpoint() -> None:
    spec = read_spec(_phi3_config(PHI_LONGROPE))
    assert spec.rope.rope_type == "longrope" and spec.rope.partial_rotary_factor == 0.75
    assert spec.rope.rotary_dim(spec.head_dim) == 12
    assert spec.rope.params["original_max_position_embeddings"] == PHI_ORIGINAL
    assert spec.fused_checkpoint == ("qkv_proj", "gate_up_proj")


def test_rope_spec_refuses_what_cannot_rotate_the_heads_naming_the_field() -> None:
    spec = RopeSpec.from_hf(dict(PHI_LONGROPE), None, None)
    with pytest.raises(ValueError, match="short_factor has 6 entries, rotary_dim // 2 = 8"):
        spec.validate(16)
    odd = RopeSpec.from_hf({"rope_type": "default", "partial_rotary_factor": 0.5625}, None,
                           None, partial_rotary=True)
    with pytest.raises(ValueError, match="rotary_dim=9 for head_dim=16"):
        odd.validate(16)
    with pytest.raises(ValueError, match="long_factor"):
        RopeSpec.from_hf({"rope_type": "longrope", "short_factor": [1.0]}, None, None)
