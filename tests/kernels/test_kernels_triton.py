"""The Triton kernels against their torch references (kernels/reference.py, itself
checked against naive attention in test_kernels_reference.py), through Triton's
interpreter on the CPU (TRITON_INTERPRET=1, set in conftest) or on a GPU."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
from conftest import runs_triton_kernels

from pagellm.kernels import reference
from pagellm.kernels import triton_attention as tk

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NUM_KV_HEADS = 2

# (query tokens this step, context length after it): a decode, a whole prompt, a later
# chunk, a context that ends exactly on a block boundary, a one-token prompt, a chunk
# that crosses a block boundary, a long decode.
MIXED = [(1, 37), (20, 20), (9, 41), (1, 32), (1, 1), (5, 21), (1, 70)]


def make_batch(requests: list[tuple[int, int]], num_heads: int, head_dim: int,
               block_size: int, dtype: torch.dtype, seed: int = 0):
    """A paged cache filled through shuffled block tables (unused slots NaN, table rows
    padded with arbitrary blocks), queries, and the metadata both kernels take."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-seq // block_size) for _, seq in requests]
    num_blocks = sum(blocks_per_req) + 3
    order = torch.randperm(num_blocks, generator=gen)
    cache = torch.full((2, num_blocks, block_size, NUM_KV_HEADS, head_dim), float("nan"))
    max_blocks = max(blocks_per_req) + 2
    tables = torch.randint(0, num_blocks, (len(requests), max_blocks), generator=gen)
    used = 0
    for i, ((_, seq), nb) in enumerate(zip(requests, blocks_per_req, strict=True)):
        tables[i, :nb] = order[used:used + nb]
        used += nb
        for pos in range(seq):
            block, slot = int(tables[i, pos // block_size]), pos % block_size
            cache[:, block, slot] = torch.randn(2, NUM_KV_HEADS, head_dim, generator=gen)
    query_lens = [q for q, _ in requests]
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    query = torch.randn(qsl[-1], num_heads, head_dim, generator=gen)
    return (query.to(dtype).to(DEVICE), cache.to(dtype).to(DEVICE),
            tables.to(torch.int32).to(DEVICE), qsl, [seq for _, seq in requests])


def run_both(query, cache, tables, qsl, seq_lens, num_segments=1, tile=None,
             sliding_window=None, softcap=None, reference_cache=None, sinks=None):
    """(Triton's output, the reference's), the reference on `reference_cache` if given."""
    scale = query.shape[-1] ** -0.5
    expected = reference.paged_attention(
        query, cache if reference_cache is None else reference_cache, tables, qsl, seq_lens,
        scale, sliding_window=sliding_window, softcap=softcap,
        sinks=None if sinks is None else sinks.cpu())
    got = tk.paged_attention(
        query, cache, tables, torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), scale,
        max_query_len=max(b - a for a, b in itertools.pairwise(qsl)),
        num_segments=num_segments, tile=tile, sliding_window=sliding_window,
        softcap=softcap, sinks=sinks)
    return got, expected


TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}

CASES = (
    # GQA ratios 1, 2, 4, 7
    [(g, 64, 16, torch.float32) for g in (1, 2, 4, 7)]
    # every supported head size
    + [(2, d, 32, torch.float32) for d in (16, 32, 80, 96, 128, 256)]
    # half precisions
    + [(4, 64, 16, torch.float16), (4, 64, 16, torch.bfloat16), (7, 128, 32, torch.bfloat16)]
)


@runs_triton_kernels
@pytest.mark.parametrize(("group", "head_dim", "block_size", "dtype"), CASES,
                         ids=lambda v: str(v).removeprefix("torch."))
def test_paged_attention_matches_reference_on_a_mixed_batch(group, head_dim, block_size,
                                                            dtype):
    batch = make_batch(MIXED, NUM_KV_HEADS * group, head_dim, block_size, dtype)
    got, expected = run_both(*batch)
    assert got.dtype == dtype and got.shape == expected.shape
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), expected.float(), rtol=0, atol=TOLERANCE[dtype])


