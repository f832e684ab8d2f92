"""The CPU's int4/int8 kernel (kernels/cpu_int_gemm.py, csrc/cpu_int_gemm.cpp) against
torch: its tiled layout by hand, its GEMM against the same arithmetic in fp64
(activations quantized per token and group, exact integer sums) and against
dequantize-then-matmul within the activations' rounding bound. Both builds run: the
native one (AVX-512 VNNI where the CPU has it) and the portable plain loops."""

from __future__ import annotations

import shutil
from dataclasses import replace

import pytest
import torch

from pagellm.kernels import cpu_int_gemm, cpu_ops
from pagellm.kernels.quant import dequantize, quantize

pytestmark = pytest.mark.own_code


@pytest.fixture(params=[False, True], ids=["native", "portable"])
def ops(request):
    return cpu_ops.load(portable=request.param)


def gemm(ops, x: torch.Tensor, w: cpu_int_gemm.CpuIntWeight) -> torch.Tensor:
    return ops.int_gemm(x, w.codes, w.scales, w.zeros, w.bits, w.group_size,
                        w.out_features)


def test_the_tiled_layout_by_hand():
    """Tile t, quad q, byte c = 4 * row + kk holds code (16 t + row, 4 q + kk); for 4
    bits quad 2p + 1's byte c rides in the high nibble of quad 2p's. 20 rows: the second
    tile is padded with zero codes."""
    n, k = 20, 8
    codes = torch.arange(n * k).reshape(n, k) % 256
    packed8 = cpu_int_gemm.pack_codes(codes, 8)
    assert packed8.shape == (2, 2, 64)
    for t, q, c in [(0, 0, 0), (0, 0, 5), (0, 1, 63), (1, 1, 14), (1, 0, 3)]:
        row, kk = 16 * t + c // 4, 4 * q + c % 4
        assert packed8[t, q, c] == codes[row, kk]
    assert packed8[1, 0, 4 * 4:].eq(0).all()  # rows 20..31 do not exist
    nibbles = codes % 16
    packed4 = cpu_int_gemm.pack_codes(nibbles, 4)
    assert packed4.shape == (2, 2, 32)
    # quads 0 and 1 share bytes 0..63 of tile 0: [0, 0, 32 + 3] is byte 35 (row 8, kk 3)
    assert packed4[0, 1, 3] == nibbles[8, 3] | (nibbles[8, 7] << 4)
    assert packed4[1, 0, 6] == nibbles[17, 2] | (nibbles[17, 6] << 4)
    for bits, packed, source in [(8, packed8, codes), (4, packed4, nibbles)]:
        assert torch.equal(cpu_int_gemm.unpack_codes(packed, bits, n), source.to(torch.uint8))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_packing_keeps_the_weight_exactly(bits, group):
    w = torch.randn(37, 256)
    packed = quantize(w, bits, group, torch.float32)
    assert torch.equal(cpu_int_gemm.dequantize(cpu_int_gemm.pack(packed)), dequantize(packed))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 128])
def test_quantizing_on_load_lands_within_half_a_step_in_the_kernels_layout(bits, group):
    """cpu_int_gemm.quantize (codes straight into the tiled layout) holds the weight the
    GPTQ-layout quantize does, every element within half its group's step of the
    original (plus fp32 rounding); a group size that is not a multiple of 32 is
    refused."""
    w = torch.randn(37, 256) * torch.linspace(0.1, 3, 256)
    ours = cpu_int_gemm.quantize(w, bits, group)
    assert torch.equal(cpu_int_gemm.dequantize(ours), dequantize(quantize(w, bits, group)))
    step = ours.scales.transpose(1, 2).reshape(-1, 256 // group)[:37].repeat_interleave(
        group, dim=1)
    assert ((cpu_int_gemm.dequantize(ours) - w).abs() <= step / 2 + 1e-6).all()
    with pytest.raises(ValueError, match="multiples of 32"):
        cpu_int_gemm.quantize(torch.randn(16, 48), bits, 16)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("n", "k", "group"), [(16, 64, 32), (50, 128, 64), (200, 384, 128),
                                               (7, 96, 32)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 11, 16])
