"""MXFP4 blocks and scales (kernels/mxfp4.py) against transformers' own reader of
gpt-oss checkpoints, on every code and a spread of exponents; and the errors that name a
malformed pair."""

from __future__ import annotations

import pytest
import torch

from pagellm.kernels import mxfp4


def _random_mxfp4(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks [*shape, G, 16] with every byte value, scales [*shape, G] around 127."""
    gen = torch.Generator().manual_seed(seed)
    *rows, groups = shape
    blocks = torch.randint(0, 256, (*rows, groups, 16), generator=gen, dtype=torch.uint8)
    blocks.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)  # every pair of codes
    scales = torch.randint(110, 140, (*rows, groups), generator=gen, dtype=torch.uint8)
    return blocks, scales


@pytest.mark.parametrize("chunk", [mxfp4.CHUNK, 3 * 128], ids=["whole", "rows-of-3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_equals_transformers_reader(dtype: torch.dtype, chunk: int,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """(Decoded a few rows at a time too: 72 rows of 128 values, 3 a chunk.)"""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    monkeypatch.setattr(mxfp4, "CHUNK", chunk)

    blocks, scales = _random_mxfp4((3, 24, 4), seed=1)  # 3 experts, N 24, K 128
    ours = mxfp4.dequantize(blocks, scales, dtype)
    assert ours.shape == (3, 24, 128) and ours.dtype == dtype
    # transformers' returns the model's layout, [E, K, N]
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    assert torch.equal(ours.transpose(1, 2), theirs)


def test_dequantize_by_hand() -> None:
    """Byte 0x2F: low nibble 0xF (-6.0) first, high nibble 0x2 (1.0); scale 129: x4."""
    blocks = torch.zeros(1, 1, 1, 16, dtype=torch.uint8)
    blocks[..., 0] = 0x2F
    scales = torch.full((1, 1, 1), 129, dtype=torch.uint8)
    out = mxfp4.dequantize(blocks, scales, torch.float32)
    assert out.shape == (1, 1, 32)
    assert out[0, 0, :3].tolist() == [-24.0, 4.0, 0.0]


@pytest.mark.parametrize(("blocks", "scales", "match"), [
    (torch.zeros(2, 4, 16, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.uint8),
     "do not fit"),
    (torch.zeros(2, 4, 8, dtype=torch.uint8), torch.zeros(2, 4, dtype=torch.uint8),
     "do not fit"),
    (torch.zeros(2, 4, 16, dtype=torch.int8), torch.zeros(2, 4, dtype=torch.uint8),
     "must be uint8"),
])
def test_a_malformed_pair_is_named(blocks: torch.Tensor, scales: torch.Tensor,
                                   match: str) -> None:
    with pytest.raises(ValueError, match=f"experts.down_proj: .*{match}"):
        mxfp4.dequantize(blocks, scales, torch.float32, "experts.down_proj")
