"""Mixed batches of paged attention for the attention tests (kernels/reference.py's and
the CPU's C++ decode attention's) and the float64 reference they are judged by.

The paged cache is filled by hand (not with write_kv_cache) through shuffled,
non-contiguous block tables, and every slot no request owns holds NaN by default: a
kernel that reads one of them cannot give a finite, correct answer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

NUM_KV_HEADS = 2


@dataclass
class Batch:
    query: torch.Tensor  # [T, H, D]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, H_kv, D]
    block_tables: torch.Tensor  # [R, max_blocks] int32
    query_start_loc: list[int]
    seq_lens: list[int]
    keys: list[torch.Tensor]  # per request [seq_len, H_kv, D], as stored (cache dtype)
    values: list[torch.Tensor]


def request_shapes(block_size: int) -> list[tuple[int, int]]:
    """(q_len, seq_len) per request: one mixed step, decodes interleaved with prefills."""
    bs = block_size
    return [
        (1, 2 * bs + 3),  # decode, context crossing two block boundaries
        (bs + 5, bs + 5),  # full prompt crossing a block boundary
        (1, bs),  # decode, context exactly one block
        (10, bs + 7),  # later chunk of a prompt whose rows cross a block boundary
        (1, 1),  # single-token prompt
        (2 * bs, 2 * bs),  # full prompt, exactly two blocks
        (5, 2 * bs),  # later chunk ending exactly on a block boundary
        (1, 3 * bs + 1),  # decode, first token of a new block
        (3, 3),  # short full prompt inside one block
    ]


def make_batch(num_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                seed: int, fill: float = float("nan"),
                shapes: list[tuple[int, int]] | None = None) -> Batch:
    """Requests of (q_len, seq_len) `shapes` (default: `request_shapes`)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = shapes or request_shapes(block_size)
    blocks_needed = [math.ceil(seq_len / block_size) for _, seq_len in shapes]
    num_blocks = sum(blocks_needed) + 5  # a few blocks nobody owns
    # Unused slots are NaN by default: reading one would poison the output.
    kv_cache = torch.full((2, num_blocks, block_size, NUM_KV_HEADS, head_dim), fill,
                          dtype=dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()  # shuffled block ids
    max_blocks = max(blocks_needed) + 2
    block_tables = torch.empty(len(shapes), max_blocks, dtype=torch.int32)
    keys, values, queries, query_start_loc, seq_lens = [], [], [], [0], []
    for i, ((q_len, seq_len), n) in enumerate(zip(shapes, blocks_needed, strict=True)):
        own, order = order[:n], order[n:]
        # Padding beyond the request's blocks: arbitrary ids (other requests', NaN blocks).
        pad = torch.randint(0, num_blocks, (max_blocks - n,), generator=gen).tolist()
        block_tables[i] = torch.tensor(own + pad, dtype=torch.int32)
        k = torch.randn(seq_len, NUM_KV_HEADS, head_dim, generator=gen).to(dtype)
        v = torch.randn(seq_len, NUM_KV_HEADS, head_dim, generator=gen).to(dtype)
        pos = torch.arange(seq_len)  # scatter by hand through the block table
        blocks = torch.tensor(own)[pos // block_size]
        kv_cache[0, blocks, pos % block_size] = k
        kv_cache[1, blocks, pos % block_size] = v
        keys.append(k)
        values.append(v)
        queries.append(torch.randn(q_len, num_heads, head_dim, generator=gen).to(dtype))
        query_start_loc.append(query_start_loc[-1] + q_len)
        seq_lens.append(seq_len)
    return Batch(torch.cat(queries), kv_cache, block_tables, query_start_loc, seq_lens,
                  keys, values)


def naive_attention(batch: Batch, scale: float, sliding_window: int | None = None,
                     softcap: float | None = None, sinks: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """softmax(q k^T * scale + causal mask) v in float64, one request and head at a time.

    Query row i of a request with q_len rows and context seq_len sits at position
    p = seq_len - q_len + i and sees positions 0..p, or under a sliding window W only
    p - W < j <= p (transformers' sliding_window_overlay). Soft-capping as transformers'
    eager attention: scores s -> softcap * tanh(s / softcap), then the mask. Sinks
    [num_heads] as gpt-oss's eager attention: each head's sink a column appended to its
    scores before the softmax and dropped after it.
    """
    num_tokens, num_heads, head_dim = batch.query.shape
    group = num_heads // batch.keys[0].shape[1]
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=torch.float64)
    for r, seq_len in enumerate(batch.seq_lens):
        start, end = batch.query_start_loc[r], batch.query_start_loc[r + 1]
        q_len = end - start
        q = batch.query[start:end].cpu().double()  # the test on CUDA moves the query
        k, v = batch.keys[r].double(), batch.values[r].double()
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        masked = k_pos > q_pos  # [q_len, seq_len]
        if sliding_window is not None:
            masked |= k_pos <= q_pos - sliding_window
        for h in range(num_heads):
            kv_head = h // group
            scores = q[:, h] @ k[:, kv_head].T * scale
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            scores = scores.masked_fill(masked, float("-inf"))
            if sinks is not None:
                sink = torch.full((q_len, 1), float(sinks[h]), dtype=torch.float64)
                probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[:, :-1]
            else:
                probs = scores.softmax(dim=-1)
            out[start:end, h] = probs @ v[:, kv_head]
    return out


TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3),
              torch.bfloat16: (1.6e-2, 2e-2)}  # (rtol, atol): fp16/bf16 output rounding
