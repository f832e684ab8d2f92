"""The decoder's elementwise steps in C++ on the CPU (kernels/cpu_fused.py,
csrc/cpu_elementwise.cpp) against the torch code they replace there
(layers.RMSNorm.reference, F.silu(gate) * up, rope.rotate): bit-equal where torch only
rounds exact products and sums (the residual add, the rotary embedding, bf16's SiLU),
within fp32's rounding where a mean's summation order or an exp's last bit may differ.
Inputs are strided views of wider tensors, as the decoder's qkv and gate_up splits are,
with widths that leave the vector loops a scalar tail."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagellm.executor.model.layers import RMSNorm
from pagellm.executor.model.rope import rotate
from pagellm.kernels import cpu_fused

pytestmark = pytest.mark.own_code
DTYPES = [torch.float32, torch.bfloat16]


def close_to_fp32_rounding(got: torch.Tensor, expected: torch.Tensor) -> None:
    """fp32: within a few ulps; bf16: equal but for rare one-ulp steps where an fp32
    difference crossed a rounding boundary (a wrong formula is off everywhere)."""
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=4e-7, atol=1e-7)
    else:
        torch.testing.assert_close(got.float(), expected.float(), rtol=2**-7, atol=0)
        assert (got == expected).float().mean() > 0.999


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [576, 40])
def test_rms_norm_with_and_without_the_residual(dtype, width):
    generator = torch.Generator().manual_seed(width)
    norm = RMSNorm(width, 1e-5)
    norm.weight.data = torch.randn(width, generator=generator).to(dtype)
    wide = torch.randn(37, width + 8, generator=generator).to(dtype) * 3
    x = wide[:, 8:]  # rows width + 8 apart
    residual = torch.randn(37, width, generator=generator).to(dtype)
    out, total = cpu_fused.rms_norm(x, norm.weight, 1e-5, residual)
    expected_out, expected_total = norm.reference(x, residual)
    assert torch.equal(total, expected_total)
    close_to_fp32_rounding(out, expected_out)
    out, total = cpu_fused.rms_norm(x, norm.weight, 1e-5)
    assert total is x
    close_to_fp32_rounding(out, norm.reference(x)[0])


def test_rms_norm_promotes_a_wider_weight_as_torch_does():
    """An fp32 weight over bf16 activations: the normed rows rounded to bf16, then
    multiplied in fp32 (the output fp32)."""
    norm = RMSNorm(64, 1e-6)
    norm.weight.data = torch.randn(64)
    x = torch.randn(5, 64).to(torch.bfloat16)
    out, _ = cpu_fused.rms_norm(x, norm.weight, 1e-6)
    assert out.dtype == torch.float32
    close_to_fp32_rounding(out, norm.reference(x)[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1536, 40])
def test_silu_and_mul(dtype, width):
    generator = torch.Generator().manual_seed(width)
    gate_up = (torch.randn(21, 2 * width + 4, generator=generator) * 4).to(dtype)[:, 4:]
    gate_up[0, :3] = torch.tensor([-100.0, 100.0, 0.0])  # exp's clamp, and 0
    gate, up = gate_up.split(width, dim=-1)
    got = cpu_fused.silu_and_mul(gate_up)
    close_to_fp32_rounding(got, F.silu(gate) * up)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 80])
def test_rotary_is_bit_equal(dtype, head_dim):
    """q as the decoder takes it, a view of the qkv rows (9 heads of 15); head_dim 80
    leaves the vector loop 8 dimensions of each half."""
    generator = torch.Generator().manual_seed(head_dim)
    tokens = 19
    qkv = torch.randn(tokens, 15 * head_dim, generator=generator).to(dtype)
    q = qkv[:, :9 * head_dim].view(tokens, 9, head_dim)
    cos = torch.randn(tokens, 1, head_dim, generator=generator).to(dtype)
    sin = torch.randn(tokens, 1, head_dim, generator=generator).to(dtype)
    got = cpu_fused.rotary(q, cos, sin)
    assert got.is_contiguous() and torch.equal(got, rotate(q, cos, sin))


def test_empty_batches_and_bad_inputs_are_refused_by_name():
    weight = torch.ones(8)
    out, total = cpu_fused.rms_norm(torch.zeros(0, 8), weight, 1e-6)
    assert out.shape == (0, 8) and total.shape == (0, 8)
    assert cpu_fused.silu_and_mul(torch.zeros(0, 16)).shape == (0, 8)
    with pytest.raises(RuntimeError, match="weight must be a contiguous"):
        cpu_fused.rms_norm(torch.zeros(2, 8), torch.ones(7), 1e-6)
    with pytest.raises(RuntimeError, match="residual must be x's shape and dtype"):
        cpu_fused.rms_norm(torch.zeros(2, 8), weight, 1e-6, torch.zeros(2, 8).double())
    with pytest.raises(RuntimeError, match="x must be an fp32 or bf16"):
        cpu_fused.rms_norm(torch.zeros(2, 8).half(), weight.half(), 1e-6)
    with pytest.raises(RuntimeError, match="gate_up must be"):
        cpu_fused.silu_and_mul(torch.zeros(2, 7))
    with pytest.raises(RuntimeError, match="cos and signed_sin must be"):
        cpu_fused.rotary(torch.zeros(2, 3, 8), torch.zeros(2, 1, 6), torch.zeros(2, 1, 6))
