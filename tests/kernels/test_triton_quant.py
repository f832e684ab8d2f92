"""Weight-only int4/int8: the packed layout and round-to-nearest quantizer
(kernels/quant.py) against hand computations, and the fused-dequantize GEMM
(kernels/triton_quant.py) against dequantize-then-matmul in fp32, through Triton's
interpreter on the CPU (TRITON_INTERPRET=1, set in conftest) or on a GPU.

Shapes are multiples of no tile in M and N (ragged row and column tiles), K splits that
leave the last split short, group sizes below, at and above the K tile, and codes at
both ends of the range (the top code of a 4-bit int32's last slot sets its sign bit)."""

from __future__ import annotations

import pytest
import torch
from conftest import runs_triton_kernels

from pagellm.kernels import quant
from pagellm.kernels import triton_quant as tq

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_and_unpack_by_hand(bits):
    per_int = 32 // bits
    top = 2**bits - 1
    codes = torch.tensor([[top], [0], [1], [top - 1]] * (per_int // 2), dtype=torch.int64)
    packed = quant.pack(codes, bits)  # [2, 1] or [1, 1]
    expected = [sum(int(codes[r * per_int + i, 0]) << (bits * i) for i in range(per_int))
                for r in range(codes.shape[0] // per_int)]
    assert [v % 2**32 for v in packed[:, 0].tolist()] == expected
    assert packed.dtype == torch.int32
    gen = torch.Generator().manual_seed(bits)
    many = torch.randint(0, top + 1, (64, 7), generator=gen)
    assert torch.equal(quant.unpack(quant.pack(many, bits), bits), many)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 128])
def test_every_weight_lands_within_half_a_step(bits, group_size):
    """Round to nearest: |dequantized - w| <= scale / 2 for every element (fp32
    scales), every code in range, zero exactly representable (a group's zero point is
    a whole code)."""
    gen = torch.Generator().manual_seed(group_size + bits)
    w = torch.randn(24, 256, generator=gen) * torch.rand(24, 1, generator=gen) * 3
    w[3, :group_size] = torch.rand(group_size, generator=gen)  # all positive: low = 0
    packed = quant.quantize(w, bits, group_size)
    assert packed.qweight.shape == (256 * bits // 32, 24)
    assert packed.scales.shape == packed.zeros.shape == (256 // group_size, 24)
    step = packed.scales.t().repeat_interleave(group_size, dim=1)  # [N, K]
    error = (quant.dequantize(packed) - w).abs()
    assert (error <= step / 2 * (1 + 1e-5)).all(), (error / step).max()
    codes = quant.unpack(packed.qweight, bits)
    assert codes.min() >= 0 and codes.max() <= 2**bits - 1
    zero = torch.zeros(1, 256)
    assert torch.equal(quant.dequantize(quant.quantize(zero, bits, group_size)), zero)


def test_shapes_that_cannot_be_quantized_are_named():
    with pytest.raises(ValueError, match="4 or 8 bits"):
        quant.quantize(torch.zeros(4, 64), 3, 32)
    with pytest.raises(ValueError, match="group_size must be one of"):
        quant.quantize(torch.zeros(4, 64), 4, 48)
    with pytest.raises(ValueError, match="not a multiple of group_size"):
        quant.quantize(torch.zeros(4, 96), 4, 64)


def reference(x: torch.Tensor, packed: quant.PackedWeight) -> torch.Tensor:
    return x.float().cpu() @ quant.dequantize(packed).cpu().t()


def packed_on_device(n: int, k: int, bits: int, group_size: int, dtype: torch.dtype,
                     seed: int = 0) -> quant.PackedWeight:
    gen = torch.Generator().manual_seed(seed)
    p = quant.quantize(torch.randn(n, k, generator=gen) / k ** 0.5, bits, group_size, dtype)
    return quant.PackedWeight(p.qweight.to(DEVICE), p.scales.to(DEVICE), p.zeros.to(DEVICE),
                              bits, group_size)


@runs_triton_kernels
@pytest.mark.parametrize(("bits", "group_size", "tiles"), [
    (4, 32, None), (4, 128, None), (8, 64, None),
    (4, 64, tq.QuantTiles(block_m=16, block_n=32, block_k=32, split_k=3)),  # short last split
], ids=["int4-g32", "int4-g128", "int8-g64", "int4-g64-split3"])
@pytest.mark.parametrize("tokens", [1, 37])
def test_fp32_matmul_equals_dequantize_then_matmul(bits, group_size, tiles, tokens):
    n, k = 88, 256
    packed = packed_on_device(n, k, bits, group_size, torch.float32, seed=bits + tokens)
    x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(tokens)).to(DEVICE)
    out = tq.quant_matmul(x, packed, tiles)
    assert out.shape == (tokens, n) and out.dtype == torch.float32
    torch.testing.assert_close(out.cpu(), reference(x, packed), rtol=1e-5, atol=1e-5)


@runs_triton_kernels
def test_a_slice_of_a_wider_weights_rows_reads_with_its_stride():
    """One expert's rows of stacked experts packed as one weight (moe.ExpertCodes): a
    column slice of qweight, scales and zeros, read in place with their row stride."""
    gen = torch.Generator().manual_seed(4)
    packed = quant.quantize(torch.randn(3 * 48, 96, generator=gen), 4, 32)
    expert = packed.narrow(0, 48, 48)  # the middle expert's 48 rows
    assert not expert.qweight.is_contiguous()
    x = torch.randn(5, 96, generator=gen)
    torch.testing.assert_close(tq.quant_matmul(x, expert),
                               x @ quant.dequantize(packed)[48:96].t(), rtol=1e-5, atol=1e-5)


@runs_triton_kernels
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_activations_track_the_fp32_reference(dtype):
    """16-bit x, scales and zeros: within the 16-bit rounding of the dequantized
    weight and of the output."""
    n, k = 72, 128
    packed = packed_on_device(n, k, 4, 64, dtype, seed=5)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(5)).to(DEVICE, dtype)
    out = tq.quant_matmul(x, packed)
    assert out.dtype == dtype
    expected = reference(x, packed)
    tol = 3e-2 if dtype == torch.bfloat16 else 4e-3
    torch.testing.assert_close(out.float().cpu(), expected, rtol=tol,
                               atol=tol * expected.abs().max().item())


def test_bad_inputs_are_named():
    packed = quant.quantize(torch.randn(8, 64), 4, 32)
    with pytest.raises(ValueError, match=r"x must be a row-major \[M, 64\]"):
        tq.quant_matmul(torch.randn(2, 32), packed)
    with pytest.raises(ValueError, match=r"scales must be a torch\.float16"):
        tq.quant_matmul(torch.randn(2, 64, dtype=torch.float16), packed)
    with pytest.raises(ValueError, match="block_k 64 must divide group_size 32"):
        tq.quant_matmul(torch.randn(2, 64), packed, tq.QuantTiles(16, 32, 64, 1))
