"""The CPU's C++ decode attention (csrc/cpu_attention.cpp, `paged_decode_attention`)
against float64 attention over the same keys (tests/support/attention_batches.py: block
tables shuffled, every slot no request owns NaN), and the torch backend that runs it for
the one-token queries of mixed steps (executor/model/attention.py). Both builds run: the
native one (AVX-512) and the portable plain loops."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from attention_batches import (
    NUM_KV_HEADS,
    TOLERANCES,
    Batch,
    make_batch,
    naive_attention,
    request_shapes,
)

from pagellm.executor.model.attention import AttentionMetadata, TorchAttention
from pagellm.kernels import cpu_ops

pytestmark = pytest.mark.own_code

# One query each, contexts across block boundaries, one exactly a block, a single key.
DECODES = [(1, 1), (1, 16), (1, 17), (1, 40), (1, 95)]


@pytest.fixture(params=[False, True], ids=["native", "portable"])
def ops(request):
    return cpu_ops.load(portable=request.param)


def _attend(ops, batch: Batch, scale: float, window: int | None = None,
            softcap: float | None = None) -> torch.Tensor:
    return ops.paged_decode_attention(batch.query, batch.kv_cache, batch.block_tables,
                                      torch.tensor(batch.seq_lens, dtype=torch.int32),
                                      scale, window, softcap)


# Requests a step: with 2 threads (the conftest's), 1 splits its heads one by one over
# them, 5 by the heads of a KV head, 10 by request (cpu_attention.cpp's work items).
BATCHES = {"1": DECODES[-1:], "5": DECODES, "10": DECODES + DECODES[::-1]}


@pytest.mark.parametrize("requests", BATCHES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 40])  # 40: no whole 16-lane vectors at the end
@pytest.mark.parametrize("gqa_ratio", [1, 3])
def test_decodes_match_float64_attention(ops, gqa_ratio: int, head_dim: int,
                                         dtype: torch.dtype, requests: str):
    batch = make_batch(gqa_ratio * NUM_KV_HEADS, head_dim, 16, dtype, seed=gqa_ratio + head_dim,
                       shapes=BATCHES[requests])
    scale = head_dim ** -0.5
    out = _attend(ops, batch, scale)
    assert out.dtype == dtype and out.shape == batch.query.shape
    assert bool(torch.isfinite(out).all())  # no slot past a context was read
    rtol, atol = TOLERANCES[dtype]
    torch.testing.assert_close(out.double(), naive_attention(batch, scale), rtol=rtol,
                               atol=atol)


@pytest.mark.parametrize("window, softcap", [(5, None), (16, None), (None, 2.0), (7, 1.5)])
def test_a_window_and_a_softcap_match_float64_attention(ops, window: int | None,
                                                       softcap: float | None):
    """Mutation check: neither may be a no-op (the same batch without them differs)."""
    batch = make_batch(2 * NUM_KV_HEADS, 32, 16, torch.float32, seed=3, shapes=DECODES)
    out = _attend(ops, batch, 0.5, window, softcap)
    torch.testing.assert_close(out.double(), naive_attention(batch, 0.5, window, softcap),
                               rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out, _attend(ops, batch, 0.5), rtol=1e-3, atol=1e-3)


def test_bf16_weighs_the_values_with_bf16_weights(ops):
    """As SDPA's bf16 kernel (and transformers) do: scores and softmax in fp32, the
    weights rounded to bf16 before they multiply the values, the sum in fp32, the output
    rounded once. The emulation here sums in another order and the portable build takes
    glibc's exp, so a few outputs may sit a unit apart; with fp32 weights a third do."""
    batch = make_batch(4 * NUM_KV_HEADS, 64, 16, torch.bfloat16, seed=5,
                       shapes=[(1, 300), (1, 257), (1, 64)])
    scale = 0.125
    out = _attend(ops, batch, scale)
    expected = torch.empty_like(out)
    for r, _ in enumerate(batch.seq_lens):
        k, v = batch.keys[r].float(), batch.values[r].float()  # [L, H_kv, D]
        for h in range(batch.query.shape[1]):
            g = h // 4
            s = (k[:, g] @ batch.query[r, h].float()) * scale  # [L]
            e = torch.exp(s - s.max())
            expected[r, h] = ((e.bfloat16().float() @ v[:, g]) / e.sum()).bfloat16()
    same = (out == expected).double().mean()
    assert same > 0.97, f"{same:.3f} of the outputs equal"  # (fp32 weights: 0.63)
    torch.testing.assert_close(out, expected, rtol=2.0**-7, atol=1e-4)