@runs_triton_kernels
@pytest.mark.parametrize(("tile", "num_segments"), [(16, 1), (32, 1), (128, 1), (128, 2)])
def test_every_tile_size_gives_the_reference_attention(tile, num_segments):
    """Keys per loop iteration (`tile_keys` picks one per shape): one block, several,
    and more than the longest block-table row holds (128 keys = 8 blocks against rows of
    7 columns). Keys of a tile past the sequence sit in NaN-filled slots or in blocks
    that are not the request's, so counting any of them shows."""
    requests = MIXED if num_segments == 1 else [(1, 100), (1, 33), (1, 16), (1, 70)]
    batch = make_batch(requests, NUM_KV_HEADS * 2, 64, 16, torch.float32, seed=tile)
    query, cache, tables, qsl, seq_lens = batch
    expected = reference.paged_attention(query, cache, tables, qsl, seq_lens, 0.125)
    got = tk.paged_attention(
        query, cache, tables, torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), 0.125,
        max_query_len=max(b - a for a, b in itertools.pairwise(qsl)),
        num_segments=num_segments, tile=tile)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


@runs_triton_kernels
@pytest.mark.parametrize(("group", "num_segments"), [(1, 2), (2, 4), (4, 4), (7, 2)])
def test_split_kv_decode_matches_reference(group, num_segments):
    # Few requests with long contexts, one segment left empty for the short one.
    decodes = [(1, 100), (1, 33), (1, 16), (1, 130)]
    batch = make_batch(decodes, NUM_KV_HEADS * group, 64, 16, torch.float32, seed=3)
    got, expected = run_both(*batch, num_segments=num_segments)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


# Sliding windows (a query at p sees keys p - W < j <= p) and Gemma 2's soft-capping.
# MIXED's contexts reach 70 keys; tiles of 64 keys (fp32, head 64) over blocks of 16.
DECODES = [(1, 100), (1, 33), (1, 16), (1, 130)]


@runs_triton_kernels
@pytest.mark.parametrize(("sliding_window", "softcap", "dtype"), [
    (5, None, torch.float32),  # inside one block
    (37, None, torch.float32),  # across several blocks and tiles
    (1000, None, torch.float32),  # longer than every context
    (None, 1.5, torch.float32),
    (20, 1.5, torch.bfloat16),
], ids=str)
def test_sliding_window_and_softcap_match_reference(sliding_window, softcap, dtype):
    batch = make_batch(MIXED, NUM_KV_HEADS * 2, 64, 16, dtype, seed=4)
    got, expected = run_both(*batch, sliding_window=sliding_window, softcap=softcap)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), expected.float(), rtol=0, atol=TOLERANCE[dtype])


@runs_triton_kernels
@pytest.mark.parametrize(("sliding_window", "softcap", "tile"), [(40, None, 16), (40, 1.5, 32),
                                                                 (7, None, 64)], ids=str)
def test_split_kv_decode_with_a_window_matches_reference(sliding_window, softcap, tile):
    """Split-KV slices the window's tiles, not the whole context: with 4 segments some
    are empty (the short decodes), the merge must still weigh the rest right."""
    batch = make_batch(DECODES, NUM_KV_HEADS * 2, 64, 16, torch.float32, seed=6)
    got, expected = run_both(*batch, num_segments=4, tile=tile,
                             sliding_window=sliding_window, softcap=softcap)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


@runs_triton_kernels
@pytest.mark.parametrize(("requests", "num_segments", "sliding_window", "dtype"), [
    (MIXED, 1, None, torch.float32), (MIXED, 1, 20, torch.bfloat16),
    (DECODES, 4, None, torch.float32), (DECODES, 4, 40, torch.float32)], ids=str)
def test_sinks_match_reference(requests, num_segments, sliding_window, dtype):
    """gpt-oss's attention sinks, in the one-pass kernel and in the split-KV merge (some
    segments empty), against the reference (itself checked against transformers'
    formula); a large sink changes head 0, a small one leaves the last head alone."""
    heads = NUM_KV_HEADS * 2
    batch = make_batch(requests, heads, 64, 16, dtype, seed=8)
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(3))
    sinks[0], sinks[-1] = 4.0, -30.0
    sinks = sinks.to(DEVICE)
    got, expected = run_both(*batch, num_segments=num_segments, sliding_window=sliding_window,
                             sinks=sinks)
    torch.testing.assert_close(got.float(), expected.float(), rtol=0, atol=TOLERANCE[dtype])
    without, _ = run_both(*batch, num_segments=num_segments, sliding_window=sliding_window)
    assert not torch.allclose(got[:, 0].float(), without[:, 0].float(), atol=1e-2)


@runs_triton_kernels
@pytest.mark.parametrize("stale", [float("nan"), float("inf")])
@pytest.mark.parametrize(("requests", "num_segments", "softcap"), [(MIXED, 1, None),
                                                                   (DECODES, 2, 1.5)],
                         ids=["mixed", "split-kv"])
