"""The CPU's C++ attention (csrc/cpu_attention.cpp): `paged_decode_attention` against
float64 attention over the same keys (tests/support/attention_batches.py: block tables
shuffled, every slot no request owns NaN), `prefill_attention` against float64 causal
attention of prompts and later chunks (rows past the keys NaN), and the torch backend
that runs both in mixed steps (executor/model/attention.py). Both builds run: the native
one (AVX-512) and the portable plain loops."""

from __future__ import annotations

import dataclasses
import math

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
            softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    return ops.paged_decode_attention(batch.query, batch.kv_cache, batch.block_tables,
                                      torch.tensor(batch.seq_lens, dtype=torch.int32),
                                      scale, window, softcap, sinks)


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


@pytest.mark.parametrize("requests", ["1", "10"])
def test_one_plane_expanded_to_keys_and_values_reads_each_key_as_its_value(ops, requests):
    """DeepSeek's latent is its own value: the cache's V half is a stride-0 view of its
    K half (executor/worker/model_runner.py); the op reads values at the keys' memory,
    as attention whose values are the keys (float64)."""
    batch = make_batch(16, 48, 16, torch.float32, seed=5, shapes=BATCHES[requests])
    one = batch.kv_cache[:1].clone()
    shared = dataclasses.replace(batch, kv_cache=one.expand(2, *one.shape[1:]))
    out = _attend(ops, shared, 0.2)
    expected = naive_attention(dataclasses.replace(batch, values=batch.keys), 0.2)
    rtol, atol = TOLERANCES[torch.float32]
    torch.testing.assert_close(out.double(), expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize("window, softcap", [(5, None), (16, None), (None, 2.0), (7, 1.5)])
def test_a_window_and_a_softcap_match_float64_attention(ops, window: int | None,
                                                       softcap: float | None):
    """Mutation check: neither may be a no-op (the same batch without them differs)."""
    batch = make_batch(2 * NUM_KV_HEADS, 32, 16, torch.float32, seed=3, shapes=DECODES)
    out = _attend(ops, batch, 0.5, window, softcap)
    torch.testing.assert_close(out.double(), naive_attention(batch, 0.5, window, softcap),
                               rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out, _attend(ops, batch, 0.5), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("requests", ["1", "5", "10"])  # each of the three work splits
@pytest.mark.parametrize("window", [None, 7])
def test_sinks_match_float64_attention(ops, window: int | None, requests: str):
    """gpt-oss's attention sinks: one logit per head in the softmax's denominator (a
    large one takes most of head 0's weight, a small one leaves the last head as it
    was), per head under every way the op splits its work."""
    heads = 3 * NUM_KV_HEADS
    batch = make_batch(heads, 32, 16, torch.float32, seed=11, shapes=BATCHES[requests])
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(2))
    sinks[0], sinks[-1] = 4.0, -30.0
    out = _attend(ops, batch, 0.5, window, None, sinks)
    torch.testing.assert_close(out.double(), naive_attention(batch, 0.5, window, None, sinks),
                               rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out[:, 0], _attend(ops, batch, 0.5, window)[:, 0], atol=1e-3)
    with pytest.raises(RuntimeError, match="sinks must be"):
        _attend(ops, batch, 0.5, window, None, sinks[:-1])


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


@pytest.mark.parametrize("requests", ["1", "10"])
def test_fp32_queries_read_a_bf16_cache_in_fp32(ops, requests: str):
    """kv_cache_dtype="bfloat16" under an fp32 model: the keys and values are the bf16
    cache's, widened; the queries and the attention weights stay fp32 (pairing the
    queries as bf16, or rounding the weights, as a bf16 model's are, would be off by
    bf16's 1e-2, not fp32's 1e-5)."""
    batch = make_batch(3 * NUM_KV_HEADS, 64, 16, torch.bfloat16, seed=21,
                       shapes=BATCHES[requests])
    query = torch.randn(batch.query.shape, generator=torch.Generator().manual_seed(3))
    batch = dataclasses.replace(batch, query=query)  # fp32 values, not bf16 ones
    out = _attend(ops, batch, 0.125)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), naive_attention(batch, 0.125), rtol=1e-5,
                               atol=1e-5)


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
    with pytest.raises(RuntimeError, match="of q's dtype or bf16"):
        ops.paged_decode_attention(q.bfloat16(), cache, tables, lens, 1.0, None, None)
    with pytest.raises(RuntimeError, match="multiple of the 2 KV heads"):
        ops.paged_decode_attention(q[:, :3], cache, tables, lens, 1.0, None, None)
    with pytest.raises(RuntimeError, match="sliding window must be at least 1"):
        ops.paged_decode_attention(q, cache, tables, lens, 1.0, 0, None)


# (queries, keys): whole prompts (Q == L) inside one 16-query tile, across tiles and
# across 16-key tiles, one token; later chunks (Q < L) of one and of several tiles.
PROMPTS = [(1, 1), (5, 5), (16, 16), (17, 17), (40, 40), (3, 40), (20, 95), (33, 50)]


