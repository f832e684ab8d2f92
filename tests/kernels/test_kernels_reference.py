"""kernels.reference against naive computations (here and in
tests/support/attention_batches.py, whose batches fill the paged cache by hand, every
slot no request owns holding NaN: a kernel that reads one of them cannot give a finite,
correct answer)."""

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
from pagellm.kernels import reference
from pagellm.kernels.reference import (
    DECODE_PADDING_SLACK,
    paged_attention,
    plan_attention,
    planned_attention,
    write_kv_cache,
)

# Our code and torch alone: the floors leg skips it (.ci/run).
pytestmark = pytest.mark.own_code

SENTINEL = -7.25  # exactly representable in every dtype tested


# --------------------------------------------------------------------------- write_kv_cache


def _slot(kv_cache: torch.Tensor, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(key, value) stored at flat slot `slot`: block slot // block_size, offset % it."""
    block_size = kv_cache.shape[2]
    return kv_cache[0, slot // block_size, slot % block_size], \
        kv_cache[1, slot // block_size, slot % block_size]


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_write_kv_cache_scatters_to_slots_and_leaves_the_rest(cache_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    num_blocks, block_size, num_kv_heads, head_dim = 6, 8, 3, 16
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), SENTINEL,
                          dtype=cache_dtype)
    num_slots = num_blocks * block_size
    # Slots in random order, crossing blocks, with padding (-1) at the start, middle and end.
    slots = torch.randperm(num_slots, generator=gen)[:11].tolist()
    slot_mapping = torch.tensor([-1, *slots[:5], -1, -1, *slots[5:], -1], dtype=torch.int64)
    num_tokens = slot_mapping.numel()
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)  # fp32: cast on write
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)

    write_kv_cache(key, value, kv_cache, slot_mapping)

    assert kv_cache.dtype == cache_dtype
    written = set()
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        written.add(slot)
        k, v = _slot(kv_cache, slot)
        assert torch.equal(k, key[token].to(cache_dtype)), (token, slot)
        assert torch.equal(v, value[token].to(cache_dtype)), (token, slot)
    for slot in set(range(num_slots)) - written:
        k, v = _slot(kv_cache, slot)
        assert bool((k == SENTINEL).all()) and bool((v == SENTINEL).all()), slot


def test_write_kv_cache_matches_flat_view_indexing() -> None:
    """The layout contract: slot s is kv_cache[0/1].view(-1, H_kv, D)[s]."""
    gen = torch.Generator().manual_seed(1)
    kv_cache = torch.full((2, 4, 16, 2, 8), SENTINEL)
    slot_mapping = torch.tensor([63, 0, 17, 16, 15, 40])
    key = torch.randn(6, 2, 8, generator=gen)
    value = torch.randn(6, 2, 8, generator=gen)
    expected = kv_cache.clone()
    for token, slot in enumerate(slot_mapping.tolist()):
        expected[0].view(-1, 2, 8)[slot] = key[token]
        expected[1].view(-1, 2, 8)[slot] = value[token]

    write_kv_cache(key, value, kv_cache, slot_mapping)

    assert torch.equal(kv_cache, expected)


def test_write_kv_cache_all_padding_writes_nothing() -> None:
    kv_cache = torch.full((2, 3, 4, 1, 8), SENTINEL)
    key = torch.randn(3, 1, 8)
    write_kv_cache(key, key.clone(), kv_cache, torch.tensor([-1, -1, -1]))
    assert bool((kv_cache == SENTINEL).all())


def test_write_kv_cache_keys_and_values_go_to_their_own_halves() -> None:
    kv_cache = torch.full((2, 2, 4, 1, 4), SENTINEL)
    key = torch.ones(1, 1, 4)
    value = torch.full((1, 1, 4), 2.0)
    write_kv_cache(key, value, kv_cache, torch.tensor([5]))
    assert torch.equal(kv_cache[0, 1, 1], torch.ones(1, 4))
    assert torch.equal(kv_cache[1, 1, 1], torch.full((1, 4), 2.0))


# --------------------------------------------------------------------------- paged_attention


