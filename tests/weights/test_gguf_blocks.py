"""llama.cpp's block types as codes (pagellm/weights/gguf_blocks.py): each kept type's
blocks read as the gguf package's own dequantize reads them, and the re-quantized types'
8-bit codes within half a step of their weights."""

from __future__ import annotations

import numpy as np
import pytest
from gguf_files import RANDOM_BLOCKS, random_blocks

from pagellm.weights.gguf_blocks import BLOCKS, as_codes, requantized

gguf = pytest.importorskip("gguf")


def _blocks(qtype: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random `qtype` blocks for [n, k] with some blocks flat (step 0): [n, bytes]."""
    if qtype in RANDOM_BLOCKS:
        blocks = random_blocks(qtype, (n, k), qtype).reshape(n, k // 256, -1)
        blocks[0, 0, 4:16] = 0  # every sub-block's 6-bit scale and min 0: w = 0
        blocks[1, 0, 4:16] = 0
        blocks[1, 0, 8] = 5  # sub-block 0's min 5, its scale 0: w = -5 dmin throughout
        return blocks.reshape(n, -1)
    blocks = gguf.quantize(rng.standard_normal((n, k)).astype(np.float32),
                           gguf.GGMLQuantizationType[qtype]).reshape(n, k // 32, -1)
    blocks[0, 0, :2] = 0  # a step of 0: w = 0 (Q8_0, Q4_0, Q5_0) or w = m throughout
    return blocks.reshape(n, -1)


@pytest.mark.parametrize("qtype", sorted(BLOCKS))
def test_each_kept_block_type_decodes_as_the_gguf_packages_dequantize(qtype):
    """scale * (code - zero) of as_codes is the gguf package's own dequantized weight:
    exactly for the symmetric types, to fp32 rounding where a float zero point stands
    for a block's minimum; the codes fit their bits."""
    n, k = 6, 512
    blocks = _blocks(qtype, n, k, np.random.default_rng(1))
    kept = as_codes(qtype, blocks, n, k)
    bits, codes = kept.bits, kept.codes
    ours = (codes - np.repeat(kept.zeros, 32, axis=1)) * np.repeat(kept.scales, 32, axis=1)
    reference = gguf.dequantize(blocks, gguf.GGMLQuantizationType[qtype])
    assert reference.shape == (n, k) and np.isfinite(ours).all()
    exact = qtype in ("Q8_0", "Q4_0", "Q5_0")
    np.testing.assert_allclose(ours, reference, rtol=0 if exact else 1e-6,
                               atol=0 if exact else 1e-6 * np.abs(reference).max())
    assert codes.min() >= 0 and codes.max() < 2**bits and (codes == codes.round()).all()
    assert (codes.max() > 15) == (bits == 8)  # 5- and 8-bit codes take 8 bits




def test_requantized_codes_lie_within_half_a_step_of_each_weight():
    """The types that do not fit groups of 32 (Q6_K's sub-blocks of 16): 8-bit codes over
    each group's [min, max], a flat group (one value) exact."""
    rng = np.random.default_rng(2)
    weight = rng.standard_normal((4, 96)).astype(np.float32)
    weight[1, 32:64] = 0.25  # flat: step 0
    kept = requantized(weight)
    ours = (kept.codes - np.repeat(kept.zeros, 32, axis=1)) * np.repeat(kept.scales, 32, axis=1)
    groups = weight.reshape(4, 3, 32)
    half_step = np.repeat(groups.max(-1) - groups.min(-1), 32, axis=1) / 510
    assert kept.bits == 8 and (np.abs(ours - weight) <= half_step * (1 + 1e-5) + 1e-7).all()
    assert (ours[1, 32:64] == 0.25).all()
    assert kept.codes.min() == 0 and kept.codes.max() == 255
