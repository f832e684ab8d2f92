"""Pure-torch paged attention and KV-cache write.

These are the CPU path and the references the Triton kernels are tested against.

Paged KV cache layout, one tensor per layer:

    kv_cache[0 = key | 1 = value, block_id, slot_in_block, kv_head, head_dim]

A token at position p of a request lives in block `block_table[p // block_size]`, at
slot `p % block_size`; `slot_mapping` holds `block_id * block_size + slot` per token.

A step's batch is flat and unpadded: request i owns query rows
`query_start_loc[i]:query_start_loc[i+1]` (a prompt, a chunk of one, or one decode
token) and attends to the first `seq_lens[i]` tokens of its context, the query rows
being the last ones of that context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Scatter the step's keys and values into the paged cache.

    key, value:   [num_tokens, num_kv_heads, head_dim]
    kv_cache:     [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: [num_tokens] int64; negative slots (padding) are skipped
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape, (key.shape, value.shape)
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, kv_cache.shape
    assert kv_cache.shape[3:] == (num_kv_heads, head_dim), (kv_cache.shape, key.shape)
    assert slot_mapping.shape == (num_tokens,), slot_mapping.shape
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)  # [2, num_slots, H, D]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        slot_mapping, key, value = slot_mapping[valid], key[valid], value[valid]
    flat[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                    query_start_loc: list[int], seq_lens: list[int], scale: float
                    ) -> torch.Tensor:
    """Causal attention of each request's query rows over its paged context.

    query:           [num_tokens, num_heads, head_dim]
    kv_cache:        [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables:    [num_reqs, max_blocks_per_req] int32 (rows padded with any block id)
    query_start_loc: num_reqs + 1 offsets into the query rows (host ints)
    seq_lens:        num_reqs context lengths, this step's tokens included (host ints)
    returns          [num_tokens, num_heads, head_dim], query's dtype

    Single-token queries (decodes) are computed together in one padded batch; longer
    queries one request at a time with SDPA. Accumulation is in fp32.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, kv_head_dim = kv_cache.shape[3:]
    num_reqs = len(seq_lens)
    assert kv_head_dim == head_dim and num_heads % num_kv_heads == 0
    assert len(query_start_loc) == num_reqs + 1 and query_start_loc[-1] == num_tokens
    assert block_tables.dim() == 2 and block_tables.shape[0] >= num_reqs
    out = torch.empty_like(query)
    decodes = [i for i in range(num_reqs) if query_start_loc[i + 1] - query_start_loc[i] == 1]
    if decodes:
        rows = torch.tensor([query_start_loc[i] for i in decodes], device=query.device)
        out[rows] = _decode_attention(query[rows], kv_cache, block_tables[decodes],
                                      [seq_lens[i] for i in decodes], scale)
    decode_set = set(decodes)
    for i in range(num_reqs):
        if i in decode_set:
            continue
        start, end = query_start_loc[i], query_start_loc[i + 1]
        if start == end:
            continue
        k, v = _gather_context(kv_cache, block_tables[i], seq_lens[i])  # [L, H_kv, D]
        out[start:end] = _prefill_attention(query[start:end], k, v, scale)
    return out


def _gather_tokens(kv_cache: torch.Tensor, block_tables: torch.Tensor,
                   positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V at the given positions of each request.

    block_tables: [B, max_blocks]; positions: [B, T] -> k, v: [B, T, H_kv, D].
    index_select on a flat [num_slots, H_kv * D] view is the fastest gather torch offers
    on the CPU.
    """
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    blocks = block_tables.long().gather(1, positions // block_size)
    slots = (blocks * block_size + positions % block_size).reshape(-1)
    k = kv_cache[0].view(num_blocks * block_size, -1).index_select(0, slots)
    v = kv_cache[1].view(num_blocks * block_size, -1).index_select(0, slots)
    shape = (*positions.shape, num_kv_heads, head_dim)
    return k.view(shape), v.view(shape)


def _gather_context(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's first seq_len tokens: k, v [seq_len, H_kv, D]."""
    positions = torch.arange(seq_len, device=block_table.device)[None, :]
    k, v = _gather_tokens(kv_cache, block_table[None, :], positions)
    return k[0], v[0]


def _prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
                       ) -> torch.Tensor:
    """q: [Q, H, D] (the last Q positions); k, v: [L, H_kv, D] -> [Q, H, D]."""
    q_len, seq_len = q.shape[0], k.shape[0]
    qt, kt, vt = (t.transpose(0, 1).float() for t in (q, k, v))  # [heads, len, D]
    if q_len == seq_len:
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale,
                                           enable_gqa=True)
    else:  # a later chunk of a prompt: query i sits at position seq_len - q_len + i
        pos_q = torch.arange(seq_len - q_len, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= pos_q[:, None]  # [Q, L]
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale,
                                           enable_gqa=True)
    return o.transpose(0, 1).to(q.dtype)


def _decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                      seq_lens: list[int], scale: float) -> torch.Tensor:
    """q: [B, H, D], one query per request at its last position -> [B, H, D].

    The contexts are gathered into one padded batch [B, T] and the padding is masked
    out of the softmax. Padded positions re-read the request's own last token, never a
    slot it does not own: the mask cannot neutralise NaN or inf (0 * NaN is NaN), and
    an unwritten or foreign slot may hold either.
    """
    lens = torch.tensor(seq_lens, device=q.device)
    t = torch.arange(max(seq_lens), device=q.device)[None, :]  # [1, T]
    positions = torch.minimum(t, lens[:, None] - 1)  # [B, T]
    k, v = _gather_tokens(kv_cache, block_tables, positions)  # [B, T, H_kv, D]
    valid = t < lens[:, None]  # [B, T]
    o = F.scaled_dot_product_attention(
        q.float()[:, :, None, :], k.transpose(1, 2).float(), v.transpose(1, 2).float(),
        attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=True)  # [B, H, 1, D]
    return o[:, :, 0].to(q.dtype)
