"""The CPU's W8A8 GEMM (kernels/cpu_int8.py) against a hand computation: the int8 codes
multiplied in exact integer arithmetic, then both scales."""

from __future__ import annotations

import pytest
import torch

from pagellm.kernels import cpu_int8


@pytest.mark.parametrize(("rows", "n", "k"), [(1, 48, 64), (5, 96, 128), (33, 17, 40)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_is_the_integer_product_scaled(rows, n, k, dtype):
    generator = torch.Generator().manual_seed(rows * n + k)
    x = torch.randn(rows, k, generator=generator).to(dtype)
    weight = torch.randn(n, k, generator=generator) * 0.1
    bias = torch.randn(n, generator=generator).to(dtype)
    w = cpu_int8.quantize_weight(weight)
    xq, x_scale = cpu_int8.quantize_rows(x)
    exact = xq.long() @ w.weight.long().t()  # [rows, n]: the int32 accumulator's value
    expected = (exact.double() * x_scale.double() * w.scale.double()).to(dtype) + bias
    got = cpu_int8.int8_linear(x, w, bias)
    assert got.dtype == dtype and got.shape == (rows, n)
    torch.testing.assert_close(got, expected, rtol=1e-5 if dtype == torch.float32 else 1e-2,
                               atol=1e-5 if dtype == torch.float32 else 1e-2)


def test_quantization_lands_within_half_a_step_and_zero_rows_stay_zero():
    t = torch.randn(16, 256, generator=torch.Generator().manual_seed(0))
    t[3] = 0.0
    q, scale = cpu_int8.quantize_rows(t)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127
    error = (cpu_int8.dequantize_rows(q, scale) - t).abs()
    assert bool((error <= scale / 2 + 1e-7).all())
    assert not q[3].any()


def test_narrow_and_no_rows():
    w = cpu_int8.quantize_weight(torch.randn(32, 64))
    part = w.narrow(0, 8, 16)
    assert torch.equal(part.weight, w.weight[8:24]) and torch.equal(part.scale, w.scale[:, 8:24])
    assert w.narrow(1, 0, 32).shape == (32, 32)
    assert cpu_int8.int8_linear(torch.empty(0, 64), w).shape == (0, 32)
