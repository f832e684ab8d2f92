"""The sampler's argmax in C++ (csrc/cpu_sampling.cpp) against torch's argmax, on the
native build (AVX-512 where the CPU has it) and the portable plain loops: ties, NaN in
the vector part and in the scalar tail, all--inf rows, rows apart in memory, widths
under, at and past one vector."""

from __future__ import annotations

import math

import pytest
import torch

from pagellm.executor.worker.sampler import argmax_rows
from pagellm.kernels import cpu_ops

pytestmark = pytest.mark.own_code


@pytest.fixture(params=[False, True], ids=["native", "portable"])
def ops(request):
    return cpu_ops.load(portable=request.param)


@pytest.mark.parametrize("width", [1, 15, 16, 49, 3001])
def test_each_rows_first_maximal_index_as_torch_argmax(ops, width):
    generator = torch.Generator().manual_seed(width)
    wide = torch.randint(-3, 4, (12, width + 5), generator=generator).float()
    x = wide[:, 5:]  # rows width + 5 apart; small integers: many ties
    x[0] = -math.inf
    x[1, width // 2] = math.nan
    x[2, -1] = math.nan  # in the scalar tail past the last whole vector
    x[3, -1] = 9.0  # the maximum in the tail
    x[4, 0] = x[4, -1] = 9.0  # tied at both ends: the first
    x[5] = torch.randn(width, generator=generator)
    got = ops.argmax_rows(x)
    assert got.dtype == torch.int64
    assert got.tolist() == x.argmax(dim=-1).tolist()


def test_no_rows_and_bad_inputs(ops):
    assert ops.argmax_rows(torch.empty(0, 7)).shape == (0,)
    with pytest.raises(RuntimeError, match="fp32 CPU tensor"):
        ops.argmax_rows(torch.zeros(2, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="contiguous rows"):
        ops.argmax_rows(torch.zeros(2, 16)[:, ::2])


def test_the_sampler_takes_it_for_fp32_logits(monkeypatch):
    """argmax_rows goes through the op for fp32 rows (and through torch's max for
    others): the op's answer is what the sampler returns."""
    calls = []
    real = cpu_ops.load()

    class Spy:
        def argmax_rows(self, x):
            calls.append(x.shape)
            return real.argmax_rows(x)

    monkeypatch.setattr(cpu_ops, "load", lambda portable=False: Spy())
    logits = torch.randn(3, 100)
    assert argmax_rows(logits).tolist() == logits.argmax(dim=-1).tolist()
    assert argmax_rows(logits.to(torch.bfloat16)).tolist() == \
        logits.to(torch.bfloat16).argmax(dim=-1).tolist()
    assert calls == [(3, 100)]
