"""executor/model/mamba2.py against independent references: the chunked and recurrent
forms of the state-space scan against a token-by-token loop written from Mamba-2's
definition, and the whole mixer, stepped through a request's tokens in pieces, against
transformers' own Mamba-2 layer (GraniteMoeHybridMambaLayer) over the whole sequence."""

from __future__ import annotations

import pytest
import torch
from step_metadata import step_meta

from pagellm.executor.model.mamba2 import CHUNK, Mamba2Mixer, ssd_chunked, ssd_steps
from pagellm.executor.model.parallel import TensorParallel
from pagellm.executor.model.stateful import ConvBatch


def _ssd_reference(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   c: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba-2's scan token by token, from its definition (float64): h <- exp(dt a) h +
    dt b x^T; y = h^T c. x: [L, H, P]; dt: [L, H]; a: [H]; b, c: [L, H, N]; h: [H, N, P]
    -> (y [L, H, P], the final h)."""
    h = h.double().clone()
    out = []
    for t in range(x.shape[0]):
        step = dt[t].double()
        h = h * (step * a.double()).exp()[:, None, None] \
            + step[:, None, None] * torch.einsum("hn,hp->hnp", b[t].double(), x[t].double())
        out.append(torch.einsum("hnp,hn->hp", h, c[t].double()))
    return torch.stack(out), h


def _inputs(length: int, heads: int = 3, n: int = 8, p: int = 6, seed: int = 0
            ) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(length, heads, p, generator=gen)
    dt = 0.5 * torch.rand(length, heads, generator=gen)
    # dt a in (-0.05, 0]: a memory that lasts past a block of 64, so what one block
    # leaves the next is large enough to check
    a = -0.1 * torch.rand(heads, generator=gen)
    b, c = (torch.randn(length, heads, n, generator=gen) for _ in range(2))
    h = torch.randn(heads, n, p, generator=gen)
    return x, dt, a, b, c, h


def _as_attention(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                  c: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The scan's inputs as mamba2.py's rules take them: (q, k, v, g) = (c, dt b, x, dt a)."""
    return c, b * dt[..., None], x, dt * a


@pytest.mark.parametrize("length", [1, 5, CHUNK, CHUNK + 7, 2 * CHUNK + 1])
def test_the_chunked_scan_equals_the_state_space_model_token_by_token(length: int) -> None:
    """Blocks of 64 (and a partial one, padded), from a non-zero memory: the outputs
    and the memory left behind equal the token loop's."""
    x, dt, a, b, c, h = _inputs(length, seed=length)
    expected, final = _ssd_reference(x, dt, a, b, c, h)
    memory = h.clone()
    q, k, v, g = _as_attention(x, dt, a, b, c)
    out = ssd_chunked(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), g.t(), memory)
    torch.testing.assert_close(out.transpose(0, 1).double(), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(memory.double(), final, rtol=1e-4, atol=1e-4)


def test_the_recurrent_steps_advance_each_requests_memory_as_the_model_does() -> None:
    """Four requests, one token each, three steps in a row: each request's outputs and
    memory equal its own token loop's."""
    requests = [_inputs(3, seed=10 + i) for i in range(4)]
    memory = torch.stack([r[5] for r in requests])  # [R, H, N, P]
    outs = []
    for t in range(3):
        per_token = [_as_attention(*(r[i][t] for i in (0, 1)), r[2], r[3][t], r[4][t])
                     for r in requests]
        q, k, v, g = (torch.stack([inputs[i] for inputs in per_token]) for i in range(4))
        outs.append(ssd_steps(q, k, v, g, memory))
    for i, (x, dt, a, b, c, h) in enumerate(requests):
        expected, final = _ssd_reference(x, dt, a, b, c, h)
        torch.testing.assert_close(torch.stack([o[i] for o in outs]).double(), expected,
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(memory[i].double(), final, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("groups", [1, 2])
def test_the_mixer_stepped_through_a_request_equals_transformers_mamba2_layer(
        groups: int) -> None:
    """transformers' Mamba-2 layer (Granite 4.0-H's) over two whole sequences; ours over
    the same tokens in steps (a prompt chunk of 70, longer than a block, with another
    request's one-token steps beside it, then one-token steps and a chunk of 9), each
    request in its own state row: the same outputs. 4 heads reading 1 or 2 groups' B
    and C (the norm's statistic per group), biases on the convolution."""
    import inspect

    from transformers import GraniteMoeHybridConfig
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import (
        GraniteMoeHybridMambaLayer,
        GraniteMoeHybridRMSNormGated,
    )

    from pagellm.executor.model.registry import read_spec

    norm_args = inspect.signature(GraniteMoeHybridRMSNormGated.__init__).parameters
    if groups > 1 and "group_size" not in norm_args:
        pytest.skip("this transformers' gated norm takes one statistic over all groups "
                    "(5.0; per group from later releases, as mamba_ssm's): no reference")
    config = GraniteMoeHybridConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        layer_types=["mamba", "attention"], mamba_n_heads=4, mamba_n_groups=groups,
        mamba_d_state=8, mamba_d_head=16, mamba_d_conv=4, mamba_expand=2,
        mamba_conv_bias=True, shared_intermediate_size=32, num_local_experts=0,
        architectures=["GraniteMoeHybridForCausalLM"])
    theirs = GraniteMoeHybridMambaLayer(config, 0).eval()
    gen = torch.Generator().manual_seed(groups)
    with torch.no_grad():
        for name, param in theirs.named_parameters():
            scale = {"A_log": 0.3, "dt_bias": 0.5, "D": 0.2, "norm.weight": 0.1}.get(name, 0.3)
            base = {"A_log": -2.0, "D": 1.0, "norm.weight": 1.0}.get(name, 0.0)
            param.copy_(base + scale * torch.randn(param.shape, generator=gen))
    spec = read_spec(config)
    assert spec.mamba is not None
    ours = Mamba2Mixer(spec, spec.mamba, TensorParallel.layout(spec))
    ours.load_state_dict(theirs.state_dict())
    seqs = [torch.randn(n, 32, generator=gen) for n in (82, 5)]
    with torch.no_grad():
        expected = [theirs(s[None])[0] for s in seqs]
    steps = [{0: 70, 1: 1}, {0: 1, 1: 1}, {0: 1, 1: 3}, {0: 1}, {0: 9}]
    rows = [2, 0]
    state = torch.zeros(3, ours.state_size())
    done, got = [0, 0], [[], []]
    with torch.no_grad():
        for step in steps:
            reqs = list(step)
            meta = step_meta([step[r] for r in reqs], [rows[r] for r in reqs])
            x = torch.cat([seqs[r][done[r]:done[r] + step[r]] for r in reqs])
            out = ours(x, ConvBatch.of(meta, 4, torch.device("cpu")), meta, state)
            for r, piece in zip(reqs, out.split([step[r] for r in reqs]), strict=True):
                got[r].append(piece)
                done[r] += step[r]
    assert done == [82, 5]
    for r in range(2):
        torch.testing.assert_close(torch.cat(got[r]), expected[r], rtol=1e-4, atol=1e-4)
    assert (state[1] == 0).all()  # the row no request uses


def test_one_token_requests_in_scattered_rows_advance_only_their_own_memories() -> None:
    """scan_requests over a decode step of five requests in rows [4, 1, 2, 7, 0] (three
    runs of consecutive rows, out of order) beside a prompt chunk in row 5: each
    request's output and memory equal its own token loop's; rows 3 and 6 stay as they
    were."""
    from pagellm.executor.model.stateful import scan_requests

    rows, lengths = [4, 1, 2, 7, 0, 5], [1, 1, 1, 1, 1, 9]
    requests = [_inputs(n, seed=30 + i) for i, n in enumerate(lengths)]
    memory = torch.randn(8, 3, 8, 6, generator=torch.Generator().manual_seed(1))
    before = memory.clone()
    for row, r in zip(rows, requests, strict=True):
        memory[row] = r[5]
    inputs = [torch.cat(parts) for parts in zip(*(_as_attention(x, dt, a.expand(len(x), -1), b, c)
                                                 for x, dt, a, b, c, _ in requests),
                                                strict=True)]
    out = scan_requests(ssd_steps, ssd_chunked, inputs, memory, step_meta(lengths, rows))
    at = 0
    for row, (x, dt, a, b, c, h) in zip(rows, requests, strict=True):
        expected, final = _ssd_reference(x, dt, a, b, c, h)
        torch.testing.assert_close(out[at:at + len(x)].double(), expected, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(memory[row].double(), final, rtol=1e-4, atol=1e-4)
        at += len(x)
    assert torch.equal(memory[[3, 6]], before[[3, 6]])
