"""The model's Linear layer: its fused gate_up-and-SiLU path (quantize.py's
quantized_silu_and_mul) against its own two steps, and where it declines."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagellm.executor.model.layers import Linear
from pagellm.kernels import cpu_int_gemm
from pagellm.kernels.quant import quantize

pytestmark = pytest.mark.own_code


def _int_linear(out_features: int, bias: bool = False) -> Linear:
    layer = Linear(64, out_features, bias=bias)
    layer.quant = cpu_int_gemm.pack(quantize(torch.randn(out_features, 64), 8, 32,
                                             torch.float32))
    return layer


def test_an_int_gate_up_projection_fuses_the_silu_exactly():
    layer, x = _int_linear(64), torch.randn(5, 64)
    gate, up = layer(x).split(32, dim=-1)
    assert torch.equal(layer.silu_and_mul(x), cpu_int_gemm.int_linear_silu_and_mul(x, layer.quant))
    torch.testing.assert_close(layer.silu_and_mul(x), F.silu(gate) * up, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", ["dense", "bias", "bf16 input", "halves off a tile"])
def test_it_declines_what_it_cannot_fuse(case):
    x = torch.randn(3, 64)
    layer = {"dense": Linear(64, 64, bias=False), "bias": _int_linear(64, bias=True),
             "bf16 input": _int_linear(64), "halves off a tile": _int_linear(40)}[case]
    assert layer.silu_and_mul(x.bfloat16() if case == "bf16 input" else x) is None