def test_blocks_wholly_outside_the_window_are_never_read(requests, num_segments, softcap,
                                                         stale):
    """The KV cache manager frees blocks wholly outside a request's windows while it
    runs; their table entries may then name blocks another request fills with anything.
    Window 20 over 64-key tiles of 16-key blocks: a tile holds blocks before the window
    beside ones in it (so they must not even be loaded: P = 0 times a NaN V is NaN), and
    whole tiles lie before it."""
    block_size, window = 16, 20
    query, cache, tables, qsl, seq_lens = make_batch(requests, NUM_KV_HEADS * 2, 64,
                                                     block_size, torch.float32, seed=8)
    clean = cache.clone()
    for r, (q_len, seq_len) in enumerate(requests):
        skip = max(0, seq_len - q_len - window + 1) // block_size  # blocks before it
        cache[:, tables[r, :skip].long()] = stale
    assert not torch.isfinite(cache).all()
    got, expected = run_both(query, cache, tables, qsl, seq_lens, num_segments, tile=64,
                             sliding_window=window, softcap=softcap, reference_cache=clean)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_triton_backend_passes_each_layers_window_cap_and_sinks_to_the_kernel(
        monkeypatch):
    """The step's split-KV count is sized for its longest context; a windowed layer's
    contexts are the window long, so it gets fewer slices (each still >= 256 keys)."""
    from types import SimpleNamespace

    from pagellm.executor.model.attention import AttentionMetadata, TritonAttention

    calls = []
    backend = TritonAttention()
    monkeypatch.setattr(backend, "kernels", SimpleNamespace(
        write_kv_cache=lambda *args: None,
        paged_attention=lambda *args, **kwargs: calls.append((args[7], kwargs))))
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(1), block_tables=torch.zeros(1, 1), query_start_loc=None,
        seq_lens=None, query_start_loc_cpu=None, seq_lens_cpu=None, max_query_len=1,
        backend=backend, num_segments=16)
    sinks = torch.zeros(4)
    for window, softcap, sink in [(None, None, None), (4096, 50.0, None), (1024, None, None),
                                  (128, None, sinks)]:
        backend(None, None, None, None, meta, 0.1, window, softcap, sink)
    assert calls == [(16, dict(sliding_window=None, softcap=None, sinks=None)),
                     (16, dict(sliding_window=4096, softcap=50.0, sinks=None)),
                     (4, dict(sliding_window=1024, softcap=None, sinks=None)),
                     (1, dict(sliding_window=128, softcap=None, sinks=sinks))]


@pytest.mark.parametrize(("num_kv_heads", "head_dim", "dtype"),
                         [(2, 64, torch.float32), (3, 80, torch.float16),
                          (1, 32, torch.bfloat16)])
def test_write_kv_cache_matches_reference(num_kv_heads, head_dim, dtype):
    gen = torch.Generator().manual_seed(5)
    cache = torch.full((2, 5, 16, num_kv_heads, head_dim), -3.5, dtype=dtype, device=DEVICE)
    expected = cache.clone()
    slots = torch.tensor([-1, 17, 0, 79, -1, 40, 15, 16], device=DEVICE)
    # A key that is a strided view, as the qkv projection's split gives.
    qkv = torch.randn(len(slots), 3, num_kv_heads, head_dim, generator=gen).to(DEVICE)
    key, value = qkv[:, 0].to(dtype), qkv[:, 1]
    reference.write_kv_cache(key, value, expected, slots)
    tk.write_kv_cache(key, value, cache, slots)
    if dtype == torch.bfloat16 and tk.interpreting():
        # The interpreter truncates fp32 -> bf16 instead of rounding: 1 ulp off.
        torch.testing.assert_close(cache, expected, rtol=2**-7, atol=0)
    else:
        assert torch.equal(cache, expected)


def test_launchers_reject_what_the_kernels_cannot_take():
    query, cache, tables, qsl, seq_lens = make_batch([(3, 3)], 2, 64, 16, torch.float32)
    args = (torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
            torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), 0.1, 3)
    with pytest.raises(AssertionError):  # int64 block table
        tk.paged_attention(query, cache, tables.long(), *args)
    with pytest.raises(AssertionError):  # dtype mismatch between query and cache
        tk.paged_attention(query.half(), cache, tables, *args)
    with pytest.raises(AssertionError):  # split-KV on a batch with a prompt
        tk.paged_attention(query, cache, tables, *args, num_segments=2)
    odd = torch.zeros(2, 4, 16, 2, 48, device=DEVICE)  # head size 48 is not supported
    with pytest.raises(AssertionError):
        tk.paged_attention(torch.zeros(3, 2, 48, device=DEVICE), odd, tables, *args)
    with pytest.raises(AssertionError):  # int32 slot mapping
        tk.write_kv_cache(query[:, :2], query[:, :2], cache, torch.zeros(3, dtype=torch.int32))
    with pytest.raises(AssertionError):  # an empty window
        tk.paged_attention(query, cache, tables, *args, sliding_window=0)
    with pytest.raises(AssertionError):  # a cap at 0 divides by it
        tk.paged_attention(query, cache, tables, *args, softcap=0.0)


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int(minor)


