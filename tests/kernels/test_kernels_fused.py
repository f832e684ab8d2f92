"""The decoder's fused Triton kernels (kernels/triton_fused.py) against the torch code
they replace on CUDA (decoder.RMSNorm.reference, F.silu * up, rope.rotate), through
Triton's interpreter on the CPU (TRITON_INTERPRET=1, set in conftest) or on a GPU.

Shapes are chosen to hit the kernels' edges: sizes that are not powers of two (masked
columns and heads), a row wider than one program's block (SiLU-and-mul), and inputs
that are strided views of a wider tensor, as the decoder's qkv and gate_up splits are."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import runs_triton_kernels

from pagellm.executor.model.layers import RMSNorm
from pagellm.executor.model.rope import RopeSpec, RotaryEmbedding, rotate
from pagellm.kernels import fused_for
from pagellm.kernels import triton_attention as ta
from pagellm.kernels import triton_fused as tf

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = runs_triton_kernels


def assert_matches(got: torch.Tensor, expected: torch.Tensor, exact: bool) -> None:
    """Compiled, `exact` results must be bit-equal. bf16 from the interpreter is not: it
    truncates fp32 -> bf16 instead of rounding, at every intermediate rounding, so a
    difference of two such terms can be off by an ulp of the terms, not of the result:
    there the bound is two ulps of the largest value (a wrong formula is off by O(1))."""
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if got.dtype == torch.bfloat16 and ta.interpreting():
        scale = expected.float().abs().max().item()
        torch.testing.assert_close(got.float(), expected.float(), rtol=0, atol=2**-6 * scale)
    elif exact:
        assert torch.equal(got, expected), (got - expected).abs().max()
    else:  # fp32 reduction order (the RMSNorm's mean): a rounding step at most
        rtol = 2**-7 if got.dtype == torch.bfloat16 else 1e-6
        torch.testing.assert_close(got, expected, rtol=rtol, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_matches_the_torch_module(dtype, with_residual):
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(96, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96, generator=gen))
    norm = norm.to(DEVICE, dtype)
    wide = torch.randn(5, 3 * 96, generator=gen).to(DEVICE, dtype)
    x = wide[:, 96:192]  # a strided view, as a split of a wider projection is
    residual = torch.randn(5, 96, generator=gen).to(DEVICE, dtype) if with_residual else None

    out, total = tf.rms_norm(x, norm.weight, norm.eps, residual)
    expected_out, expected_total = norm.reference(x, residual)

    assert_matches(total, expected_total, exact=True)  # x + residual: one rounding
    assert_matches(out, expected_out, exact=False)
    if residual is None:
        assert total is x  # as the torch module: the sum is x itself


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("width", [40, 1100])  # 1100: two programs per row
def test_silu_and_mul_matches_torch(dtype, width):
    gen = torch.Generator().manual_seed(1)
    gate_up = (3 * torch.randn(3, 2 * width + 7, generator=gen)).to(DEVICE, dtype)
    gate_up = gate_up[:, 7:]  # a strided view
    gate, up = gate_up.split(width, dim=-1)
    got = tf.silu_and_mul(gate_up)
    expected = F.silu(gate) * up
    # exp differs from torch's by an ulp of fp32 at most: exact after bf16 rounding
    # nearly always, so compare to a rounding step
    assert_matches(got, expected, exact=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("heads", "head_dim"), [(5, 64), (3, 80)])
def test_rotary_matches_rope_rotate(dtype, heads, head_dim):
    """On a slice of a wider qkv row, with real cos/sin tables at scattered positions.
    Many of them: an unrounded product (a fused multiply-add) was 1 bf16 ulp off the
    torch code on the H200 in about one value of 10^4, unseen in a few hundred."""
    gen = torch.Generator().manual_seed(2)
    rope = RotaryEmbedding(RopeSpec("default", 10000.0), head_dim, 4096).to(DEVICE)
    rope.reset_cache()
    tokens = 256
    positions = torch.cat([torch.tensor([0, 7, 300, 4095]),
                           torch.randint(0, 4096, (tokens - 4,), generator=gen)]).to(DEVICE)
    cos, sin = rope.cos_sin(positions, dtype)
    qkv = (4 * torch.randn(tokens, heads + 2, head_dim, generator=gen)).to(DEVICE, dtype)
    x = qkv[:, :heads]
    got = tf.rotary(x, cos, sin)
    assert got.is_contiguous()
    assert_matches(got, rotate(x, cos, sin), exact=True)


def test_fused_kernels_by_device():
    """The decoder's switch: CUDA tensors take these kernels, fp32 and bf16 CPU ones the
    C++ ops (kernels/cpu_fused.py), other CPU dtypes the torch code."""
    from pagellm.kernels import cpu_fused

    assert fused_for(torch.zeros(1)) is cpu_fused
    assert fused_for(torch.zeros(1, dtype=torch.bfloat16)) is cpu_fused
    assert fused_for(torch.zeros(1, dtype=torch.float16)) is None
    if torch.cuda.is_available():
        assert fused_for(torch.zeros(1, device="cuda")) is tf


def test_empty_batches_launch_nothing():
    weight = torch.ones(8, device=DEVICE)
    out, total = tf.rms_norm(torch.zeros(0, 8, device=DEVICE), weight, 1e-6)
    assert out.shape == (0, 8) and total.shape == (0, 8)
    assert tf.silu_and_mul(torch.zeros(0, 16, device=DEVICE)).shape == (0, 8)
    cos = torch.zeros(0, 1, 8, device=DEVICE)
    assert tf.rotary(torch.zeros(0, 2, 8, device=DEVICE), cos, cos).shape == (0, 2, 8)
