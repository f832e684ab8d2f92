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

from dataclasses import dataclass

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


@dataclass
class Prefill:
    """One request whose query is longer than a token: rows [start, end) of the step."""

    start: int
    end: int
    seq_len: int
    blocks: torch.Tensor  # [ceil(seq_len / block_size)] int64
    fresh: bool  # the whole context is this step's own keys and values (a new prompt)


@dataclass
class AttentionPlan:
    """The index work of one step's paged attention, done once and shared by every layer
    (a step runs the same batch through all of them).

    One-token queries (decodes) are attended together: their blocks are gathered whole
    into one padded batch [Bd, nb * block_size] of keys and values, positions past a
    request's context (the rest of its last block, and padding blocks) are zeroed after
    the gather, since any slot there may hold another request's non-finite values, and
    masked out of the softmax by `decode_bias`."""

    decode_rows: torch.Tensor | None  # [Bd] int64 query rows of the one-token requests
    decode_blocks: torch.Tensor  # [Bd * nb] int64, each row's blocks (padded with block 0)
    decode_stale: torch.Tensor | None  # [P] int64 rows of the gathered [Bd * nb * bs]
    decode_bias: torch.Tensor  # [Bd, 1, 1, nb * bs] fp32: 0 inside the context, -inf past
    prefills: list[Prefill]


def plan_attention(block_tables: torch.Tensor, query_start_loc: list[int],
                   seq_lens: list[int], block_size: int) -> AttentionPlan:
    """block_tables: [num_reqs(+), max_blocks] int32; query_start_loc, seq_lens: host
    ints as in `paged_attention`."""
    num_reqs = len(seq_lens)
    assert len(query_start_loc) == num_reqs + 1
    assert block_tables.dim() == 2 and block_tables.shape[0] >= num_reqs
    device = block_tables.device
    decodes, prefills = [], []
    for i in range(num_reqs):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        if end - start == 1:
            decodes.append(i)
        elif end > start:
            seq_len = seq_lens[i]
            prefills.append(Prefill(start, end, seq_len,
                                    block_tables[i, :-(-seq_len // block_size)].long(),
                                    fresh=end - start == seq_len))
    empty = torch.empty(0, dtype=torch.int64, device=device)
    if not decodes:
        return AttentionPlan(None, empty, None, torch.empty(0, 1, 1, 0, device=device),
                             prefills)
    lens = torch.tensor([seq_lens[i] for i in decodes], device=device)
    nb = -(-int(lens.max()) // block_size)
    blocks = block_tables[decodes, :nb].long().reshape(-1)
    stale = torch.arange(nb * block_size, device=device)[None, :] >= lens[:, None]
    bias = torch.zeros(stale.shape, device=device).masked_fill_(stale, float("-inf"))
    stale_rows = stale.reshape(-1).nonzero().squeeze(1)
    return AttentionPlan(torch.tensor([query_start_loc[i] for i in decodes], device=device),
                         blocks, stale_rows if stale_rows.numel() else None,
                         bias[:, None, None, :], prefills)


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
    assert query_start_loc[-1] == query.shape[0]
    plan = plan_attention(block_tables, query_start_loc, seq_lens, kv_cache.shape[2])
    return planned_attention(query, kv_cache, plan, scale)


def planned_attention(query: torch.Tensor, kv_cache: torch.Tensor, plan: AttentionPlan,
                      scale: float, key: torch.Tensor | None = None,
                      value: torch.Tensor | None = None) -> torch.Tensor:
    """`paged_attention` with the index work done (`plan_attention`). key, value:
    [num_tokens, num_kv_heads, head_dim], this step's own (already in the cache); a
    fresh prompt attends to them directly instead of gathering them back."""
    _, num_heads, head_dim = query.shape
    num_kv_heads, kv_head_dim = kv_cache.shape[3:]
    assert kv_head_dim == head_dim and num_heads % num_kv_heads == 0
    out = torch.empty_like(query)
    if plan.decode_rows is not None:
        q = query[plan.decode_rows]
        out[plan.decode_rows] = _decode_attention(q, kv_cache, plan, scale)
    for p in plan.prefills:
        if p.fresh and key is not None and value is not None:
            k, v = key[p.start:p.end], value[p.start:p.end]
        else:
            k, v = (_gather_blocks(kv_cache[i], p.blocks).view(-1, num_kv_heads, head_dim)
                    [:p.seq_len] for i in (0, 1))
        out[p.start:p.end] = _prefill_attention(query[p.start:p.end], k, v, scale)
    return out


def _gather_blocks(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """cache: [num_blocks, block_size, H_kv, D] (keys or values); blocks: [N] int64 ->
    [N, block_size * H_kv * D]. Whole blocks: index_select with one index per block
    copies several times faster than one per token."""
    return cache.view(cache.shape[0], -1).index_select(0, blocks)


def _fp32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.float()


def _prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
                       ) -> torch.Tensor:
    """q: [Q, H, D] (the last Q positions); k, v: [L, H_kv, D] -> [Q, H, D]."""
    q_len, seq_len = q.shape[0], k.shape[0]
    qt, kt, vt = (_fp32(t.transpose(0, 1)) for t in (q, k, v))  # [heads, len, D]
    if q_len == seq_len:
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale,
                                           enable_gqa=True)
    else:  # a later chunk of a prompt: query i sits at position seq_len - q_len + i
        pos_q = torch.arange(seq_len - q_len, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= pos_q[:, None]  # [Q, L]
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale,
                                           enable_gqa=True)
    return o.transpose(0, 1).to(q.dtype)


def _decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, plan: AttentionPlan,
                      scale: float) -> torch.Tensor:
    """q: [Bd, H, D], one query per request at its last position -> [Bd, H, D].

    Grouped-query attention without repeating K/V: the G = H / H_kv query heads that
    share a KV head become G query rows of that head's attention ([Bd, H_kv, G, D]
    against [Bd, H_kv, L, D]); one mask row serves them all."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    length = plan.decode_bias.shape[-1]
    k, v = (_gather_blocks(kv_cache[i], plan.decode_blocks) for i in (0, 1))
    if plan.decode_stale is not None:  # may hold anything, NaN included: 0 * NaN is NaN
        for t in (k, v):
            t.view(-1, num_kv_heads * head_dim).index_fill_(0, plan.decode_stale, 0.0)
    k, v = (_fp32(t.view(batch, length, num_kv_heads, head_dim).transpose(1, 2))
            for t in (k, v))  # [Bd, H_kv, L, D]
    groups = _fp32(q).view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    o = F.scaled_dot_product_attention(groups, k, v, attn_mask=plan.decode_bias, scale=scale)
    return o.reshape(batch, num_heads, head_dim).to(q.dtype)