def test_bad_tables_and_inputs_are_refused_by_name(ops):
    batch = make_batch(2 * NUM_KV_HEADS, 32, 16, torch.float32, seed=9, shapes=DECODES)
    lens = torch.tensor(batch.seq_lens, dtype=torch.int32)
    q, cache, tables = batch.query, batch.kv_cache, batch.block_tables
    bad = tables.clone()
    bad[4, 2] = cache.shape[1]  # request 4 needs 6 blocks: its third is out of range
    with pytest.raises(RuntimeError, match="outside the KV cache"):
        ops.paged_decode_attention(q, cache, bad, lens, 1.0, None, None)
    with pytest.raises(RuntimeError, match="sees at least itself"):
        ops.paged_decode_attention(q, cache, tables, lens * 0, 1.0, None, None)
    with pytest.raises(RuntimeError, match="more blocks than the block table holds"):
        ops.paged_decode_attention(q, cache, tables[:, :2], lens, 1.0, None, None)
    with pytest.raises(RuntimeError, match="of q's dtype"):
        ops.paged_decode_attention(q.bfloat16(), cache, tables, lens, 1.0, None, None)
    with pytest.raises(RuntimeError, match="multiple of the 2 KV heads"):
        ops.paged_decode_attention(q[:, :3], cache, tables, lens, 1.0, None, None)
    with pytest.raises(RuntimeError, match="sliding window must be at least 1"):
        ops.paged_decode_attention(q, cache, tables, lens, 1.0, 0, None)


def test_the_torch_backend_attends_a_mixed_steps_decodes_with_it():
    """Prompts, later chunks and decodes interleaved (request_shapes): the decodes go
    through the C++ op, the rest through the reference plan, each into its own rows; a
    decode-only step goes through the op alone. Layers with and without a window and a
    softcap share the step."""
    ops = cpu_ops.load()
    batch = make_batch(3 * NUM_KV_HEADS, 32, 16, torch.float32, seed=11)
    backend = TorchAttention(16, ops.paged_decode_attention)
    meta = _metadata(batch, backend)
    backend.prepare(meta)
    assert meta.plan is not None and meta.plan.decodes == []  # planned for the op
    # The step's own keys and values (already in the cache: slots -1 write nothing).
    shapes = request_shapes(16)
    key, value = (torch.cat([t[s - q:] for t, (q, s) in zip(ts, shapes, strict=True)])
                  for ts in (batch.keys, batch.values))
    for window, softcap in [(None, None), (5, None), (None, 2.0), (1000, None)]:
        out = backend(batch.query, key, value, batch.kv_cache, meta, 0.3, window, softcap)
        torch.testing.assert_close(out.double(), naive_attention(batch, 0.3, window, softcap),
                                   rtol=1e-5, atol=1e-5)
    decodes = make_batch(3 * NUM_KV_HEADS, 32, 16, torch.float32, seed=12, shapes=DECODES)
    meta = _metadata(decodes, backend)
    backend.prepare(meta)
    key, value = (torch.stack([t[-1] for t in ts]) for ts in (decodes.keys, decodes.values))
    out = backend(decodes.query, key, value, decodes.kv_cache, meta, 0.3)
    torch.testing.assert_close(out.double(), naive_attention(decodes, 0.3), rtol=1e-5,
                               atol=1e-5)


def _metadata(batch: Batch, backend: TorchAttention) -> AttentionMetadata:
    qsl = np.array(batch.query_start_loc)
    return AttentionMetadata(
        slot_mapping=torch.full((int(qsl[-1]),), -1), block_tables=batch.block_tables,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(batch.seq_lens, dtype=torch.int32),
        query_start_loc_cpu=qsl, seq_lens_cpu=np.array(batch.seq_lens),
        max_query_len=int(np.diff(qsl).max()), backend=backend)
