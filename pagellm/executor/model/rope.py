"""Rotary position embeddings with the scaling types Llama, Qwen and Phi-3 configs use.

The inverse frequencies are computed with the same float32 operations as transformers
so that fp32 outputs agree with it bit for bit; cos/sin are cached once for every
position that can occur (`rows`: the engine's max_model_len, at most the config's
max_position_embeddings, which alone enters the scaling math), and looked up by the
step's flat `positions`. A partial rotary factor (Phi-4-mini: 0.75) rotates only the
first `rotary_dim` dimensions of each head; the tables are that wide.

LongRoPE (Phi-3/Phi-4 "longrope") has two sets of per-frequency factors: transformers
picks the long ones for a forward call whose positions reach past
original_max_position_embeddings, the short ones otherwise, and recomputes them call by
call, so a sequence that grows past the threshold mixes keys of both in its cache. An
engine serving many requests in one batch, from one cached KV per token, picks once, as
vLLM does: the long factors when the engine's max_model_len exceeds
original_max_position_embeddings (a sequence could cross it), else the short ones. So
with max_model_len <= original_max_position_embeddings every output equals
transformers'; above it, equal to transformers' for prompts already longer than the
threshold, and for shorter ones the factors the long-context model was tuned with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pagellm.kernels import fused_for

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


@dataclass(frozen=True)
class RopeSpec:
    rope_type: str
    theta: float
    params: dict[str, Any] = field(default_factory=dict)  # the config's scaling fields
    # The fraction of each head's dimensions rotated (Phi-3's partial_rotary_factor).
    partial_rotary_factor: float = 1.0

    @classmethod
    def from_hf(cls, rope_parameters: dict[str, Any] | None, rope_theta: float | None,
                rope_scaling: dict[str, Any] | None, partial_rotary: bool = False
                ) -> RopeSpec:
        """Accept transformers 5's `rope_parameters` and the older rope_theta/rope_scaling.
        `partial_rotary`: the family's transformers code honours partial_rotary_factor
        (Phi-3); elsewhere a factor other than 1 is refused, not silently ignored."""
        params: dict[str, Any] = dict(rope_scaling or {})
        params.update(rope_parameters or {})
        theta = params.pop("rope_theta", None) or rope_theta or 10000.0
        rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
        params.pop("type", None)
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported rope_type {rope_type!r} "
                             f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
        fraction = params.pop("partial_rotary_factor", None) or 1.0
        if fraction != 1.0 and not partial_rotary:
            raise ValueError("partial_rotary_factor != 1 is not supported")
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) \
                or not 0 < fraction <= 1:
            raise ValueError(f"partial_rotary_factor must be in (0, 1], got {fraction!r}")
        if rope_type == "longrope":
            for key in ("short_factor", "long_factor"):
                if not isinstance(params.get(key), list):
                    raise ValueError(f"rope_type 'longrope' needs {key} as a list of numbers")
        return cls(rope_type, float(theta), params, float(fraction))

    def rotary_dim(self, head_dim: int) -> int:
        """How many of each head's `head_dim` dimensions are rotated (transformers'
        int(head_dim * partial_rotary_factor))."""
        return int(head_dim * self.partial_rotary_factor)

    def validate(self, head_dim: int) -> None:
        """Refuse, naming the field, what cannot rotate heads of `head_dim`: an odd
        rotary_dim, LongRoPE factor lists of the wrong length."""
        dim = self.rotary_dim(head_dim)
        if dim < 2 or dim % 2:
            raise ValueError(f"partial_rotary_factor={self.partial_rotary_factor} gives "
                             f"rotary_dim={dim} for head_dim={head_dim}: not a positive "
                             "even number")
        if self.rope_type == "longrope":
            for key in ("short_factor", "long_factor"):
                if len(self.params[key]) != dim // 2:
                    raise ValueError(f"rope {key} has {len(self.params[key])} entries, "
                                     f"rotary_dim // 2 = {dim // 2} expected")


def compute_inv_freq(spec: RopeSpec, head_dim: int, max_position: int,
                     max_model_len: int | None = None) -> tuple[torch.Tensor, float]:
    """Returns (inv_freq [rotary_dim // 2] float32, attention scaling for cos/sin).
    `max_model_len` (default: max_position) picks LongRoPE's factor set (module
    docstring)."""
    dim = spec.rotary_dim(head_dim)
    inv_freq = 1.0 / (spec.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    p = spec.params
    if spec.rope_type == "default":
        return inv_freq, 1.0
    if spec.rope_type == "linear":
        return inv_freq / p["factor"], 1.0
    if spec.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, p, max_position), 1.0
    if spec.rope_type == "longrope":
        return _longrope_inv_freq(spec.theta, dim, p, max_position,
                                  max_position if max_model_len is None else max_model_len)
    return _yarn_inv_freq(spec.theta, dim, p, max_position)


def _longrope_inv_freq(base: float, dim: int, p: dict[str, Any], max_position: int,
                       max_model_len: int) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3): each frequency divided by its own factor, the long set when
    the engine can reach past original_max_position_embeddings (module docstring); the
    attention scaling from the length ratio, in both regimes, as transformers has it."""
    orig = p.get("original_max_position_embeddings") or max_position
    factor = p.get("factor") or max_position / orig
    attention = p.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    ext = torch.tensor(p["long_factor"] if max_model_len > orig else p["short_factor"],
                       dtype=torch.float32)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext * base ** exponents), attention