def _check_against_naive(batch: Batch, block_size: int, dtype: torch.dtype,
                         sliding_window: int | None = None, softcap: float | None = None,
                         sinks: torch.Tensor | None = None) -> None:
    scale = batch.query.shape[-1] ** -0.5

    out = paged_attention(batch.query, batch.kv_cache, batch.block_tables,
                          batch.query_start_loc, batch.seq_lens, scale,
                          sliding_window=sliding_window, softcap=softcap, sinks=sinks).cpu()

    assert out.dtype == dtype
    assert out.shape == batch.query.shape
    expected = naive_attention(batch, scale, sliding_window, softcap, sinks)
    rtol, atol = TOLERANCES[dtype]
    for r in range(len(batch.seq_lens)):  # per request, so a failure names the case
        start, end = batch.query_start_loc[r], batch.query_start_loc[r + 1]
        assert bool(torch.isfinite(out[start:end]).all()), \
            f"request {r} {request_shapes(block_size)[r]} read an unwritten (NaN) slot"
        torch.testing.assert_close(
            out[start:end].double(), expected[start:end], rtol=rtol, atol=atol,
            msg=lambda m, r=r: f"request {r} (q_len, seq_len)="
                               f"{request_shapes(block_size)[r]}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [32, 64])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("gqa_ratio", [1, 2, 4, 7])
def test_paged_attention_matches_naive_dense_reference(gqa_ratio: int, block_size: int,
                                                       head_dim: int, dtype: torch.dtype
                                                       ) -> None:
    """Mixed batch, shuffled block tables, every slot no request owns holding NaN."""
    batch = make_batch(gqa_ratio * NUM_KV_HEADS, head_dim, block_size, dtype,
                        seed=gqa_ratio * 1000 + block_size + head_dim)
    _check_against_naive(batch, block_size, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("gqa_ratio", [1, 7])
def test_paged_attention_matches_naive_on_cuda(gqa_ratio: int, dtype: torch.dtype) -> None:
    """The torch backend on CUDA (attention_backend="torch" there), where SDPA picks
    other kernels than on the CPU: the first H200 run found its cuDNN kernel taking the
    fp32 mask as 16-bit values (errors up to 3.2 in bf16) until the mask followed the
    query's dtype."""
    batch = make_batch(gqa_ratio * NUM_KV_HEADS, 64, 16, dtype, seed=gqa_ratio)
    on_gpu = dataclasses.replace(batch, query=batch.query.cuda(),
                                 kv_cache=batch.kv_cache.cuda(),
                                 block_tables=batch.block_tables.cuda())
    _check_against_naive(on_gpu, 16, dtype)


@pytest.mark.parametrize("gqa_ratio", [1, 7])
def test_paged_attention_matches_naive_on_a_zeroed_cache(gqa_ratio: int) -> None:
    """The same mixed batch with unused slots zeroed: separates wrong arithmetic from
    reading slots that should never be read (the NaN-filled test above)."""
    batch = make_batch(gqa_ratio * NUM_KV_HEADS, 32, 16, torch.float32, seed=gqa_ratio,
                        fill=0.0)
    _check_against_naive(batch, 16, torch.float32)


@pytest.mark.parametrize("stale", [float("inf"), float("nan")])
def test_decode_padding_never_reads_a_finished_requests_stale_block(stale: float) -> None:
    """A zeroed cache is not enough: blocks are reused, and the model runner pads block
    table rows with block 0. If a finished request left non-finite K/V in block 0 (an
    fp16 overflow, say), a shorter decode batched with a longer one must not see it."""
    block_size, head_dim = 4, 8
    kv_cache = torch.zeros(2, 4, block_size, 1, head_dim)
    kv_cache[:, 0] = stale  # block 0: freed, still holding another request's values
    gen = torch.Generator().manual_seed(0)
    keys = [torch.randn(3, 1, head_dim, generator=gen), torch.randn(6, 1, head_dim, generator=gen)]
    values = [torch.randn(3, 1, head_dim, generator=gen),
              torch.randn(6, 1, head_dim, generator=gen)]
    kv_cache[0, 1, :3], kv_cache[1, 1, :3] = keys[0], values[0]  # request 0: block 1
    kv_cache[0, 2:].view(-1, 1, head_dim)[:6] = keys[1]  # request 1: blocks 2, 3
    kv_cache[1, 2:].view(-1, 1, head_dim)[:6] = values[1]
    block_tables = torch.tensor([[1, 0], [2, 3]], dtype=torch.int32)  # row 0 padded with 0
    query = torch.randn(2, 2, head_dim, generator=gen)
    batch = Batch(query, kv_cache, block_tables, [0, 1, 2], [3, 6], keys, values)

    out = paged_attention(query, kv_cache, block_tables, [0, 1, 2], [3, 6], 0.3)

    assert bool(torch.isfinite(out).all())
    torch.testing.assert_close(out.double(), naive_attention(batch, 0.3),
                               rtol=1e-5, atol=1e-5)


def test_paged_attention_uses_the_given_scale() -> None:
    batch = make_batch(4, 32, 16, torch.float32, seed=7, fill=0.0)
    for scale in (0.05, 0.5):
        out = paged_attention(batch.query, batch.kv_cache, batch.block_tables,
                              batch.query_start_loc, batch.seq_lens, scale)
        torch.testing.assert_close(out.double(), naive_attention(batch, scale),
                                   rtol=1e-5, atol=1e-5)


def test_paged_attention_is_independent_of_block_placement() -> None:
    """Moving every block to another id (and updating the table) changes nothing."""
    batch = make_batch(4, 32, 16, torch.float32, seed=11, fill=0.0)
    scale = 32 ** -0.5
    out = paged_attention(batch.query, batch.kv_cache, batch.block_tables,
                          batch.query_start_loc, batch.seq_lens, scale)
    perm = torch.randperm(batch.kv_cache.shape[1], generator=torch.Generator().manual_seed(3))
    moved = torch.empty_like(batch.kv_cache)
    moved[:, perm] = batch.kv_cache  # old block b now lives at perm[b]
    tables = perm[batch.block_tables.long()].to(torch.int32)
    out_moved = paged_attention(batch.query, moved, tables, batch.query_start_loc,
                                batch.seq_lens, scale)
    torch.testing.assert_close(out_moved, out, rtol=1e-6, atol=1e-6)


def test_decodes_of_very_different_lengths_split_into_groups_and_stay_exact() -> None:
    """One long context among short ones: padding every decode to the longest would copy
    the long one's length for each; the plan groups by length instead (bounded padding),
    and every group's output equals the naive reference, with every unowned slot NaN."""
    block_size, head_dim, num_heads = 16, 32, 4
    gen = torch.Generator().manual_seed(5)
    seq_lens = [9 * block_size + 3, 5, 17, 16, 2 * block_size, 1, 40]
    blocks_needed = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_needed) + 4
    kv_cache = torch.full((2, num_blocks, block_size, NUM_KV_HEADS, head_dim), float("nan"))
    order = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.zeros(len(seq_lens), max(blocks_needed), dtype=torch.int32)
    keys, values = [], []
    for i, (seq_len, n) in enumerate(zip(seq_lens, blocks_needed, strict=True)):
        own, order = order[:n], order[n:]
        block_tables[i, :n] = torch.tensor(own, dtype=torch.int32)
        pos = torch.arange(seq_len)
        keys.append(torch.randn(seq_len, NUM_KV_HEADS, head_dim, generator=gen))
        values.append(torch.randn(seq_len, NUM_KV_HEADS, head_dim, generator=gen))
        blocks = torch.tensor(own)[pos // block_size]
        kv_cache[0, blocks, pos % block_size] = keys[-1]
        kv_cache[1, blocks, pos % block_size] = values[-1]
    qsl = list(range(len(seq_lens) + 1))
    batch = Batch(torch.randn(len(seq_lens), num_heads, head_dim, generator=gen), kv_cache,
                   block_tables, qsl, seq_lens, keys, values)

    plan = plan_attention(block_tables, qsl, seq_lens, block_size)
    out = planned_attention(batch.query, kv_cache, plan, 0.2)

    assert len(plan.decodes) >= 2
    assert plan.decodes[0].rows.tolist() == [0]  # the long one pads nobody
    padded = sum(g.bias.shape[0] * g.bias.shape[-1] for g in plan.decodes)
    assert padded <= DECODE_PADDING_SLACK * sum(-(-n // block_size) * block_size
                                                for n in seq_lens)
    assert bool(torch.isfinite(out).all())
    torch.testing.assert_close(out.double(), naive_attention(batch, 0.2), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("seed", range(4))
def test_decode_plan_zeroes_exactly_the_gathered_rows_past_each_context(seed: int) -> None:
    """A gathered row holds position p of its own sequence (in a padding copy of its
    first block, p = offset in the block); it is stale exactly when p >= its length.
    The plan's stale rows, built from ranges, must be that set (brute force here), and
    its blocks the request's own, padded with its first."""
    gen = torch.Generator().manual_seed(seed)
    block_size = 4
    seq_lens = [*torch.randint(1, 30, (9,), generator=gen).tolist(), 1, 4, 5]
    table = torch.randint(0, 50, (len(seq_lens), 10), generator=gen, dtype=torch.int32)
    plan = plan_attention(table, list(range(len(seq_lens) + 1)), seq_lens, block_size)
    seen = []
    for group in plan.decodes:
        # None: one group of every request, in order (no sort needed)
        rows = list(range(len(seq_lens))) if group.rows is None else group.rows.tolist()
        seen += rows
        length = group.bias.shape[-1]
        nb = length // block_size
        expected_stale, expected_blocks = [], []
        for r, request in enumerate(rows):
            n, own = seq_lens[request], -(-seq_lens[request] // block_size)
            expected_blocks += [int(table[request, c if c < own else 0]) for c in range(nb)]
            for p in range(length):
                source = p if p < own * block_size else p % block_size
                if source >= n:
                    expected_stale.append(r * length + p)
            assert group.bias[r, 0, 0].isinf().tolist() == [p >= n for p in range(length)]
        stale = [] if group.stale is None else group.stale.tolist()
        assert sorted(stale) == expected_stale
        assert group.blocks.tolist() == expected_blocks
    assert sorted(seen) == list(range(len(seq_lens)))


def _greedy_groups(owned: list[int], slack: float) -> list[int]:
    """The grouping rule, one decode at a time: sorted longest first, a group grows
    while its padded blocks (its first's count per member) stay within `slack` times
    its members' own blocks. Returns the group sizes."""
    sizes: list[int] = []
    first, own = 0, 0
    for j, blocks in enumerate(owned):
        if j > first and owned[first] * (j - first + 1) > slack * (own + blocks):
            sizes.append(j - first)
            first, own = j, 0
        own += blocks
    return [*sizes, len(owned) - first] if owned else sizes


@pytest.mark.parametrize("seed", range(3))
def test_decode_groups_follow_the_greedy_padding_rule(seed: int) -> None:
    """The plan splits decodes (vectorized) exactly where the one-at-a-time rule does,
    over lengths from all-equal to widely spread."""
    rng = np.random.default_rng(seed)
    for _ in range(300):
        n = int(rng.integers(1, 80))
        block_size = int(rng.choice([1, 4, 16]))
        seq_lens = rng.integers(1, int(rng.choice([3, 50, 2000])), n)
        table = torch.zeros(n, 2000 // block_size + 1, dtype=torch.int32)
        plan = plan_attention(table, np.arange(n + 1), seq_lens, block_size)
        owned = sorted((-(-int(s) // block_size) for s in seq_lens), reverse=True)
        assert [n if g.rows is None else len(g.rows) for g in plan.decodes] == \
            _greedy_groups(owned, DECODE_PADDING_SLACK)


# --------------------------------------------------------------------------- sliding window
# and soft-capping. The mixed batch of `request_shapes` (block 16: contexts up to 49)
# against windows inside one block, across several, and longer than any context.


@pytest.mark.parametrize(("sliding_window", "softcap", "dtype"), [
    (1, None, torch.float32),  # only itself
    (5, None, torch.float32),  # smaller than a block
    (37, None, torch.float32),  # spanning several blocks
    (1000, None, torch.float32),  # longer than every context: causal
    (None, 1.5, torch.float32),  # soft-capped causal (scores ~ N(0, 1): the cap bites)
    (5, 1.5, torch.float32),
    (37, 1.5, torch.bfloat16),
    (20, None, torch.float16),
], ids=str)
def test_sliding_window_and_softcap_match_a_naive_masked_softmax(
        sliding_window: int | None, softcap: float | None, dtype: torch.dtype) -> None:
    """Fresh prompts, chunks continuing a context and decodes of varied lengths in one
    step, every slot no request owns NaN, against per-request dense attention with the
    mask written from the formula."""
    batch = make_batch(2 * NUM_KV_HEADS, 32, 16, dtype, seed=(sliding_window or 0) + 17)
    _check_against_naive(batch, 16, dtype, sliding_window, softcap)


@pytest.mark.parametrize(("sliding_window", "softcap"), [(3, None), (1, 2.0), (20, 2.0),
                                                         (None, 2.0)], ids=str)
def test_long_prompts_attend_tile_by_tile_exactly(monkeypatch: pytest.MonkeyPatch,
                                                  sliding_window: int | None,
                                                  softcap: float | None) -> None:
    """Windowed and soft-capped prompts run a tile of query rows at a time, each against
    only the keys its rows see: tiles of a few rows (and few soft-capped scores) must
    give the same attention as one tile."""
    monkeypatch.setattr(reference, "PREFILL_TILE_ROWS", 2)
    monkeypatch.setattr(reference, "SOFTCAP_SCORES", 300)
    batch = make_batch(2 * NUM_KV_HEADS, 32, 16, torch.float32, seed=3)
    _check_against_naive(batch, 16, torch.float32, sliding_window, softcap)


def _sinks(num_heads: int, seed: int) -> torch.Tensor:
    """gpt-oss-like sinks: around the scores' own size (N(0, 1) here), one large enough
    to take most of its head's weight and one far below every score."""
    sinks = torch.randn(num_heads, generator=torch.Generator().manual_seed(seed))
    sinks[0], sinks[-1] = 4.0, -30.0
    return sinks


@pytest.mark.parametrize(("sliding_window", "dtype"), [
    (None, torch.float32), (5, torch.float32), (37, torch.float32), (None, torch.bfloat16)],
    ids=str)
def test_sinks_match_a_naive_softmax_with_a_sink_column(sliding_window: int | None,
                                                        dtype: torch.dtype) -> None:
    """gpt-oss's attention sinks, on decodes, fresh prompts and chunks alike, against
    transformers' formula (the sink a column of the scores, dropped after the softmax);
    with and without a window; and not a no-op."""
    batch = make_batch(2 * NUM_KV_HEADS, 32, 16, dtype, seed=41)
    sinks = _sinks(2 * NUM_KV_HEADS, 5)
    _check_against_naive(batch, 16, dtype, sliding_window, None, sinks)
    scale = 32 ** -0.5
    without = paged_attention(batch.query, batch.kv_cache, batch.block_tables,
                              batch.query_start_loc, batch.seq_lens, scale,
                              sliding_window=sliding_window)
    with_sinks = paged_attention(batch.query, batch.kv_cache, batch.block_tables,
                                 batch.query_start_loc, batch.seq_lens, scale,
                                 sliding_window=sliding_window, sinks=sinks)
    assert not torch.allclose(with_sinks[:, 0].float(), without[:, 0].float(), atol=1e-2)
    torch.testing.assert_close(with_sinks[:, -1].float(), without[:, -1].float(),
                               rtol=0, atol=1e-2)  # a sink far below: no change


def test_sinks_in_long_prompts_attend_tile_by_tile(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiles of a few rows and scores give the same attention with sinks."""
    monkeypatch.setattr(reference, "PREFILL_TILE_ROWS", 2)
    monkeypatch.setattr(reference, "SOFTCAP_SCORES", 300)
    batch = make_batch(2 * NUM_KV_HEADS, 32, 16, torch.float32, seed=43)
    _check_against_naive(batch, 16, torch.float32, 3, None, _sinks(2 * NUM_KV_HEADS, 6))
    _check_against_naive(batch, 16, torch.float32, None, 2.0, _sinks(2 * NUM_KV_HEADS, 7))


def _first_window_block(q_len: int, seq_len: int, window: int, block_size: int) -> int:
    """The block holding the first key that the request's first query (at position
    seq_len - q_len) sees: the blocks before it are wholly outside every window."""
    return max(0, seq_len - q_len - window + 1) // block_size


@pytest.mark.parametrize("stale", [float("nan"), float("inf")])
@pytest.mark.parametrize(("sliding_window", "softcap"), [(5, None), (20, 2.0)], ids=str)
def test_blocks_wholly_outside_the_window_are_never_read(
        stale: float, sliding_window: int, softcap: float | None) -> None:
    """The KV cache manager frees the blocks wholly outside a request's windows while it
    runs; their table entries then name blocks other requests reuse. Filled with NaN or
    inf, they must not change the output (no 0 * NaN)."""
    block_size = 16
    batch = make_batch(2 * NUM_KV_HEADS, 32, block_size, torch.float32, seed=23)
    poisoned = 0
    for r, (q_len, seq_len) in enumerate(request_shapes(block_size)):
        skip = _first_window_block(q_len, seq_len, sliding_window, block_size)
        batch.kv_cache[:, batch.block_tables[r, :skip].long()] = stale
        poisoned += skip
    assert poisoned > 0  # (window 5: two decodes and a chunk, 4 blocks; 20: 1)
    _check_against_naive(batch, block_size, torch.float32, sliding_window, softcap)


def test_windowed_plans_gather_only_the_blocks_in_the_window() -> None:
    """A long context with a small window costs window-sized work: decodes gather the
    window's blocks (at most ceil(W / block) + 1 of them), a chunk its first query's
    window's blocks on. The table entries before them name block ids that do not exist:
    gathering one would raise."""
    block_size, window, head_dim = 16, 20, 32
    gen = torch.Generator().manual_seed(9)
    shapes = [(1, 40 * block_size + 7), (1, 25 * block_size), (8, 30 * block_size + 3),
              (1, 3)]  # (q_len, seq_len)
    num_blocks = 8 * len(shapes)
    kv_cache = torch.full((2, num_blocks, block_size, NUM_KV_HEADS, head_dim), float("nan"))
    max_blocks = max(-(-s // block_size) for _, s in shapes)
    block_tables = torch.full((len(shapes), max_blocks), 10**6, dtype=torch.int32)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    keys, values, queries, qsl = [], [], [], [0]
    for r, (q_len, seq_len) in enumerate(shapes):
        skip = _first_window_block(q_len, seq_len, window, block_size)
        owned = -(-seq_len // block_size)
        own, free = free[:owned - skip], free[owned - skip:]
        block_tables[r, skip:owned] = torch.tensor(own, dtype=torch.int32)
        k = torch.randn(seq_len, NUM_KV_HEADS, head_dim, generator=gen)
        v = torch.randn(seq_len, NUM_KV_HEADS, head_dim, generator=gen)
        pos = torch.arange(skip * block_size, seq_len)  # only the held blocks hold keys
        blocks = block_tables[r, pos // block_size].long()
        kv_cache[0, blocks, pos % block_size] = k[pos]
        kv_cache[1, blocks, pos % block_size] = v[pos]
        keys.append(k)
        values.append(v)
        queries.append(torch.randn(q_len, 4, head_dim, generator=gen))
        qsl.append(qsl[-1] + q_len)
    seq_lens = [s for _, s in shapes]
    batch = Batch(torch.cat(queries), kv_cache, block_tables, qsl, seq_lens, keys, values)

    plan = plan_attention(block_tables, qsl, seq_lens, block_size, sliding_window=window)
    out = planned_attention(batch.query, kv_cache, plan, 0.2, softcap=None)

    window_blocks = -(-window // block_size) + 1
    assert all(g.bias.shape[-1] <= window_blocks * block_size for g in plan.decodes)
    assert [p.blocks.numel() for p in plan.prefills] == [3]  # keys 456..482: 3 blocks
    assert bool(torch.isfinite(out).all())
    torch.testing.assert_close(out.double(), naive_attention(batch, 0.2, window),
                               rtol=1e-5, atol=1e-5)


def test_torch_backend_plans_each_window_once_a_step() -> None:
    """Layers alternate between a sliding window and full attention (Gemma 2/3): the
    backend plans a window the first time a step meets it, later layers reuse that plan,
    a window no shorter than every context is the step's causal plan, and the next
    step's prepare starts over."""
    block_size = 16
    batch = make_batch(2 * NUM_KV_HEADS, 32, block_size, torch.float32, seed=31)
    qsl, seq_lens = batch.query_start_loc, batch.seq_lens
    # The step's own keys and values (already in the cache: slots -1 write nothing).
    shapes = request_shapes(block_size)
    key = torch.cat([k[s - q:] for k, (q, s) in zip(batch.keys, shapes, strict=True)])
    value = torch.cat([v[s - q:] for v, (q, s) in zip(batch.values, shapes, strict=True)])
    backend = TorchAttention(block_size)
    meta = AttentionMetadata(
        slot_mapping=torch.full((qsl[-1],), -1), block_tables=batch.block_tables,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc_cpu=np.array(qsl), seq_lens_cpu=np.array(seq_lens),
        max_query_len=max(q for q, _ in shapes), backend=backend)
    backend.prepare(meta)
    scale = 32 ** -0.5
    for layer, (window, softcap) in enumerate([(5, None), (None, 2.0), (5, 2.0),
                                               (1000, None), (37, None)]):
        out = backend(batch.query, key, value, batch.kv_cache, meta, scale, window, softcap)
        torch.testing.assert_close(out.double(), naive_attention(batch, scale, window,
                                                                  softcap),
                                   rtol=1e-5, atol=1e-5, msg=lambda m, i=layer: f"{i}: {m}")
        if layer == 0:
            five = backend.window_plans[5]
    assert backend.window_plans[5] is five  # planned once, reused by layer 2
    assert backend.window_plans[5].sliding_window == 5
    assert backend.window_plans[1000] is meta.plan  # 1000 >= every context
    assert set(backend.window_plans) == {5, 1000, 37}
    backend.prepare(meta)
    assert backend.window_plans == {}
