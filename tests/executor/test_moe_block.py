"""The CPU's mixture-of-experts block (executor/model/moe.py) against a token-by-token
torch reference written here: out[t] = sum over the token's top k of its routing weight
times the expert's SwiGLU MLP. A batch takes the grouped path (pairs sorted by expert),
one token its own (its experts in turn, batch-1 decode); packed experts (int4, the
CPU's int kernel) against the same reference on their dequantized weights with the
activations rounded as the kernel rounds them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pagellm.executor.model.moe import experts_grouped, quantize_experts
from pagellm.kernels import cpu_int_gemm

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from moe_layer import block  # (benchmarks/ is scripts: the layer moe_layer.py times)

HIDDEN, INTER, EXPERTS, TOP_K = 64, 32, 8, 2


def reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor, rounded=lambda a: a) -> torch.Tensor:
    """Token by token in fp64; `rounded`: what each expert projection's input becomes
    (the int kernel's activation rounding)."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gate_up = rounded(x[t:t + 1]).double() @ w13[e].double().t()
            h = (F.silu(gate_up[:, :INTER]) * gate_up[:, INTER:]).float()
            out[t] += float(weights[t, k]) * (rounded(h).double() @ w2[e].double().t())[0]
    return out


@pytest.mark.parametrize("packed", [False, True], ids=["fp32", "int4"])
def test_a_batch_and_each_token_alone_give_the_reference(packed):
    layer = block(EXPERTS, TOP_K, HIDDEN, INTER, "fp32")
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        weights, ids = layer.route(x)
        assert len(set(ids.flatten().tolist())) > TOP_K  # the tokens' experts differ
        w13, w2 = layer.experts.gate_up_proj.clone(), layer.experts.down_proj.clone()
        rounded = lambda a: a  # noqa: E731
        if packed:
            quantize_experts(layer, 4, triton=False)
            codes = (layer.experts.gate_up_codes, layer.experts.down_codes)
            w13, w2 = (cpu_int_gemm.dequantize(c.quant).reshape(EXPERTS, -1, c.quant.shape[1])
                       for c in codes)
            rounded = cpu_int_gemm.quantize_activations
        expected = reference(x, w13, w2, weights, ids, rounded)
        batch = experts_grouped(x, layer.experts, weights, ids)
        alone = torch.cat([experts_grouped(x[t:t + 1], layer.experts, weights[t:t + 1],
                                           ids[t:t + 1]) for t in range(x.shape[0])])
    scale = expected.abs().max().item()
    for got in (batch, alone):
        torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-5 * scale)