def _llama3_inv_freq(inv_freq: torch.Tensor, p: dict[str, Any], max_position: int
                     ) -> torch.Tensor:
    """Llama 3.1: long wavelengths are divided by `factor`, short ones kept, the band
    between them blended smoothly."""
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p.get("original_max_position_embeddings") or max_position
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def yarn_mscale(scale: float, m: float = 1.0) -> float:
    """YaRN's temperature for a context stretched `scale` times (DeepSeek's
    yarn_get_mscale; registry.py squares it into the scores' scale)."""
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _yarn_inv_freq(base: float, dim: int, p: dict[str, Any], max_position: int
                   ) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, ramp in between, and
    scale attention by a log-of-factor temperature."""
    orig = p.get("original_max_position_embeddings") or max_position
    factor = p.get("factor") or max_position / orig
    attention = p.get("attention_factor")
    if attention is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attention = float(yarn_mscale(factor, m) / yarn_mscale(factor, m_all)) \
            if m and m_all else yarn_mscale(factor)
    beta_fast = p.get("beta_fast") or 32
    beta_slow = p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid dividing by zero in the ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = (interpolation * (1 - extrapolation_factor)
                + extrapolation * extrapolation_factor)
    return inv_freq, attention


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position that can occur, shared by all layers of a model.

    Neox-style rotation (halves, as transformers' rotate_half). The tables are float32
    buffers outside the checkpoint; `reset_cache` recomputes them on the module's
    device (the loader builds models on the meta device first). `max_position` (the
    config's max_position_embeddings) enters only the scaling math; the tables have
    `rows` rows (default: max_position), the positions the engine can reach, and
    `rotary_dim` columns (head_dim unless the rotation is partial).
    """

    cos_cache: torch.Tensor  # [rows, rotary_dim] float32
    sin_cache: torch.Tensor

    def __init__(self, spec: RopeSpec, head_dim: int, max_position: int,
                 rows: int | None = None) -> None:
        super().__init__()
        self.spec, self.head_dim, self.max_position = spec, head_dim, max_position
        self.rotary_dim = spec.rotary_dim(head_dim)
        self.rows = max_position if rows is None else rows
        self.register_buffer("cos_cache", torch.empty(self.rows, self.rotary_dim),
                             persistent=False)
        self.register_buffer("sin_cache", torch.empty(self.rows, self.rotary_dim),
                             persistent=False)
        self.reset_cache()

    def reset_cache(self) -> None:
        device = self.cos_cache.device
        if device.type == "meta":  # shapes only; the loader fills them after to_empty
            return  # (computing on meta runs torch's Python refs, which import dynamo)
        inv_freq, attention_scaling = compute_inv_freq(self.spec, self.head_dim,
                                                       self.max_position, self.rows)
        positions = torch.arange(self.rows, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [rows, rotary_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [rows, rotary_dim]
        self.cos_cache = (emb.cos() * attention_scaling).to(device)
        self.sin_cache = (emb.sin() * attention_scaling).to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] -> cos, signed sin: [T, 1, rotary_dim] in `dtype` (broadcast
        over heads). The sine's first half is negated here, once per step, so that
        `apply_rotary` needs no negation per layer (negating is exact: the products
        equal transformers' rotate_half ones bit for bit)."""
        sin = self.sin_cache[positions].to(dtype)
        half = self.rotary_dim // 2
        signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        return self.cos_cache[positions].to(dtype)[:, None, :], signed[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor
                 ) -> torch.Tensor:
    """x: [T, H, D]; cos, signed_sin: [T, 1, R] (`RotaryEmbedding.cos_sin`), R <= D: the
    first R dimensions of each head rotate, the rest pass (partial rotary, concatenated
    back as transformers does). On CUDA one fused kernel with the same roundings
    (kernels/triton_fused.py), else `rotate`."""
    rotary_dim = cos.shape[-1]
    if rotary_dim == 0:  # a table of width 0 rotates nothing (SmolLM3's NoPE layers)
        return x
    if rotary_dim < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :rotary_dim], cos, signed_sin),
                          x[..., rotary_dim:]), dim=-1)
    fused = fused_for(x)
    if fused is not None:
        return fused.rotary(x, cos, signed_sin)
    return rotate(x, cos, signed_sin)


def halves_from_pairs(x: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """x [..., D] whose first `rotary_dim` dimensions pair up interleaved, (x0, x1),
    (x2, x3), ... (DeepSeek's and GLM's RoPE) -> those dimensions reordered as halves
    (the evens, then the odds), the rest as they are. Rotating halves (apply_rotary)
    then turns each pair by its own frequency, as the interleaved rotation does: with
    queries and keys reordered alike, every dot product is the same."""
    return torch.cat((x[..., 0:rotary_dim:2], x[..., 1:rotary_dim:2], x[..., rotary_dim:]),
                     dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """`apply_rotary` in torch ops: the CPU path and the fused kernel's reference."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * signed_sin
