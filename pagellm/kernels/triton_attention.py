"""Triton kernels: the paged KV-cache write and paged attention over a mixed batch.

Same contract and layouts as `kernels/reference.py` (its torch functions are these
kernels' references and the CPU path):

    kv_cache[0 = K | 1 = V, block_id, slot_in_block, kv_head, head_dim]

Paged attention runs one launch for the whole flat batch. Each program takes a tile
of BLOCK_M rows = BLOCK_Q query tokens x the GROUP query heads that share one KV head
(so every K/V tile loaded serves the whole group), walks the request's block table one
KV block at a time with an online softmax, and accumulates in fp32:

    program (q_block, kv_head[, segment])
      rows r = 0..BLOCK_M-1: token q_block*BLOCK_Q + r // GROUP, head kv_head*GROUP + r % GROUP
      for each tile j of TILE keys (TILE / block_size KV blocks) up to the causal limit:
          S = Q K_j^T * scale   (masked: causal, past seq_len)
          m, l, acc  <- online softmax update with P = exp(S - m)
      out = acc / l

A tile spans several KV blocks (each key's block looked up in the table) so that each
iteration keeps enough loads in flight: one 16-key block per iteration (4 KB of K and of
V) reached 59% of the H200's copy bandwidth at batch 256 and a 32k context, 64 keys
reach 103% (torch SDPA on contiguous K/V: 105%); split-KV programs take 128 (see
`tile_keys`).

Which request a program serves is found in the kernel by a binary search over
query_start_loc (no host-side program table). For decode-only batches with few
requests and long contexts, the split-KV (flash-decoding) path gives each program
one of NUM_SEGMENTS slices of the context and a second kernel merges the partial
results, so the GPU still fills up.

Under TRITON_INTERPRET=1 (CPU tests) every load is cast to fp32 first: the interpreter
gets bf16 arithmetic and bf16 `tl.dot` wrong.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import torch
import triton
import triton.language as tl

SUPPORTED_HEAD_SIZES = (16, 32, 64, 80, 96, 128, 256)
SUPPORTED_BLOCK_SIZES = (16, 32)
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _loop_bound_probe_kernel(ptr):  # ptr: [1 + ptr[0]] int64
    """A loop bounded by a loaded value, as the attention kernel's KV loop is."""
    n = tl.load(ptr)
    for i in range(0, n):
        tl.store(ptr + 1 + i, i)


@functools.cache
def interpreter_fault() -> str | None:
    """Why Triton's interpreter cannot run these kernels here, or None (probed once).

    Triton 3.6's interpreter turns a loaded scalar into a loop bound with int() of a
    one-element array, which numpy 2.5 refuses (deprecated since numpy 1.25; Triton 3.7
    squeezes it first): there every attention launch fails inside the interpreter with
    "only 0-dimensional arrays can be converted to Python scalars". Compiled for a GPU
    the kernels never meet it. Only meaningful under TRITON_INTERPRET=1."""
    data = torch.tensor([2, -1, -1], dtype=torch.int64)
    try:
        _loop_bound_probe_kernel[(1,)](data)
    except Exception as e:  # the interpreter wraps what failed in its own error
        return (f"Triton {triton.__version__}'s interpreter fails with numpy "
                f"{np.__version__} ({type(e).__name__}: {e}); Triton >= 3.7 or numpy < 2.5 "
                "runs it")
    if data.tolist() != [2, 0, 1]:
        return f"Triton {triton.__version__}'s interpreter ran a probe loop wrong: {data}"
    return None


