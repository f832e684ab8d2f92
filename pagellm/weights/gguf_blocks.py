"""llama.cpp's quantized block types as integer codes (weights/gguf.py keeps a GGUF
file's projections so): each type's blocks decoded into codes with a scale and a float
zero point per 32 weights, w = scale * (code - zero), as ggml's dequantize_row_* computes
them (tests/weights/test_gguf.py checks each against the gguf package's dequantize), and
the types that do not fit groups of 32 re-quantized to 8-bit codes. In numpy (torch only
for the tensors written to the directory); like all of weights/, it imports neither side
of the socket."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Codes:
    """A projection [N, K] as w = scale * (code - zero) in groups of 32: codes [N, K],
    scales and zeros [N, K / 32], fp32 arrays; `bits` the narrowest width its codes fit
    (4 or 8)."""

    bits: int
    codes: Any
    scales: Any
    zeros: Any

    def weight(self) -> Any:
        """What the codes stand for: [N, K] fp32."""
        return ((self.codes - np.repeat(self.zeros, 32, axis=1))
                * np.repeat(self.scales, 32, axis=1))

    def tensors(self, bits: int) -> dict[str, Any]:
        """The "gguf" method's tensors, codes `bits` wide (>= self.bits), in
        kernels/quant.py's layout: qweight [K / (32 / bits), N], scales, zeros [K / 32, N]."""
        import torch

        return {"qweight": torch.from_numpy(pack_along_k(self.codes, bits)),
                "scales": torch.from_numpy(np.ascontiguousarray(self.scales.T)),
                "zeros": torch.from_numpy(np.ascontiguousarray(self.zeros.T))}


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
# re-quantized to 8-bit codes (`requantized`); the unquantized ones load as transformers'
# weights.
BLOCKS = {"Q8_0": (8, _q8_0), "Q4_0": (4, _q4_0), "Q4_1": (4, _q4_1), "Q5_0": (8, _q5_0),
          "Q5_1": (8, _q5_1), "Q4_K": (4, _q4_k), "Q5_K": (8, _q5_k)}
FULL_PRECISION = frozenset({"F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64"})


def pack_along_k(codes: Any, bits: int) -> Any:
    """codes [N, K] -> the "gguf" method's qweight [K / (32 / bits), N] int32, input
    column k's code at bits (k % per_int) * bits of word k // per_int: kernels/quant.py's
    `pack` (not imported: weights/ serves both sides of the socket and imports no side)."""
    per_int = 32 // bits
    n, k = codes.shape
    grouped = codes.T.astype(np.uint32).reshape(k // per_int, per_int, n)
    shifts = (np.arange(per_int, dtype=np.uint32) * bits).reshape(1, per_int, 1)
    return np.ascontiguousarray(np.bitwise_or.reduce(grouped << shifts, axis=1)).view(np.int32)


def as_codes(qtype: str, blocks: Any, n: int, k: int) -> Codes:
    """A tensor [N, K] of block type `qtype` (one of BLOCKS; its bytes `blocks`, N rows)
    as Codes: scale = step and zero = -offset / step for each block of 32's w = step *
    code + offset."""
    bits, decode = BLOCKS[qtype]
    codes, step, offset = decode(blocks.reshape(n, -1))
    return _zero_points(bits, codes.reshape(n, k), step, offset)


def requantized(weight: Any) -> Codes:
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
    step, offset = step.reshape(n, -1), offset.reshape(n, -1)
    flat = step == 0
    codes = np.where(np.repeat(flat, 32, axis=1), 0, codes)
    scales = np.where(flat, -offset, step)
    zeros = np.where(flat, 1, -offset / np.where(flat, 1, step))
    return Codes(bits, codes.astype(np.float32), scales.astype(np.float32),
                 zeros.astype(np.float32))