@pytest.mark.skipif(not tk.interpreting(), reason="the interpreter's probe (CPU)")
def test_interpreter_probe_finds_the_fault_where_triton_has_it():
    """Triton 3.6's interpreter takes a loaded loop bound with int() of a one-element
    array: numpy 2.5 refuses it, numpy 2.0-2.4 only warn. With that warning raised as an
    error, the probe must report a fault on Triton < 3.7 and none from 3.7 (which
    squeezes first); without it, none below numpy 2.5."""
    import numpy as np
    import triton

    probe = tk.interpreter_fault.__wrapped__  # uncached
    fixed = _version(triton.__version__) >= (3, 7)
    if _version(np.__version__) < (2, 5):
        assert probe() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        fault = probe()
    if fixed:
        assert fault is None
    else:
        assert fault is not None and "scalar" in fault, fault  # numpy says why


def test_a_faulty_interpreter_is_refused_by_name(monkeypatch):
    """attention_backend='triton' on the CPU says why the interpreter cannot run, before
    any kernel launches (kernel_bench --smoke too: test_benchmarks.py)."""
    from pagellm.executor.model import attention

    monkeypatch.setattr(tk, "interpreter_fault", lambda: "the probe's loop failed")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="interpreter, which cannot run here: the probe"):
        attention.get_attention_backend("triton", torch.device("cpu"), 16)


@pytest.mark.parametrize("head_dim", [576, 48])
def test_auto_attends_with_torch_ops_on_cuda_where_the_kernels_lack_the_head_size(head_dim):
    """DeepSeek's latent attention (one head of 576) on CUDA: "auto" chooses the torch
    path, which takes any head size, instead of a kernel that cannot run it."""
    from pagellm.executor.model import attention

    assert head_dim not in tk.SUPPORTED_HEAD_SIZES
    backend = attention.get_attention_backend("auto", torch.device("cuda"), 16,
                                              head_dim=head_dim)
    assert backend.name == "torch"


@runs_triton_kernels
@pytest.mark.parametrize("num_segments", [1, 2])
def test_an_fp8_cache_is_attended_as_the_values_it_holds(num_segments):
    """kv_cache_dtype="fp8": on an e4m3 cache, Triton's kernel and the torch path both
    give the attention over the fp32 values the e4m3 ones stand for (scale 1.0)."""
    requests = MIXED if num_segments == 1 else DECODES
    query, cache, tables, qsl, seq_lens = make_batch(requests, NUM_KV_HEADS * 2, 64, 16,
                                                     torch.float32, seed=7)
    fp8_cache = cache.to(torch.float8_e4m3fn)  # unused slots stay NaN
    got, expected = run_both(query, fp8_cache, tables, qsl, seq_lens,
                             num_segments=num_segments, reference_cache=fp8_cache.float())
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    direct = reference.paged_attention(query, fp8_cache, tables, qsl, seq_lens,
                                       query.shape[-1] ** -0.5)
    torch.testing.assert_close(direct, expected, rtol=0, atol=1e-5)


def test_writing_an_fp8_cache_rounds_and_saturates_as_the_reference():
    cache = torch.zeros((2, 4, 16, 2, 64), dtype=torch.float8_e4m3fn, device=DEVICE)
    expected = cache.clone()
    gen = torch.Generator().manual_seed(9)
    key = torch.randn(5, 2, 64, generator=gen) * 100  # some beyond e4m3's 448
    value = torch.randn(5, 2, 64, generator=gen)
    key[0, 0, 0], key[1, 1, 1] = 1e6, -1e6
    slots = torch.tensor([3, 17, -1, 40, 63])
    reference.write_kv_cache(key, value, expected, slots)
    tk.write_kv_cache(key.to(DEVICE), value.to(DEVICE), cache, slots.to(DEVICE))
    assert torch.equal(cache.float(), expected.float())
    flat = expected.view(2, -1, 2, 64).float()
    assert flat[0, 3, 0, 0] == 448 and flat[0, 17, 1, 1] == -448  # saturated, not NaN
    assert torch.equal(flat[1, 40], value[3].to(torch.float8_e4m3fn).float())