# --------------------------------------------------------------------------- KV write


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int64; negative = padding, skipped
    stride_key_tok, stride_key_head,
    stride_value_tok, stride_value_head,
    stride_cache_block, stride_cache_slot, stride_cache_head,
    num_kv_heads,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,  # num_kv_heads rounded up to a power of two
    DIM_PAD: tl.constexpr,  # head_dim rounded up to a power of two
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, DIM_PAD)[None, :]
    mask = (heads < num_kv_heads) & (dims < HEAD_DIM)
    k = tl.load(key_ptr + token * stride_key_tok + heads * stride_key_head + dims, mask=mask)
    v = tl.load(value_ptr + token * stride_value_tok + heads * stride_value_head + dims,
                mask=mask)
    dest = block * stride_cache_block + offset * stride_cache_slot + heads * stride_cache_head \
        + dims
    tl.store(k_cache_ptr + dest, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dest, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Scatter the step's K/V into the paged cache (see reference.write_kv_cache).

    key, value:   [num_tokens, num_kv_heads, head_dim], head_dim contiguous
    kv_cache:     [2, num_blocks, block_size, num_kv_heads, head_dim], contiguous
    slot_mapping: [num_tokens] int64
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape, (key.shape, value.shape)
    assert key.stride(-1) == 1 and value.stride(-1) == 1, "head_dim must be contiguous"
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2 and kv_cache.is_contiguous()
    assert kv_cache.shape[3:] == (num_kv_heads, head_dim), (kv_cache.shape, key.shape)
    assert kv_cache.shape[2] in SUPPORTED_BLOCK_SIZES, kv_cache.shape
    assert slot_mapping.shape == (num_tokens,) and slot_mapping.dtype == torch.int64
    assert key.dtype in _DTYPES and kv_cache.dtype in _DTYPES
    if num_tokens == 0:
        return
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _write_kv_cache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        num_kv_heads,
        HEAD_DIM=head_dim, HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        DIM_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=kv_cache.shape[2])


# --------------------------------------------------------------------------- attention


