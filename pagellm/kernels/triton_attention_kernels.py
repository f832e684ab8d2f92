"""The Triton kernels of paged attention: the KV-cache write, the attention over a
mixed batch, and the merge of split-KV partial results.

triton_attention.py launches them (its launchers check shapes, pick tile sizes and grids)
and is the module the rest of pagellm imports; these are the @triton.jit functions
alone. Same contract and layouts as `kernels/reference.py` (its torch functions are these
kernels' references and the CPU path):

    kv_cache[0 = K | 1 = V, block_id, slot_in_block, kv_head, head_dim]

Paged attention runs one launch for the whole flat batch. Each program takes a tile
of BLOCK_M rows = BLOCK_Q query tokens x the GROUP query heads that share one KV head
(so every K/V tile loaded serves the whole group), walks the request's block table one
KV block at a time with an online softmax, and accumulates in fp32:

    program (q_block, kv_head[, segment])
      rows r = 0..BLOCK_M-1: token q_block*BLOCK_Q + r // GROUP, head kv_head*GROUP + r % GROUP
      for each tile j of TILE keys (TILE / block_size KV blocks) up to the causal limit,
      from the one holding the first row's first key (a sliding window skips the rest):
          S = Q K_j^T * scale   (soft-capped: S = c * tanh(S / c))
          S masked: causal, past seq_len, outside the row's sliding window
          m, l, acc  <- online softmax update with P = exp(S - m)
      out = acc / l

Under a sliding window W (USE_SLIDING_WINDOW) a row at position p sees keys
p - W < j <= p. The program's first row's first key, p0 - W + 1, bounds what it reads:
the loop starts at the tile holding it, and keys of that tile before it are not loaded
at all (masked loads, K and V read as 0), not merely masked in the softmax: the KV cache
manager frees blocks wholly outside the windows while a request runs, so their table
entries may name blocks another request now fills (NaN and inf included; 0 * NaN would
reach the output through P @ V).

    keys      0   16  32  48  64  80  96  112 128     TILE 64 (4 blocks of 16), a
    tiles     |--- tile 0 ----|--- tile 1 ----|       row's first key 72: tile 0 is
    loaded                    ..xxxxxxxxxxxxxx        skipped, keys 64..71 not loaded

A tile spans several KV blocks (each key's block looked up in the table) so that each
iteration keeps enough loads in flight: one 16-key block per iteration (4 KB of K and of
V) reached 59% of the H200's copy bandwidth at batch 256 and a 32k context, 64 keys
reach 103% (torch SDPA on contiguous K/V: 105%); split-KV programs take 128 (see
`triton_attention.tile_keys`).

Which request a program serves is found in the kernel by a binary search over
query_start_loc (no host-side program table). For decode-only batches with few
requests and long contexts, the split-KV (flash-decoding) path gives each program
one of NUM_SEGMENTS slices of the context and a second kernel merges the partial
results, so the GPU still fills up.

Under TRITON_INTERPRET=1 (CPU tests) every load is cast to fp32 first (CAST_FP32): the
interpreter gets bf16 arithmetic and bf16 `tl.dot` wrong.
"""

from __future__ import annotations

