"""executor/model/stateful.py and qwen3_5.py's delta rule against independent torch
references: the convolution over each request's carried state against F.conv1d over the
whole sequence, however the steps split it; the chunked and recurrent forms of the gated
delta rule against a token-by-token loop written from the rule's definition."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from step_metadata import step_meta

from pagellm.executor.model.qwen3_5 import CHUNK, delta_rule_chunked, delta_rule_steps
from pagellm.executor.model.stateful import ConvBatch


@pytest.mark.parametrize("kernel", [3, 4])
def test_the_convolution_over_carried_state_equals_conv1d_over_the_whole_sequence(
        kernel: int) -> None:
    """Three requests of 11, 5 and 1 tokens, cut into steps of different chunks (a
    prompt in pieces, one-token steps, requests joining late), each in its own row of
    a 6-row state: every token's output equals torch's causal depthwise conv1d (with
    bias) over its request's whole sequence."""
    gen = torch.Generator().manual_seed(0)
    channels, p = 8, kernel - 1
    weight = torch.randn(channels, 1, kernel, generator=gen)
    bias = torch.randn(channels, generator=gen)
    lengths, rows = [11, 5, 1], [4, 0, 2]
    seqs = [torch.randn(n, channels, generator=gen) for n in lengths]
    expected = [F.conv1d(s.t()[None], weight, bias, padding=p, groups=channels)[0, :, :len(s)].t()
                for s in seqs]
    steps = [{0: 4}, {0: 3, 1: 2}, {0: 1, 1: 1}, {0: 2, 1: 2, 2: 1}, {0: 1}]
    state = torch.zeros(6, p, channels)
    state[[1, 3, 5]] = 7.0  # rows no request uses: must stay as they are
    done = [0] * 3
    got: list[list[torch.Tensor]] = [[] for _ in lengths]
    for step in steps:
        reqs = list(step)
        meta = step_meta([step[r] for r in reqs], [rows[r] for r in reqs])
        x = torch.cat([seqs[r][done[r]:done[r] + step[r]] for r in reqs])
        out = ConvBatch.of(meta, kernel, torch.device("cpu")).convolve(x, weight, bias, state)
        for r, piece in zip(reqs, out.split([step[r] for r in reqs]), strict=True):
            got[r].append(piece)
            done[r] += step[r]
    assert done == lengths
    for r in range(3):
        torch.testing.assert_close(torch.cat(got[r]), expected[r], rtol=1e-5, atol=1e-5)
    assert (state[[1, 3, 5]] == 7.0).all()


def _delta_rule_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                          beta: torch.Tensor, memory: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule token by token, from its definition (float64): S <- exp(g) S;
    S <- S + k (beta (v - S^T k))^T; o = S^T q. q, k: [L, H, dk]; v: [L, H, dv]; g,
    beta: [L, H]; memory: [H, dk, dv] -> (o [L, H, dv], the final memory)."""
    s = memory.double().clone()
    out = []
    for t in range(q.shape[0]):
        s = s * g[t].double().exp()[:, None, None]
        kt, vt = k[t].double(), v[t].double()
        recalled = torch.einsum("hkv,hk->hv", s, kt)
        s = s + torch.einsum("hk,hv->hkv", kt, beta[t].double()[:, None] * (vt - recalled))
        out.append(torch.einsum("hkv,hk->hv", s, q[t].double()))
    return torch.stack(out), s


def _inputs(length: int, heads: int = 3, dk: int = 8, dv: int = 6, seed: int = 0
            ) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q, k = (F.normalize(torch.randn(length, heads, dk, generator=gen), dim=-1)
            for _ in range(2))
    v = torch.randn(length, heads, dv, generator=gen)
    # log-decays in (-0.05, 0]: a memory that lasts past a block of 64 (exp(-1.6) on
    # average), so what one block leaves the next is large enough to check
    g = -0.05 * torch.rand(length, heads, generator=gen)
    beta = torch.rand(length, heads, generator=gen)
    memory = torch.randn(heads, dk, dv, generator=gen)
    return q, k, v, g, beta, memory


@pytest.mark.parametrize("length", [1, 5, CHUNK, CHUNK + 7, 2 * CHUNK + 1])
def test_the_chunked_delta_rule_equals_the_rule_token_by_token(length: int) -> None:
    """Blocks of 64 (and a partial one, padded), from a non-zero memory: the outputs
    and the memory left behind equal the token loop's."""
    q, k, v, g, beta, memory = _inputs(length, seed=length)
    expected, final = _delta_rule_reference(q, k, v, g, beta, memory)
    state = memory.clone()
    out = delta_rule_chunked(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                             g.t(), beta.t(), state)
    torch.testing.assert_close(out.transpose(0, 1).double(), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state.double(), final, rtol=1e-4, atol=1e-4)


def test_the_recurrent_steps_advance_each_requests_memory_as_the_rule_does() -> None:
    """Four requests, one token each, three steps in a row: each request's outputs and
    memory equal its own token loop's (the batch dimension mixes nothing)."""
    requests = [_inputs(3, seed=10 + i) for i in range(4)]
    memory = torch.stack([r[5] for r in requests])  # [R, H, dk, dv]
    outs = []
    for t in range(3):
        q, k, v, g, beta = (torch.stack([r[i][t] for r in requests]) for i in range(5))
        outs.append(delta_rule_steps(q, k, v, g, beta, memory))
    for i, (q, k, v, g, beta, start) in enumerate(requests):
        expected, final = _delta_rule_reference(q, k, v, g, beta, start)
        torch.testing.assert_close(torch.stack([o[i] for o in outs]).double(), expected,
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(memory[i].double(), final, rtol=1e-5, atol=1e-5)