@triton.jit
def _find_request(query_start_loc_ptr, num_reqs, q_block, BLOCK_Q: tl.constexpr):
    """The request owning global q block `q_block`: request i owns q blocks
    [query_start_loc[i] // BLOCK_Q + i, query_start_loc[i + 1] // BLOCK_Q + i + 1)."""
    lo = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_reqs, max_blocks] int32
    seq_lens_ptr,  # [num_reqs] int32: context length including this step's tokens
    query_start_loc_ptr,  # [num_reqs + 1] int32
    segm_out_ptr,  # [num_tokens, num_heads, NUM_SEGMENTS, DIM_PAD] fp32 (split-KV only)
    segm_max_ptr,  # [num_tokens, num_heads, NUM_SEGMENTS] fp32 (split-KV only)
    segm_sum_ptr,  # [num_tokens, num_heads, NUM_SEGMENTS] fp32 (split-KV only)
    scale,
    num_reqs,
    stride_q_tok, stride_q_head,
    stride_o_tok, stride_o_head,
    stride_cache_block, stride_cache_slot, stride_cache_head,
    stride_bt_req,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_M: tl.constexpr,  # rows per program, >= BLOCK_Q * GROUP, a power of two >= 16
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # KV-cache block size
    TILE: tl.constexpr,  # keys per iteration, a multiple of BLOCK_SIZE
    NUM_SEGMENTS: tl.constexpr,  # 1: write the output; > 1: write partials (split-KV)
    CAST_FP32: tl.constexpr,  # compute everything in fp32 (fp32 inputs, or interpreting)
    PRECISION: tl.constexpr,  # tl.dot input precision: "ieee" for fp32 inputs (no TF32)
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    req = _find_request(query_start_loc_ptr, num_reqs, q_block, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    local_block = q_block - (q_start // BLOCK_Q + req)
    if local_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len  # tokens before this step's queries

    rows = tl.arange(0, BLOCK_M)
    query_pos = local_block * BLOCK_Q + rows // GROUP  # [BLOCK_M] within this step's queries
    head = kv_head * GROUP + rows % GROUP
    row_mask = (rows // GROUP < BLOCK_Q) & (query_pos < q_len)
    dims = tl.arange(0, DIM_PAD)
    dim_mask = dims < HEAD_DIM
    q_offsets = (q_start + query_pos)[:, None] * stride_q_tok + head[:, None] * stride_q_head \
        + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
    if CAST_FP32:
        q = q.to(tl.float32)

    # Keys up to the last query row's position are visible (causal).
    last_query = tl.minimum((local_block + 1) * BLOCK_Q, q_len) - 1
    num_tiles = tl.cdiv(context_len + last_query + 1, TILE)
    per_segment = tl.cdiv(num_tiles, NUM_SEGMENTS)
    first_tile = segment * per_segment
    end_tile = tl.minimum(first_tile + per_segment, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], dtype=tl.float32)
    keys = tl.arange(0, TILE)
    visible_until = context_len + query_pos  # [BLOCK_M] last key each row may see
    for j in range(first_tile, end_tile):
        key_pos = j * TILE + keys  # [TILE]
        in_seq = key_pos < seq_len  # a key in the sequence has its block in the table
        block = tl.load(block_tables_ptr + req * stride_bt_req + key_pos // BLOCK_SIZE,
                        mask=in_seq, other=0).to(tl.int64)  # [TILE]
        kv_mask = dim_mask[:, None] & in_seq[None, :]
        kv_offsets = block[None, :] * stride_cache_block \
            + (key_pos % BLOCK_SIZE)[None, :] * stride_cache_slot \
            + kv_head * stride_cache_head + dims[:, None]  # [DIM_PAD, TILE]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        if CAST_FP32:
            k = k.to(tl.float32)
        s = tl.dot(q, k, input_precision=PRECISION) * scale  # [BLOCK_M, TILE]
        visible = (key_pos[None, :] <= visible_until[:, None]) & in_seq[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # fully masked row so far
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        v = tl.load(v_cache_ptr + tl.trans(kv_offsets), mask=tl.trans(kv_mask), other=0.0)
        if CAST_FP32:
            v = v.to(tl.float32)
            acc += tl.dot(p, v, input_precision=PRECISION)
        else:
            acc += tl.dot(p.to(v.dtype), v)
        m_i = m_new

    if NUM_SEGMENTS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_offsets = (q_start + query_pos)[:, None] * stride_o_tok \
            + head[:, None] * stride_o_head + dims[None, :]
        tl.store(out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty),
                 mask=row_mask[:, None] & dim_mask[None, :])
    else:
        row_head = (q_start + query_pos) * (tl.num_programs(1) * GROUP) + head  # [BLOCK_M]
        partial = (row_head * NUM_SEGMENTS + segment)
        tl.store(segm_out_ptr + partial[:, None] * DIM_PAD + dims[None, :], acc,
                 mask=row_mask[:, None])
        tl.store(segm_max_ptr + partial, m_i, mask=row_mask)
        tl.store(segm_sum_ptr + partial, l_i, mask=row_mask)


@triton.jit
def _merge_segments_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    segm_out_ptr,  # [num_tokens, num_heads, NUM_SEGMENTS, DIM_PAD] fp32
    segm_max_ptr,  # [num_tokens, num_heads, NUM_SEGMENTS] fp32
    segm_sum_ptr,  # [num_tokens, num_heads, NUM_SEGMENTS] fp32
    num_heads,
    stride_o_tok, stride_o_head,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    base = (token * num_heads + head) * NUM_SEGMENTS
    segments = tl.arange(0, NUM_SEGMENTS)
    m = tl.load(segm_max_ptr + base + segments)  # [NUM_SEGMENTS]; -inf: empty segment
    l = tl.load(segm_sum_ptr + base + segments)  # noqa: E741
    m_all = tl.max(m, axis=0)
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)  # every segment empty
    weight = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_all))
    dims = tl.arange(0, DIM_PAD)
    acc = tl.load(segm_out_ptr + (base + segments)[:, None] * DIM_PAD + dims[None, :])
    total = tl.sum(acc * weight[:, None], axis=0)
    norm = tl.sum(l * weight, axis=0)
    norm = tl.where(norm == 0.0, 1.0, norm)  # no keys at all (a CUDA-graph padding row): 0
    tl.store(out_ptr + token * stride_o_tok + head * stride_o_head + dims,
             (total / norm).to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def tile_shape(group: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_Q): at least 16 rows (the smallest tl.dot on a GPU), as many
    whole query tokens as fit."""
    block_m = max(16, triton.next_power_of_2(group))
    return block_m, block_m // group


def tile_keys(block_size: int, head_dim: int, dtype: torch.dtype, num_segments: int = 1) -> int:
    """Keys per iteration of the attention loop: a K tile of up to 16 KB (64 keys of a
    bf16 head of 128, counted in fp32 where the kernel computes in it), 32 KB under
    split-KV (num_segments > 1) in 16-bit dtypes, at least one KV block, at most 128
    keys (registers). fp32 keeps 16 KB: at 32 KB it spills (tests/support/compile_kernels.py).

    Measured on an H200 (bf16, head 128, kernel_bench.py --tile, 2026-11-27): with one
    segment per request 64 keys beat 128 (106% against 88% of copy bandwidth at
    256 x 32k, 102 against 86 at 256 x 8k); split into segments 128 keys beat 64
    everywhere (64 x 32k, 4 segments: 85 against 76%; 16 x 32k, 16: 77 against 69;
    1 x 32k, 64: 31 against 26). A split program walks a short slice, where the larger
    tile's fewer, longer iterations keep more loads in flight."""
    dim_pad = triton.next_power_of_2(head_dim)
    element_size = 4 if _computes_in_fp32(dtype) else dtype.itemsize
    budget = 32768 if num_segments > 1 and element_size == 2 else 16384
    return max(block_size, min(128, budget // (dim_pad * element_size)))


def _computes_in_fp32(dtype: torch.dtype) -> bool:
    """The kernel casts every load to fp32 for fp32 inputs and under the interpreter
    (its bf16 arithmetic is wrong)."""
    return dtype == torch.float32 or interpreting()


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                    max_query_len: int, num_segments: int = 1,
                    out: torch.Tensor | None = None, tile: int | None = None
                    ) -> torch.Tensor:
    """Causal paged attention for a mixed batch in one launch (see module docstring).

    query:           [num_tokens, num_heads, head_dim], head_dim contiguous
    kv_cache:        [2, num_blocks, block_size, num_kv_heads, head_dim], contiguous
    block_tables:    [num_reqs, max_blocks] int32, rows contiguous
    query_start_loc: [num_reqs + 1] int32 (device)
    seq_lens:        [num_reqs] int32 (device)
    max_query_len:   the longest query (host int); num_segments > 1 (split-KV) needs 1
    tile:            keys per loop iteration (a multiple of the block size; None:
                     `tile_keys`), for benchmarks
    returns          [num_tokens, num_heads, head_dim], query's dtype
    """
    num_tokens, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, kv_head_dim = kv_cache.shape
    num_reqs = seq_lens.shape[0]
    assert kv_head_dim == head_dim and head_dim in SUPPORTED_HEAD_SIZES, (head_dim,
                                                                         kv_head_dim)
    assert block_size in SUPPORTED_BLOCK_SIZES, block_size
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert query.stride(-1) == 1 and kv_cache.is_contiguous()
    assert query.dtype in _DTYPES and kv_cache.dtype == query.dtype, (query.dtype,
                                                                       kv_cache.dtype)
    assert block_tables.dtype == torch.int32 and block_tables.stride(1) == 1
    assert block_tables.shape[0] >= num_reqs
    assert query_start_loc.shape == (num_reqs + 1,) and query_start_loc.dtype == torch.int32
    assert seq_lens.dtype == torch.int32
    assert num_segments == 1 or max_query_len == 1, "split-KV is for decode-only batches"
    assert triton.next_power_of_2(num_segments) == num_segments
    if out is None:
        out = torch.empty_like(query)
    assert out.shape == query.shape and out.stride(-1) == 1
    if num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    block_m, block_q = tile_shape(group)
    dim_pad = triton.next_power_of_2(head_dim)
    cast_fp32 = _computes_in_fp32(query.dtype)
    if tile is None:
        tile = tile_keys(block_size, head_dim, query.dtype, num_segments)
    assert tile % block_size == 0 and triton.next_power_of_2(tile) == tile, (tile, block_size)
    if num_segments > 1:
        segm_out = torch.empty(num_tokens, num_heads, num_segments, dim_pad,
                               dtype=torch.float32, device=query.device)
        segm_max = torch.empty(num_tokens, num_heads, num_segments, dtype=torch.float32,
                               device=query.device)
        segm_sum = torch.empty_like(segm_max)
    else:
        segm_out = segm_max = segm_sum = out  # unused
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    grid = (num_tokens // block_q + num_reqs, num_kv_heads, num_segments)
    _paged_attention_kernel[grid](
        out, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        segm_out, segm_max, segm_sum, scale, num_reqs,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, HEAD_DIM=head_dim, DIM_PAD=dim_pad,
        BLOCK_SIZE=block_size, TILE=tile, NUM_SEGMENTS=num_segments, CAST_FP32=cast_fp32,
        PRECISION="ieee" if cast_fp32 else None)
    if num_segments > 1:
        _merge_segments_kernel[(num_tokens, num_heads)](
            out, segm_out, segm_max, segm_sum, num_heads, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, DIM_PAD=dim_pad, NUM_SEGMENTS=num_segments)
    return out
