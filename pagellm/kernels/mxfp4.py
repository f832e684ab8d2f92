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
CHUNK = 1 << 22  # values decoded at once (`dequantize`)


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
    *lead, groups, _ = blocks.shape
    rows = blocks.reshape(-1, groups, BLOCK // 2)  # [R, G, 16]
    exponents = scales.reshape(-1, groups).to(torch.int32) - 127  # [R, G]
    out = torch.empty(rows.shape[0], groups * BLOCK, dtype=dtype, device=blocks.device)
    # A few rows at a time: the fp32 intermediates of a whole stacked weight would be
    # several times its size (gpt-oss-120b's gate_up: 2.1e9 values).
    step = max(1, CHUNK // (groups * BLOCK))
    for r0 in range(0, rows.shape[0], step):
        part = rows[r0:r0 + step]
        low, high = lut[(part & 0x0F).long()], lut[(part >> 4).long()]  # [r, G, 16]
        values = torch.stack((low, high), dim=-1).flatten(-2)  # [r, G, 32]
        values = torch.ldexp(values, exponents[r0:r0 + step, :, None].to(torch.float32))
        out[r0:r0 + step] = values.flatten(-2)
    return out.reshape(*lead, groups * BLOCK)  # [..., N, K]
