"""MXFP4 (the OCP microscaling format OpenAI ships gpt-oss's experts in): 4-bit e2m1
values in blocks of 32 along the input dimension, each block with an e8m0 exponent.

A weight [..., N, K] is stored as two tensors:

    <name>_blocks  [..., N, K / 32, 16] uint8: element 2i of a block in byte i's low
                   nibble, element 2i + 1 in its high nibble; a nibble is e2m1 (sign,
                   two exponent bits, one mantissa bit): 0, 0.5, 1, 1.5, 2, 3, 4, 6
                   and their negatives
    <name>_scales  [..., N, K / 32] uint8: the block's power of two plus 127

    w[n, k] = e2m1(nibble) * 2^(scale[n, k / 32] - 127)

Every such value is exact in bf16 and fp32 (a 2-bit significand; exponents within
range), so dequantizing loses nothing. `dequantize` is written from that definition
(tests check it against transformers' own reader of gpt-oss checkpoints). Beside
kernels/quant.py's integer formats: the model's loading imports it (executor/model/
gpt_oss.py), and models import kernels, not weights/.
"""

from __future__ import annotations

import torch

# e2m1's 16 codes: the sign bit is bit 3.
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # values per scale


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
               name: str = "weight") -> torch.Tensor:
    """blocks [..., N, K / 32, 16] uint8, scales [..., N, K / 32] uint8 -> the weight
    [..., N, K] in `dtype`. ValueError naming `name` when the two do not fit."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{name}: MXFP4 blocks and scales must be uint8, got "
                         f"{blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 3 or blocks.shape[-1] != BLOCK // 2 \
            or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"{name}: MXFP4 blocks {tuple(blocks.shape)} and scales "
                         f"{tuple(scales.shape)} do not fit ([..., N, K/32, 16] and "
                         "[..., N, K/32])")
    lut = torch.tensor(E2M1, dtype=torch.float32, device=blocks.device)
    low, high = lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]  # [..., G, 16]
    values = torch.stack((low, high), dim=-1).flatten(-2)  # [..., N, K / 32, 32]
    exponents = scales.to(torch.int32) - 127
    out = torch.ldexp(values, exponents.unsqueeze(-1).to(torch.float32))
    return out.flatten(-2).to(dtype)  # [..., N, K]
