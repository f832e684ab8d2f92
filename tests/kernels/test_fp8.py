"""FP8 W8A8 (kernels/fp8.py) against hand computations: e4m3 rounding bounds, the
scaled GEMM against dequantize-then-matmul in fp32, and each token's result independent
of the batch it is in (per-token activation scales). torch's `_scaled_mm` runs on the
CPU too (slowly), so this runs everywhere."""

from __future__ import annotations

import torch

from pagellm.kernels import fp8

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_rows_round_within_e4m3s_precision():
    """Each row's largest magnitude maps to 448 exactly; every element is within half
    an e4m3 step of its value: 2^-4 relative for normal numbers (3 mantissa bits), and
    half the subnormal step (2^-10 of the scale) near zero."""
    gen = torch.Generator().manual_seed(0)
    t = torch.randn(6, 100, generator=gen) * torch.tensor([1e-3, 1.0, 5.0, 80.0, 1e4, 0.0])[:, None]
    q, scale = fp8.quantize_rows(t)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (6, 1)
    back = fp8.dequantize_rows(q, scale)
    bound = torch.maximum(t.abs() * 2**-4, scale * 2**-10)
    assert ((back - t).abs() <= bound * (1 + 1e-6)).all()
    assert torch.equal(q.float().abs().amax(dim=1)[:5], torch.full((5,), 448.0))
    assert torch.equal(back[5], torch.zeros(100))  # an all-zero row stays zero


def test_the_scaled_gemm_equals_dequantize_then_matmul_and_ignores_the_batch():
    gen = torch.Generator().manual_seed(1)
    w = fp8.quantize_weight(torch.randn(48, 64, generator=gen).to(DEVICE))
    x = (torch.randn(5, 64, generator=gen) * torch.tensor([0.1, 1, 10, 100, 1])[:, None])
    bias = torch.randn(48, generator=gen)
    out = fp8.fp8_linear(x.to(DEVICE), w, bias.to(DEVICE)).cpu()
    assert out.dtype == torch.float32 and out.shape == (5, 48)
    xq, x_scale = fp8.quantize_rows(x)
    expected = fp8.dequantize_rows(xq, x_scale) @ fp8.dequantize_rows(
        w.weight.cpu(), w.scale.cpu().t()).t() + bias
    tol = 1e-2 if DEVICE == "cuda" else 1e-5  # CUDA writes bf16 (module docstring)
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol * expected.abs().max().item())
    # Row i alone gives what it gave among the others, up to the GEMM's summation
    # order: a scale shared by the batch would quantize row 0 (values near 0.1) on the
    # step of row 3 (near 100), about 1000x coarser, and move it by far more.
    for i in range(5):
        alone = fp8.fp8_linear(x[i:i + 1].to(DEVICE), w, bias.to(DEVICE)).cpu()
        torch.testing.assert_close(alone[0], out[i], rtol=tol, atol=tol * out[i].abs().max())