def test_the_gemm_is_the_quantized_arithmetic(ops, bits, n, k, group, rows):
    """Equal to the same arithmetic in fp64 up to fp32 rounding (every sum inside a block
    of 32 is an exact integer), and to x @ W^T within what rounding the activations
    costs: half a step of xs (per block of 32) per element, times |W|. 1-6 rows run as
    one pass (1-2 a tile at a time, more in pairs of tiles), 11 as two, 16 as three; 50
    and 200 rows of W are 4 and 13 tiles (a thread's odd tile alone)."""
    generator = torch.Generator().manual_seed(bits * 1000 + n + rows)
    w = quantize(torch.randn(n, k, generator=generator), bits, group, torch.float32)
    packed = cpu_int_gemm.pack(w)
    x = torch.randn(rows, k, generator=generator) * torch.linspace(0.1, 3, k)
    x[0, :32] = 0  # an all-zero block: its step is 1, its codes 0
    y = gemm(ops, x, packed)
    assert y.shape == (rows, n) and y.dtype == torch.float32
    exact = cpu_int_gemm.reference_linear(x, packed)
    torch.testing.assert_close(y.double(), exact, rtol=1e-5, atol=1e-5 * exact.abs().max())
    dense = x.double() @ dequantize(w).double().t()
    steps = (x.abs().reshape(rows, k // 32, 32).amax(-1) / 127).repeat_interleave(
        32, dim=1).double()
    bound = (steps / 2) @ dequantize(w).abs().double().t()
    assert ((y.double() - dense).abs() <= bound + 1e-4).all()


def test_extreme_codes_and_activations_do_not_overflow(ops):
    """Codes 255 against activations -127 over one group of 8192 columns: an int32 sum
    of -265 million, exact (nothing wraps)."""
    k = 8192
    codes = torch.full((1, k // 4, 64), 255, dtype=torch.uint8)
    ones, zeros = torch.ones(1, 1, 16), torch.zeros(1, 1, 16)
    y = ops.int_gemm(-torch.ones(3, k), codes, ones, zeros, 8, k, 16)
    torch.testing.assert_close(y, torch.full((3, 16), -255.0 * k), rtol=1e-6, atol=0)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("inter", "group"), [(16, 32), (96, 64)])
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 16])
def test_gate_up_with_silu_is_the_gemm_then_the_activation_bit_for_bit(ops, bits, inter,
                                                                       group, rows):
    """int_gemm_silu_and_mul pairs gate tile p with up tile p (tiles inter / 16 apart):
    exactly int_gemm's [gate | up] followed by the same build's silu_and_mul; one and six
    gate tiles (a thread's run of one, and of several with the next pair prefetched)."""
    generator = torch.Generator().manual_seed(bits + inter + rows)
    w = cpu_int_gemm.pack(quantize(torch.randn(2 * inter, 128, generator=generator), bits,
                                   group, torch.float32))
    x = torch.randn(rows, 128, generator=generator) * 3
    got = ops.int_gemm_silu_and_mul(x, w.codes, w.scales, w.zeros, w.bits, w.group_size,
                                    w.out_features)
    assert got.shape == (rows, inter)
    assert torch.equal(got, ops.silu_and_mul(gemm(ops, x, w)))
    assert ops.int_gemm_silu_and_mul(x[:0], w.codes, w.scales, w.zeros, w.bits,
                                     w.group_size, w.out_features).shape == (0, inter)


def test_gate_up_with_silu_needs_halves_that_start_on_a_tile(ops):
    w = cpu_int_gemm.pack(quantize(torch.randn(40, 64), 8, 32, torch.float32))  # 2 x 20
    assert not cpu_int_gemm.fuses_silu_and_mul(w)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        ops.int_gemm_silu_and_mul(torch.randn(2, 64), w.codes, w.scales, w.zeros, w.bits,
                                  w.group_size, w.out_features)


def test_linear_returns_the_inputs_dtype_and_adds_the_bias():
    w = cpu_int_gemm.pack(quantize(torch.randn(24, 64), 4, 32, torch.float32))
    x, bias = torch.randn(5, 64, dtype=torch.bfloat16), torch.randn(24, dtype=torch.bfloat16)
    y = cpu_int_gemm.int_linear(x, w, bias)
    assert y.dtype == torch.bfloat16
    expected = cpu_int_gemm.reference_linear(x, w).to(torch.bfloat16) + bias
    torch.testing.assert_close(y, expected, rtol=2e-2, atol=2e-2)
    assert cpu_int_gemm.int_linear(x[:0], w).shape == (0, 24)


@pytest.mark.parametrize("group", [32, 64])
def test_rows_written_later_replace_exactly_those_rows(group):
    """write_rows (weight updates, a fused projection's parts) across tile boundaries:
    rows 5..36 of 40 (three tiles touched), the others unchanged; with one group per row
    too (its scales' views then alias)."""
    old, new = torch.randn(40, 64), torch.randn(32, 64)
    weight = cpu_int_gemm.pack(quantize(old, 4, group, torch.float32))
    cpu_int_gemm.write_rows(weight, 5, quantize(new, 4, group, torch.float32))
    expected = dequantize(quantize(old, 4, group, torch.float32))
    expected[5:37] = dequantize(quantize(new, 4, group, torch.float32))
    assert torch.equal(cpu_int_gemm.dequantize(weight), expected)
    other = 96 - group
    with pytest.raises(ValueError, match=f"groups of {other}"):
        cpu_int_gemm.write_rows(weight, 0, quantize(new, 4, other, torch.float32))


def test_bad_shapes_and_layouts_are_refused_naming_them(ops):
    w = cpu_int_gemm.pack(quantize(torch.randn(16, 64), 4, 32, torch.float32))
    with pytest.raises(RuntimeError, match="x must be a contiguous fp32"):
        gemm(ops, torch.randn(2, 64, dtype=torch.float64), w)
    with pytest.raises(RuntimeError, match="codes must be contiguous uint8"):
        gemm(ops, torch.randn(2, 128), w)
    with pytest.raises(RuntimeError, match="does not fit"):
        ops.int_gemm(torch.randn(2, 64), w.codes, w.scales, w.zeros, 4, 32, 17)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.int_gemm(torch.randn(2, 64), w.codes, w.scales, w.zeros, 4, 16, 16)
    with pytest.raises(ValueError, match="act-order"):
        cpu_int_gemm.pack(replace(quantize(torch.randn(16, 64), 4, 32), perm=torch.arange(64)))


def test_the_ninja_package_builds_where_no_ninja_is_on_path(monkeypatch, tmp_path):
    """torch's builder runs `ninja` from PATH; a venv used without activating it has the
    ninja package's binary but not on PATH: load() puts it there."""
    monkeypatch.setenv("PATH", str(tmp_path))
    cpu_ops._ninja_on_path()
    assert shutil.which("ninja") is not None