import triton
import triton.language as tl

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
    FP8_MAX: tl.constexpr,  # an e4m3 cache: saturate to +-448 first (0.0: no clamp)
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
    if FP8_MAX > 0:
        k = tl.minimum(tl.maximum(k.to(tl.float32), -FP8_MAX), FP8_MAX)
        v = tl.minimum(tl.maximum(v.to(tl.float32), -FP8_MAX), FP8_MAX)
    tl.store(k_cache_ptr + dest, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dest, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


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
def _tanh(x):
    """tanh from exp (the interpreter has no libdevice): sign(x) (1 - e) / (1 + e) with
    e = exp(-2|x|) <= 1, which cannot overflow at any |x| (exp(2x) would, to inf / inf)."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


# One function by nature (a Triton kernel is one program; splitting it would not shorten it).
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
    sliding_window,  # W: keys p - W < j <= p (read only under USE_SLIDING_WINDOW)
    softcap,  # c: s -> c * tanh(s / c) (read only under USE_SOFTCAP)
    sinks_ptr,  # [num_heads] fp32 attention sinks (read only under USE_SINKS)
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
    USE_SLIDING_WINDOW: tl.constexpr,  # a query sees only the last sliding_window keys
    USE_SOFTCAP: tl.constexpr,  # Gemma 2's logit soft-capping
    USE_SINKS: tl.constexpr,  # gpt-oss: a logit per head in the denominator only
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

    # Keys up to the last query row's position are visible (causal), from the first
    # row's window's first key on (the tiles before it are skipped, see above).
    last_query = tl.minimum((local_block + 1) * BLOCK_Q, q_len) - 1
    num_tiles = tl.cdiv(context_len + last_query + 1, TILE)
    if USE_SLIDING_WINDOW:
        first_key = tl.maximum(context_len + local_block * BLOCK_Q - sliding_window + 1, 0)
        start_tile = first_key // TILE
    else:
        first_key = 0
        start_tile = 0
    per_segment = tl.cdiv(num_tiles - start_tile, NUM_SEGMENTS)
    first_tile = start_tile + segment * per_segment
    end_tile = tl.minimum(first_tile + per_segment, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], dtype=tl.float32)
    keys = tl.arange(0, TILE)
    visible_until = context_len + query_pos  # [BLOCK_M] last key each row may see
    for j in range(first_tile, end_tile):
        key_pos = j * TILE + keys  # [TILE]
        in_seq = key_pos < seq_len  # a key in the sequence has its block in the table
        if USE_SLIDING_WINDOW:  # and is held while some row's window holds it
            in_seq = in_seq & (key_pos >= first_key)
        block = tl.load(block_tables_ptr + req * stride_bt_req + key_pos // BLOCK_SIZE,
                        mask=in_seq, other=0).to(tl.int64)  # [TILE]
        kv_mask = dim_mask[:, None] & in_seq[None, :]
        kv_offsets = block[None, :] * stride_cache_block \
            + (key_pos % BLOCK_SIZE)[None, :] * stride_cache_slot \
            + kv_head * stride_cache_head + dims[:, None]  # [DIM_PAD, TILE]
        # in q's dtype: fp32 when interpreting, and an e4m3 cache's values (scale 1.0)
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(q.dtype)
        s = tl.dot(q, k, input_precision=PRECISION) * scale  # [BLOCK_M, TILE]
        if USE_SOFTCAP:
            s = softcap * _tanh(s / softcap)
        visible = (key_pos[None, :] <= visible_until[:, None]) & in_seq[None, :]
        if USE_SLIDING_WINDOW:
            visible = visible & (key_pos[None, :] > (visible_until - sliding_window)[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # fully masked row so far
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        v = tl.load(v_cache_ptr + tl.trans(kv_offsets), mask=tl.trans(kv_mask),
                    other=0.0).to(q.dtype)
        if CAST_FP32:
            acc += tl.dot(p, v, input_precision=PRECISION)
        else:
            acc += tl.dot(p.to(v.dtype), v)
        m_i = m_new

    if NUM_SEGMENTS == 1:
        if USE_SINKS:  # the sink joins the sum as one more term: exp(sink - m)
            sink = tl.load(sinks_ptr + head, mask=row_mask, other=0.0)  # [BLOCK_M] fp32
            m_all = tl.maximum(m_i, sink)
            alpha = tl.exp(m_i - m_all)  # 0 for a row that saw no key
            acc = acc * alpha[:, None]
            l_i = l_i * alpha + tl.exp(sink - m_all)
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
    sinks_ptr,  # [num_heads] fp32 attention sinks (read only under USE_SINKS)
    num_heads,
    stride_o_tok, stride_o_head,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    USE_SINKS: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    base = (token * num_heads + head) * NUM_SEGMENTS
    segments = tl.arange(0, NUM_SEGMENTS)
    m = tl.load(segm_max_ptr + base + segments)  # [NUM_SEGMENTS]; -inf: empty segment
    l = tl.load(segm_sum_ptr + base + segments)  # noqa: E741
    m_all = tl.max(m, axis=0)
    if USE_SINKS:  # a segment of its own: max `sink`, sum 1, no values
        sink = tl.load(sinks_ptr + head)
        m_all = tl.maximum(m_all, sink)
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)  # every segment empty
    weight = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_all))
    dims = tl.arange(0, DIM_PAD)
    acc = tl.load(segm_out_ptr + (base + segments)[:, None] * DIM_PAD + dims[None, :])
    total = tl.sum(acc * weight[:, None], axis=0)
    norm = tl.sum(l * weight, axis=0)
    if USE_SINKS:
        norm += tl.exp(sink - m_all)
    norm = tl.where(norm == 0.0, 1.0, norm)  # no keys at all (a CUDA-graph padding row): 0
    tl.store(out_ptr + token * stride_o_tok + head * stride_o_head + dims,
             (total / norm).to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)
