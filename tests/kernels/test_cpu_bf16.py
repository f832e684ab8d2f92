"""The CPU's bf16 GEMV (csrc/cpu_bf16.cpp, `bf16_linear`) against fp64: each output is
the exact sum of the bf16 products, accumulated in fp32 and rounded once to bf16. Both
builds run: the native one (AVX-512, AVX512-BF16's dot products where the CPU has them;
a one-row path when K is a multiple of 64) and the portable plain loops."""

from __future__ import annotations

import pytest
import torch

from pagellm.kernels import cpu_ops

pytestmark = pytest.mark.own_code


@pytest.fixture(params=[False, True], ids=["native", "portable"])
def ops(request):
    return cpu_ops.load(portable=request.param)


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("n, k", [(13, 40), (96, 576), (64, 2048), (7, 3)])
def test_bf16_linear_rounds_the_fp32_sum_once(ops, rows: int, n: int, k: int):
    """Inputs are bf16 (so their products are exact in fp64); the result is within one
    rounding to bf16 (half a unit in the last place) plus fp32's summation error of
    the exact sum, and equal to the exact sum rounded to bf16 wherever that sum is not
    within fp32's error of a rounding boundary. A wrong row, column, tail mask or
    conversion is off by whole units."""
    gen = torch.Generator().manual_seed(rows * 1000 + k)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    exact = x.double() @ w.double().t()  # [rows, n]
    y = ops.bf16_linear(x, w)
    assert y.shape == (rows, n) and y.dtype == torch.bfloat16
    # fp32 summation of k products: |error| <= k * 2^-24 * sum |x_i w_i| (loose bound)
    sum_error = k * 2.0**-24 * (x.double().abs() @ w.double().abs().t())
    half_ulp = exact.abs() * 2.0**-8  # bf16 keeps 8 significant bits
    assert ((y.double() - exact).abs() <= half_ulp + sum_error + 1e-30).all()
    # Where the exact sum is not near a rounding boundary (a margin of 16 units of fp32
    # over sum |x_i w_i|: ten times the error fp32 sums of random terms make) the result
    # is that sum rounded.
    margin = 2.0**-20 * (x.double().abs() @ w.double().abs().t())
    clear = (exact.bfloat16().double() - exact).abs() < half_ulp - margin
    assert clear.float().mean() > 0.5  # most entries are far from a boundary
    assert torch.equal(y[clear], exact.bfloat16()[clear])


def test_bf16_linear_refuses_what_it_does_not_take(ops):
    x, w = torch.ones(1, 8).bfloat16(), torch.ones(4, 8).bfloat16()
    with pytest.raises(RuntimeError, match="1 to 4 rows"):
        ops.bf16_linear(torch.ones(5, 8).bfloat16(), w)
    with pytest.raises(RuntimeError, match="contiguous bf16"):
        ops.bf16_linear(x.float(), w)
    with pytest.raises(RuntimeError, match="contiguous bf16"):
        ops.bf16_linear(x, torch.ones(8, 4).bfloat16().t())
    with pytest.raises(RuntimeError, match="x \\[M, K\\] and w \\[N, K\\]"):
        ops.bf16_linear(x, torch.ones(4, 9).bfloat16())
