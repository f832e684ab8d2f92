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

Two per-layer options (Mistral, Gemma 2/3, gpt-oss):

- `sliding_window` W: a query at position p attends the keys at positions j with
  p - W < j <= p (W keys, itself included; transformers' `sliding_window_overlay`).
  A context of L tokens then needs only its blocks from the one holding its first
  query's first key on, and only those are gathered: the KV cache manager may free the
  blocks wholly before every window while the request runs, and their table entries
  then name blocks that others reuse (any values, NaN included), so they are never
  read.

      block table   b0    b1    b2    b3    b4      a decode at p = 72, W = 20, blocks of 16
      keys          0..   16..  32..  48..  64..79
      window                           53 ...... 72
      gathered                        [ b3 ][ b4 ]  from the block of 53: 53 // 16 = 3
      bias          -inf at 48..52, 0 at 53..72, -inf at 73..79

- `softcap` c: Gemma 2's logit soft-capping, s = c * tanh(q.k * scale / c) before the
  mask and the softmax (transformers' eager attention). SDPA cannot apply it: those
  layers compute their scores explicitly, in fp32.

And one per-layer tensor: `sinks` [num_heads] (gpt-oss's attention sinks), a learned
logit per head that joins every query's softmax as one more "key" with no value:

    o = sum_j exp(s_j - m) v_j / (sum_j exp(s_j - m) + exp(sink_h - m)),  m = max(s, sink_h)

so a head may attend to nothing (transformers' eager attention concatenates the sink to
the scores and drops its column after the softmax). SDPA has no such term either: those
layers also compute their scores explicitly.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn  # kv_cache_dtype="fp8": e4m3 with a per-tensor scale of 1.0
FP8_MAX = 448.0  # e4m3's largest value: larger magnitudes saturate (vLLM's uncalibrated)


def to_cache_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t as the KV cache stores it (e4m3 saturates instead of overflowing to NaN)."""
    if dtype == FP8:
        return t.clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return t.to(dtype)


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
    key, value = (to_cache_dtype(t, kv_cache.dtype) for t in (key, value))
    if kv_cache.dtype == FP8:  # torch's CPU index_copy_ has no e4m3: copy the bytes
        flat, key, value = (t.view(torch.uint8) for t in (flat, key, value))
    flat[0].index_copy_(0, slot_mapping, key)
    flat[1].index_copy_(0, slot_mapping, value)


# A decode group's padded blocks may exceed its requests' own by this factor: sorted by
# length, decodes split into groups where one long context does not pad all the others.
DECODE_PADDING_SLACK = 1.3

# (q [Q, H, D], k [L, H_kv, D], v, scale) -> [Q, H, D]: the last Q of L positions,
# causally; `planned_attention` hands it the queries of these dtypes.
PrefillAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
PREFILL_DTYPES = (torch.float32, torch.bfloat16)


@dataclass
class Prefill:
    """One request whose query is longer than a token: rows [start, end) of the step."""

    start: int
    end: int
    seq_len: int
    blocks: torch.Tensor  # [ceil(seq_len / block_size) - key_start / block_size] int64
    fresh: bool  # the whole context is this step's own keys and values (a new prompt)
    key_start: int = 0  # the first gathered key's position (a block boundary): > 0 only
    # where a sliding window leaves the blocks before it out


@dataclass
class DecodeGroup:
    """One-token queries of similar context lengths, attended as one padded batch of
    whole gathered blocks [Bg, nb * block_size]. Rows past a request's own blocks repeat
    its first block (its own, finite data); in a copy of its last block, positions past
    the context may hold anything (a reused block keeps its previous owner's values,
    NaN included, and 0 * NaN is NaN): those `stale` rows are zeroed after the gather.
    Every position past the context is masked out of the softmax by `bias`. Under a
    sliding window a request's "own blocks" start at the one holding its window's first
    key (the earlier ones are never gathered), and `bias` masks that block's keys
    before the window too (the request's own, finite keys: nothing to zero)."""

    rows: torch.Tensor | None  # [Bg] int64 query rows; None: all of the step's, in order
    blocks: torch.Tensor  # [Bg * nb] int64
    stale: torch.Tensor | None  # [P] int64 rows of the gathered [Bg * nb * block_size]
    bias: torch.Tensor  # [Bg, 1, 1, nb * block_size]: 0 inside the context, -inf past;
    # fp32 from the plan, in the SDPA query's dtype after the first layer (`_mask_like`)


class GatherScratch:
    """Where gathered keys and values land, kept from step to step: a fresh allocation
    per layer page-faults tens of MB in again each time (the OS hands freed large blocks
    back), which made the gathers up to 40 times slower than the copies themselves.
    Grows to the largest gather seen; never shrinks."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def take(self, rows: int, row_numel: int, like: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Two [rows, row_numel] tensors (keys, values) of `like`'s dtype and device."""
        numel = rows * row_numel
        buffer = self._buffer
        if (buffer is None or buffer.shape[1] < numel or buffer.dtype != like.dtype
                or buffer.device != like.device):
            buffer = self._buffer = torch.empty(2, numel, dtype=like.dtype,
                                                device=like.device)
        return buffer[0, :numel].view(rows, row_numel), buffer[1, :numel].view(rows, row_numel)


@dataclass
class AttentionPlan:
    """The index work of one step's paged attention, done once and shared by every layer
    (a step runs the same batch through all of them)."""

    decodes: list[DecodeGroup]
    prefills: list[Prefill]
    scratch: GatherScratch
    sliding_window: int | None = None  # the window the plan was built for (None: causal)


def plan_attention(block_tables: torch.Tensor, query_start_loc: Sequence[int] | np.ndarray,
                   seq_lens: Sequence[int] | np.ndarray, block_size: int,
                   scratch: GatherScratch | None = None, sliding_window: int | None = None,
                   plan_decodes: bool = True) -> AttentionPlan:
    """block_tables: [num_reqs(+), max_blocks] int32; query_start_loc [num_reqs + 1],
    seq_lens [num_reqs]: host ints as in `paged_attention` (int64 arrays pass
    uncopied). The index work runs in numpy on the host (a few small arrays per step:
    torch's per-op overhead would cost more than the work). With a `sliding_window`
    each request's gathers start at the block holding its first query's first key (see
    the module docstring): a long context costs window-sized work. `plan_decodes=False`
    plans the longer queries only: the caller attends the one-token ones itself (the
    CPU's C++ decode attention, executor/model/attention.py)."""
    num_reqs = len(seq_lens)
    assert len(query_start_loc) == num_reqs + 1
    assert block_tables.dim() == 2 and block_tables.shape[0] >= num_reqs
    assert sliding_window is None or sliding_window >= 1, sliding_window
    window = sliding_window
    device = block_tables.device
    table = block_tables.cpu().numpy()  # free on the CPU, the CPU path's case
    starts = np.asarray(query_start_loc, dtype=np.int64)
    lens = np.asarray(seq_lens, dtype=np.int64)
    if int(starts[-1]) > num_reqs:  # some query is longer than a token (each has one)
        q_lens = starts[1:] - starts[:-1]
        long = q_lens > 1
        prefills: list[Prefill] = []
        for i in np.flatnonzero(long).tolist():
            seq_len, q_len = int(lens[i]), int(q_lens[i])
            # The block of the first query's first key (position seq_len - q_len).
            skip = 0 if window is None else max(0, seq_len - q_len - window + 1) // block_size
            prefills.append(Prefill(int(starts[i]), int(starts[i + 1]), seq_len,
                                    block_tables[i, skip:-(-seq_len // block_size)].long(),
                                    fresh=q_len == seq_len, key_start=skip * block_size))
        decodes: np.ndarray | None = np.flatnonzero(~long)  # [D] their requests
        decode_lens = lens[decodes]
    else:  # a decode-only step, the common case: every request, in order
        prefills, decodes, decode_lens = [], None, lens
    to = torch.from_numpy if device.type == "cpu" else (
        lambda array: torch.from_numpy(array).to(device))
    owned = (decode_lens + (block_size - 1)) // block_size  # [D] blocks of their own
    if not len(owned) or not plan_decodes:
        return AttentionPlan([], prefills, scratch or GatherScratch(), window)
    first: np.ndarray | None = None
    lo: np.ndarray | None = None
    if window is not None:  # from the block of each window's first key: lengths, blocks,
        # and where the window starts, all counted from there
        lo = np.maximum(decode_lens - window, 0)  # [D] the first key's position
        first = lo // block_size
        decode_lens, owned, lo = (decode_lens - first * block_size, owned - first,
                                  lo - first * block_size)
    nb = int(owned.max())
    if nb * len(owned) <= DECODE_PADDING_SLACK * owned.sum():  # one group pads little:
        # no sort, and in a decode-only step no query rows to pick (most steps; this
        # runs cold after a forward pass, where each numpy call costs ~10 us)
        return AttentionPlan([_decode_group(table, starts, decode_lens, owned, nb,
                                            block_size, decodes, to, first, lo)],
                             prefills, scratch or GatherScratch(), window)
    # Longest first; a group's first sets its length and it ends where its padded
    # blocks would first exceed the slack (vectorized: a Python loop over hundreds of
    # decodes cost ~40 us a step).
    order = np.argsort(-owned, kind="stable")
    index = order if decodes is None else decodes[order]
    decode_lens, owned = decode_lens[order], owned[order]
    if first is not None and lo is not None:
        first, lo = first[order], lo[order]
    groups = []
    begin = 0
    while begin < len(owned):
        rest = owned[begin:]
        over = rest[0] * np.arange(1, len(rest) + 1) > DECODE_PADDING_SLACK * rest.cumsum()
        over[0] = False
        end = begin + (int(over.argmax()) or len(rest))
        part = slice(begin, end)
        groups.append(_decode_group(table, starts, decode_lens[part], owned[part],
                                    int(rest[0]), block_size, index[part], to,
                                    None if first is None else first[part],
                                    None if lo is None else lo[part]))
        begin = end
    return AttentionPlan(groups, prefills, scratch or GatherScratch(), window)


def _decode_group(table: np.ndarray, starts: np.ndarray, group_lens: np.ndarray,
                  owned: np.ndarray, nb: int, block_size: int, index: np.ndarray | None,
                  to: Callable[[np.ndarray], torch.Tensor], first: np.ndarray | None = None,
                  lo: np.ndarray | None = None) -> DecodeGroup:
    """The decode group of requests `index` (None: every request of the step, in
    order), of context lengths `group_lens` and `owned` blocks each, `nb` the most:
    see `DecodeGroup`. A few numpy calls for the whole group, none per request: this
    runs every step. Under a sliding window, `first` [Bg] is each request's first
    block-table column gathered and `lo` [Bg] its window's first key; lengths, blocks
    and `lo` count from that column."""
    bs, batch = block_size, len(group_lens)
    length = nb * bs
    if first is None:
        rows = table[:batch, :nb] if index is None else table[index, :nb]  # [Bg, nb]
        if nb > 1:  # rows past a request's own blocks repeat its first
            rows = np.where(np.arange(nb) < owned[:, None], rows, rows[:, :1])
    else:  # columns first .. first + owned - 1, then its first again (never past its own)
        columns = np.arange(nb)
        columns = first[:, None] + np.where(columns < owned[:, None], columns, 0)
        rows = table[np.arange(batch)[:, None] if index is None else index[:, None], columns]
    # Stale rows of the gathered [Bg * length]: row r's sequence starts at r * length;
    # its positions [len_r, owned_r * bs) are the tail of its last block.
    row_start = np.arange(0, batch * length, length)
    firsts, counts = row_start + group_lens, owned * bs - group_lens
    single = np.flatnonzero(owned == 1) if nb > 1 else ()
    if len(single):  # a one-block request's padding copies carry the same tail
        copies = np.arange(bs, length, bs)  # [nb - 1] where each copy starts
        firsts = np.concatenate((firsts, (firsts[single, None] + copies).ravel()))
        counts = np.concatenate((counts, np.repeat(counts[single], nb - 1)))
    stale_rows = _ranges(firsts, counts)
    if lo is None:
        bias = _bias_rows(length)[length - group_lens]  # [Bg, length]
    else:  # [lo, len) of each row: a compare over window-sized rows
        position = np.arange(length)
        bias = np.where((position >= lo[:, None]) & (position < group_lens[:, None]),
                        np.float32(0.0), np.float32(-np.inf))
    return DecodeGroup(None if index is None else to(starts[index]),
                       to(rows.astype(np.int64).ravel()),
                       to(stale_rows) if len(stale_rows) else None,
                       to(bias[:, None, None, :]))


@functools.lru_cache(maxsize=16)
def _bias_rows(length: int) -> np.ndarray:
    """Row i of the [length + 1, length] read-only view is 0 for the first length - i
    positions and -inf after: windows onto one template, so a group's bias is one
    gather of rows (a compare and a select over the whole [Bg, length] cost twice as
    much). A step has a few group lengths; 16 templates of a 32k context are 4 MB."""
    template = np.zeros(2 * length, dtype=np.float32)
    template[length:] = -np.inf
    return np.lib.stride_tricks.sliding_window_view(template, length)


def _ranges(firsts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The concatenation of range(first, first + count) for each pair (int64 firsts:
    int64 rows, as `index_fill_` wants)."""
    ends = counts.cumsum()
    offsets = np.arange(int(ends[-1]) if len(ends) else 0) - np.repeat(ends - counts, counts)
    return np.repeat(firsts, counts) + offsets


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                    query_start_loc: list[int], seq_lens: list[int], scale: float,
                    sliding_window: int | None = None, softcap: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of each request's query rows over its paged context.

    query:           [num_tokens, num_heads, head_dim]
    kv_cache:        [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables:    [num_reqs, max_blocks_per_req] int32 (rows padded with any block id)
    query_start_loc: num_reqs + 1 offsets into the query rows (host ints)
    seq_lens:        num_reqs context lengths, this step's tokens included (host ints)
    sliding_window:  W: a query at position p sees keys p - W < j <= p; None: all j <= p
    softcap:         c: scores become c * tanh(score / c) before the mask; None: off
    sinks:           [num_heads] attention sinks (module docstring); None: off
    returns          [num_tokens, num_heads, head_dim], query's dtype

    Single-token queries (decodes) are computed together in one padded batch; longer
    queries one request at a time with SDPA. Accumulation is in fp32 (bf16 probabilities
    multiply V in bf16, as in the Triton kernel).
    """
    assert query_start_loc[-1] == query.shape[0]
    plan = plan_attention(block_tables, query_start_loc, seq_lens, kv_cache.shape[2],
                          sliding_window=sliding_window)
    return planned_attention(query, kv_cache, plan, scale, softcap=softcap, sinks=sinks)


def planned_attention(query: torch.Tensor, kv_cache: torch.Tensor, plan: AttentionPlan,
                      scale: float, key: torch.Tensor | None = None,
                      value: torch.Tensor | None = None, softcap: float | None = None,
                      prefill: PrefillAttention | None = None,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    """`paged_attention` with the index work done (`plan_attention`, which fixed the
    sliding window). key, value: [num_tokens, num_kv_heads, head_dim], this step's own
    (already in the cache); a fresh prompt attends to them directly instead of
    gathering them back. `prefill`: what attends a prompt's queries causally (the CPU's
    C++ op, fp32 and bf16) in place of SDPA, where there is no window, softcap or
    sinks."""
    _, num_heads, head_dim = query.shape
    num_kv_heads, kv_head_dim = kv_cache.shape[3:]
    assert kv_head_dim == head_dim and num_heads % num_kv_heads == 0
    assert softcap is None or softcap > 0, softcap
    assert sinks is None or sinks.shape == (num_heads,), (None if sinks is None
                                                          else sinks.shape)
    if len(plan.decodes) == 1 and plan.decodes[0].rows is None:  # a decode-only step
        return _decode_attention(query, kv_cache, plan.decodes[0], plan.scratch, scale,
                                 softcap, sinks)
    out = torch.empty_like(query)
    for group in plan.decodes:
        assert group.rows is not None
        out.index_copy_(0, group.rows, _decode_attention(
            query.index_select(0, group.rows), kv_cache, group, plan.scratch, scale,
            softcap, sinks))
    window = plan.sliding_window
    for p in plan.prefills:
        if p.fresh and key is not None and value is not None:
            k, v = key[p.start:p.end], value[p.start:p.end]
            if kv_cache.dtype != k.dtype:  # what the cache holds, as a later chunk reads it
                k, v = (to_cache_dtype(t, kv_cache.dtype).to(t.dtype) for t in (k, v))
        else:
            k, v = (t.view(-1, num_kv_heads, head_dim)[:p.seq_len - p.key_start]
                    .to(query.dtype) for t in _gather(kv_cache, p.blocks, plan.scratch))
        if window is None and softcap is None and sinks is None:
            attend = (prefill if prefill is not None and query.dtype in PREFILL_DTYPES
                      else _prefill_attention)
            out[p.start:p.end] = attend(query[p.start:p.end], k, v, scale)
        else:
            out[p.start:p.end] = _tiled_prefill_attention(query[p.start:p.end], k, v, scale,
                                                          p.key_start, window, softcap,
                                                          sinks)
    return out


def _gather(kv_cache: torch.Tensor, blocks: torch.Tensor, scratch: GatherScratch
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_cache: [2, num_blocks, block_size, H_kv, D]; blocks: [N] int64 -> keys and
    values [N, block_size * H_kv * D] in `scratch`. Whole blocks: index_select with one
    index per block copies several times faster than one per token."""
    num_blocks = kv_cache.shape[1]
    k, v = scratch.take(blocks.numel(), kv_cache[0, 0].numel(), kv_cache)
    torch.index_select(kv_cache[0].view(num_blocks, -1), 0, blocks, out=k)
    torch.index_select(kv_cache[1].view(num_blocks, -1), 0, blocks, out=v)
    return k, v


def _sdpa_input(t: torch.Tensor) -> torch.Tensor:
    """t as SDPA takes it here: fp16 upcast to fp32, fp32 and bf16 as they are. torch's
    CPU flash-attention kernel accumulates bf16 in fp32 (scores, softmax, output) and
    rounds the probabilities to bf16 before P @ V, as the Triton kernel does; upcasting
    the gathered K/V first copied them twice over and cost 8-11% of a bf16 48-request
    run (Intel Xeon, BENCHMARKS.md) for no measurable accuracy (max error against a
    float64 reference 0.0087 against 0.0078: the output's own bf16 rounding). fp16 keeps
    the upcast: not measured."""
    return t.float() if t.dtype == torch.float16 else t


def _mask_like(bias: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """An additive mask in the query's dtype (0 and -inf are exact in every float type).
    SDPA accepts an fp32 mask beside a bf16 or fp16 query, but torch's cuDNN backend,
    its default on Hopper with a recent cuDNN, reinterprets the fp32 buffer as 16-bit
    values and returns wrong attention without an error (pytorch PR #191612); the first
    H200 run measured errors of up to 3.2 against a float64 reference here. On the CPU
    the two dtypes cost the same (measured) and give identical outputs."""
    return bias if bias.dtype == query.dtype else bias.to(query.dtype)


def _prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
                       ) -> torch.Tensor:
    """q: [Q, H, D] (the last Q positions); k, v: [L, H_kv, D] -> [Q, H, D].

    Batched 4-D ([1, heads, len, D]) on purpose: torch's CPU flash-attention kernel
    takes only 4-D inputs, and 3-D ones fall to the math path, which materializes the
    [H, Q, L] scores: 5x slower for a 1500-token prompt, 1.7x at 300 (2 cores). A later
    chunk's mask is an additive bias, which that kernel takes faster than a bool mask."""
    q_len, seq_len = q.shape[0], k.shape[0]
    qt, kt, vt = (_sdpa_input(t.transpose(0, 1)).unsqueeze(0) for t in (q, k, v))  # [1, h, len, D]
    if q_len == seq_len:
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale,
                                           enable_gqa=True)
    else:  # a later chunk of a prompt: query i sits at position seq_len - q_len + i
        pos_q = torch.arange(seq_len - q_len, seq_len, device=q.device)
        future = torch.arange(seq_len, device=q.device)[None, :] > pos_q[:, None]  # [Q, L]
        bias = torch.zeros(future.shape, dtype=qt.dtype, device=q.device).masked_fill_(
            future, -math.inf)  # in the query's dtype: see `_mask_like`
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=bias, scale=scale,
                                           enable_gqa=True)
    return o[0].transpose(0, 1).to(q.dtype)


def _decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, group: DecodeGroup,
                      scratch: GatherScratch, scale: float, softcap: float | None = None,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [Bg, H, D], one query per request at its last position -> [Bg, H, D].

    Grouped-query attention without repeating K/V: the G = H / H_kv query heads that
    share a KV head become G query rows of that head's attention ([Bg, H_kv, G, D]
    against [Bg, H_kv, L, D]); one mask row serves them all. Soft-capped scores and
    sinks are computed explicitly (`_explicit_attention`)."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    length = group.bias.shape[-1]
    k, v = _gather(kv_cache, group.blocks, scratch)
    if k.dtype != q.dtype:  # an e4m3 cache (kv_cache_dtype="fp8"): scale 1.0
        k, v = k.to(q.dtype), v.to(q.dtype)
    if group.stale is not None:
        for t in (k, v):
            t.view(-1, num_kv_heads * head_dim).index_fill_(0, group.stale, 0.0)
    k, v = (_sdpa_input(t.view(batch, length, num_kv_heads, head_dim).transpose(1, 2))
            for t in (k, v))  # [Bg, H_kv, L, D]
    # q may be a view into the step's fused q/k rows: SDPA is ~20% slower on it strided.
    groups = _sdpa_input(q).contiguous().view(batch, num_kv_heads, num_heads // num_kv_heads,
                                        head_dim)
    if softcap is not None or sinks is not None:
        o = _explicit_attention(groups, k, v, group.bias, scale, softcap,
                                None if sinks is None else sinks.view(num_kv_heads, -1, 1))
        return o.reshape(batch, num_heads, head_dim).to(q.dtype)
    group.bias = _mask_like(group.bias, groups)  # once per step: the plan serves every layer
    o = F.scaled_dot_product_attention(groups, k, v, attn_mask=group.bias, scale=scale)
    return o.reshape(batch, num_heads, head_dim).to(q.dtype)


# Query rows per tile of a windowed prompt (at least the window): each tile sees only the
# keys its rows' windows hold, so a prompt of Q tokens scores about Q * (rows + W) pairs
# instead of Q * L, in few enough SDPA calls that their overhead stays small.
PREFILL_TILE_ROWS = 256
# fp32 scores per soft-capped tile (64 MiB): explicit scores of a long prompt's every row
# at once would take H * Q * L of them (a 4k-token prompt with 16 heads: 1 GiB).
SOFTCAP_SCORES = 1 << 24


def _tiled_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             scale: float, key_start: int, window: int | None,
                             softcap: float | None, sinks: torch.Tensor | None = None
                             ) -> torch.Tensor:
    """Windowed, soft-capped or sinking attention of a prompt or chunk, a tile of query
    rows at a time. q: [Q, H, D], the last Q positions of the context; k, v: [L - key_start,
    H_kv, D], its keys from position key_start on -> [Q, H, D].

    A query at p sees keys j <= p and, under a window W, j > p - W: each tile takes only
    the keys from its first row's first one to its last row, so long prompts with small
    windows cost window-sized work; soft-capped tiles are also kept under
    SOFTCAP_SCORES scores (as are tiles with sinks: both materialize their scores)."""
    q_len, num_heads = q.shape[0], q.shape[1]
    seq_len = key_start + k.shape[0]
    rows = q_len if window is None else max(window, PREFILL_TILE_ROWS)
    if softcap is not None or sinks is not None:
        span = seq_len if window is None else rows + window  # keys a tile sees, at most
        rows = max(1, min(rows, SOFTCAP_SCORES // (num_heads * span)))
    out = torch.empty_like(q)
    for r0 in range(0, q_len, rows):
        r1 = min(q_len, r0 + rows)
        p0, p1 = seq_len - q_len + r0, seq_len - q_len + r1  # the tile's query positions
        j0 = key_start if window is None else max(key_start, p0 - window + 1)
        pos_q = torch.arange(p0, p1, device=q.device)[:, None]
        pos_k = torch.arange(j0, p1, device=q.device)[None, :]
        hidden = pos_k > pos_q  # [rows, keys]
        if window is not None:
            hidden |= pos_k <= pos_q - window
        keys = slice(j0 - key_start, p1 - key_start)
        out[r0:r1] = _masked_prefill_attention(q[r0:r1], k[keys], v[keys], hidden, scale,
                                               softcap, sinks)
    return out


def _masked_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              hidden: torch.Tensor, scale: float, softcap: float | None,
                              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [Q, H, D]; k, v: [K, H_kv, D]; hidden: [Q, K] bool, the pairs masked out ->
    [Q, H, D]. SDPA with an additive mask, or explicit scores when soft-capped or with
    sinks (the G query heads of a KV head as [H_kv, G, Q, D] against [H_kv, 1, K, D]:
    no repeated K/V)."""
    q_len, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if softcap is None and sinks is None:
        qt, kt, vt = (_sdpa_input(t.transpose(0, 1)).unsqueeze(0) for t in (q, k, v))
        bias = torch.zeros(hidden.shape, dtype=qt.dtype, device=q.device).masked_fill_(
            hidden, -math.inf)  # in the query's dtype: see `_mask_like`
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=bias, scale=scale,
                                           enable_gqa=True)
        return o[0].transpose(0, 1).to(q.dtype)
    groups = q.transpose(0, 1).reshape(num_kv_heads, num_heads // num_kv_heads, q_len,
                                       head_dim)  # [H_kv, G, Q, D]
    kt, vt = (t.transpose(0, 1).unsqueeze(1) for t in (k, v))  # [H_kv, 1, K, D]
    bias = torch.zeros(hidden.shape, dtype=torch.float32, device=q.device).masked_fill_(
        hidden, -math.inf)
    o = _explicit_attention(groups, kt, vt, bias, scale, softcap,  # [H_kv, G, Q, D]
                            None if sinks is None else sinks.view(num_kv_heads, -1, 1, 1))
    return o.reshape(num_heads, q_len, head_dim).transpose(0, 1).to(q.dtype)


def _explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        bias: torch.Tensor, scale: float, softcap: float | None,
                        sinks: torch.Tensor | None) -> torch.Tensor:
    """Attention with its scores materialized, in fp32, as transformers' eager path
    computes Gemma 2's soft-capping (s = q k^T * scale; s = softcap * tanh(s /
    softcap); s += bias; softmax; @ v) and gpt-oss's sinks (one more logit per head in
    each softmax's denominator, module docstring): SDPA has no hook for either.
    q: [..., M, D]; k, v: [..., L, D] (broadcast); bias: additive 0 / -inf,
    broadcastable to [..., M, L]; sinks: broadcastable to [..., M, 1] -> [..., M, D]
    fp32. Every row sees at least one key (its own), so no row is all -inf."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2))  # [..., M, L]
    if softcap is not None:
        scores = scores.mul_(scale / softcap).tanh_().mul_(softcap).add_(bias)
    else:
        scores = scores.mul_(scale).add_(bias)
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1), v.float())
    sink = sinks.float()  # [..., 1]
    top = torch.maximum(scores.amax(dim=-1, keepdim=True), sink)  # [..., M, 1]
    weights = torch.exp(scores - top)
    total = weights.sum(dim=-1, keepdim=True) + torch.exp(sink - top)
    return torch.matmul(weights / total, v.float())