def _prompt(shape: tuple[int, int], heads: int, kv_heads: int, head_dim: int,
            dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    """q [Q, H, D], k and v [L, H_kv, D] as a step holds them: rows of one projection
    output (strided), and NaN in the rows after the last key, where a read past the
    keys would show."""
    q_len, seq_len = shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(q_len, heads + 2, head_dim, generator=g).to(dtype)[:, :heads]
    kv = torch.randn(2, seq_len + 16, kv_heads + 1, head_dim, generator=g).to(dtype)
    kv[:, seq_len:] = math.nan
    return q, kv[0, :seq_len, :kv_heads], kv[1, :seq_len, :kv_heads]


def _causal_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
                      ) -> torch.Tensor:
    """float64 (naive_attention on one request): query i of Q at position L - Q + i sees
    keys j <= that position."""
    one = Batch(query=q, kv_cache=torch.empty(0), block_tables=torch.empty(0),
                query_start_loc=[0, q.shape[0]], seq_lens=[k.shape[0]], keys=[k], values=[v])
    return naive_attention(one, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 40])
@pytest.mark.parametrize("gqa_ratio", [1, 3])
def test_prompts_match_float64_causal_attention(ops, gqa_ratio: int, head_dim: int,
                                                dtype: torch.dtype):
    scale = head_dim ** -0.5
    rtol, atol = TOLERANCES[dtype]
    for i, shape in enumerate(PROMPTS):
        q, k, v = _prompt(shape, gqa_ratio * NUM_KV_HEADS, NUM_KV_HEADS, head_dim, dtype,
                          seed=i)
        out = ops.prefill_attention(q, k, v, scale)
        assert out.dtype == dtype and out.shape == q.shape
        assert bool(torch.isfinite(out).all()), shape  # nothing past the keys was read
        torch.testing.assert_close(out.double(), _causal_reference(q, k, v, scale),
                                   rtol=rtol, atol=atol, msg=lambda m, s=shape: f"{s}: {m}")


def test_bf16_prompts_round_their_weights_as_sdpa_does(ops):
    """torch's SDPA (the path this op replaced) rounds the attention weights to bf16
    before they weigh the values; so does the op, and most outputs are then equal
    (their sums' order differs). Weights left in fp32 agree far less often."""
    q, k, v = _prompt((136, 136), 9, 3, 64, torch.bfloat16, seed=5)
    out = ops.prefill_attention(q, k, v, 0.125)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)), is_causal=True,
        enable_gqa=True, scale=0.125)[0].transpose(0, 1)
    unrounded = _causal_reference(q, k, v, 0.125).to(torch.bfloat16)
    assert (out == sdpa).float().mean() > 0.9
    assert (unrounded == sdpa).float().mean() < 0.8


def test_bad_prompt_inputs_are_refused_by_name(ops):
    q, k, v = _prompt((5, 8), 6, 2, 32, torch.float32, seed=1)
    with pytest.raises(RuntimeError, match="must all be fp32 or all bf16"):
        ops.prefill_attention(q.bfloat16(), k, v, 1.0)
    with pytest.raises(RuntimeError, match="L >= 5 queries"):
        ops.prefill_attention(q, k[:4], v[:4], 1.0)
    with pytest.raises(RuntimeError, match="H_kv dividing 5 heads"):
        ops.prefill_attention(q[:, :5], k, v, 1.0)
    with pytest.raises(RuntimeError, match="contiguous heads"):
        ops.prefill_attention(q, k.transpose(0, 1).contiguous().transpose(0, 1), v, 1.0)
    with pytest.raises(RuntimeError, match="tokens, heads, head_dim"):
        ops.prefill_attention(q[0], k, v, 1.0)


def test_the_torch_backend_attends_a_mixed_steps_decodes_with_it():
    """Prompts, later chunks and decodes interleaved (request_shapes): the decodes go
    through the decode op, the prompts and chunks through the prefill op (but under a
    window or softcap, through the reference plan's), each into its own rows; a
    decode-only step goes through the decode op alone. Layers with and without a window
    and a softcap share the step."""
    ops = cpu_ops.load()
    batch = make_batch(3 * NUM_KV_HEADS, 32, 16, torch.float32, seed=11)
    prompts: list[int] = []  # the queries of each prefill op call

    def prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
                ) -> torch.Tensor:
        prompts.append(q.shape[0])
        return ops.prefill_attention(q, k, v, scale)

    backend = TorchAttention(16, ops.paged_decode_attention, prefill)
    meta = _metadata(batch, backend)
    backend.prepare(meta)
    assert meta.plan is not None and meta.plan.decodes == []  # planned for the op
    # The step's own keys and values (already in the cache: slots -1 write nothing).
    shapes = request_shapes(16)
    key, value = (torch.cat([t[s - q:] for t, (q, s) in zip(ts, shapes, strict=True)])
                  for ts in (batch.keys, batch.values))
    for window, softcap in [(None, None), (5, None), (None, 2.0), (1000, None)]:
        prompts.clear()
        out = backend(batch.query, key, value, batch.kv_cache, meta, 0.3, window, softcap)
        torch.testing.assert_close(out.double(), naive_attention(batch, 0.3, window, softcap),
                                   rtol=1e-5, atol=1e-5)
        # (a window that holds every context whole is full attention: the op's)
        assert prompts == ([q for q, _ in shapes if q > 1] if window in (None, 1000)
                           and softcap is None else [])
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
