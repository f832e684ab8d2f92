"""Fused mixture-of-experts for CUDA: a token's top-k experts' SwiGLU MLPs, weighted by
the router, in a memset and five launches whatever the number of experts (vLLM's
fused_moe): two small align kernels, two grouped GEMMs and a sum.

    out[t] = sum_k topk_weights[t, k] * (silu(x[t] @ gate_e^T) * (x[t] @ up_e^T)) @ w2[e]^T
             with e = topk_ids[t, k], gate_e = w13[e, :I], up_e = w13[e, I:]

A loop over experts would launch three GEMMs per expert (384 for Qwen3-30B-A3B's 128)
and most would be a few rows. Instead the T*K (token, slot) pairs, numbered
pair = t * K + k, are grouped by expert and each expert's run padded to a multiple of
BLOCK_M, so that every tile of BLOCK_M sorted rows belongs to one expert:

    sorted_token_ids  | e0 e0 e0 -- | e2 e2 e2 e2 | e2 -- -- -- | e5 -- -- -- |  (-- = padding,
    expert_ids        |     0       |     2       |     2       |     5       |   value P = T*K)
                        block 0       block 1       block 2       block 3 ...     (BLOCK_M = 4)

1. align (`moe_align_block_size`, two small kernels): count each expert's pairs, place
   every pair in its expert's run, mark the padding. No host synchronisation: the
   buffers take the static bound on the padded length, P + min(E, P) * (BLOCK_M - 1)
   (each expert that has pairs pads at most BLOCK_M - 1 rows, and at most min(E, P)
   have any), so the launch grids depend on shapes alone and a decode step can run it
   inside a CUDA graph. Programs of blocks past the real padded length (read on the
   device from `num_tokens_post_padded`) return at once; experts no token chose have
   no blocks at all. The order of pairs within a run is not deterministic (chunks of
   pairs reserve their places with an atomic add); the output is, since each row of a
   tile is computed alone.
2. `_moe_gate_up_kernel`: each program takes one block of sorted rows and BLOCK_N
   columns of the expert's gate and of its up projection side by side, and writes
   silu(gate) * up, computed from the fp32 accumulators, to an intermediate [P, I] at
   each row's pair (the gate-up product itself is never stored).
3. `_moe_down_kernel`: the same grouping over the intermediate and w2, each row scaled
   by its routing weight, into a [P, H] buffer at each row's pair.
4. The sum over the K slots of each token: a torch sum over the [T, K, H] view (none
   for K = 1). Each pair owns its row until then, so no atomics and a fixed order.

Packed experts (int4 / int8 codes, `quantization="int4"` or an integer checkpoint's
experts: executor/model/moe.py) come as one kernels/quant.py PackedWeight per stacked
weight, all E * N rows, expert e's rows e * N to (e + 1) * N: both GEMMs then read the
codes (BITS > 0) and dequantize each [BLOCK_K, BLOCK_N] tile in registers as
triton_quant.py does, the reduction tile inside one group (BLOCK_K at most the group
size, so a tile takes one row of scales and zeros), and multiply in x's dtype.

gpt-oss's experts (executor/model/gpt_oss.py) add a bias to each projection (b13 [E, 2I]
after the gate-up GEMM, b2 [E, H] after the down GEMM, before the routing weight) and
take a clamped SwiGLU instead of SiLU-and-mul (SWIGLU: (up + 1) * gate * sigmoid(alpha *
gate), gate <= limit, |up| <= limit), both in the fp32 epilogues.

Everything accumulates in fp32; fp32 inputs use an "ieee" `tl.dot` (no TF32). The
intermediate and the per-pair outputs are rounded to x's dtype, as vLLM's caches are.
Under TRITON_INTERPRET=1 (CPU tests) every load is cast to fp32 first (CAST_FP32): the
interpreter gets bf16 arithmetic and bf16 `tl.dot` wrong. I and H may be any size (the
tiles are masked); the tile sizes are vLLM-like defaults (`moe_tiles`), not yet tuned
on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagellm.kernels.quant import PackedWeight
from pagellm.kernels.triton_attention import interpreting

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Elements of the align kernels' [pairs x experts] one-hot tiles: 32 int32 registers a
# thread at 8 warps.
_ALIGN_TILE = 8192
_ALIGN_WARPS = 8


@dataclass(frozen=True)
class MoeTiles:
    """Tile sizes of one fused_moe call. The down projection's tiles are 2 * block_n
    wide: it keeps one accumulator where the gate-up kernel keeps two, so both kernels
    hold the same registers and shared memory per program."""

    block_m: int  # sorted rows per program; each expert's run is padded to a multiple
    block_n: int  # gate (and up) columns per gate-up program
    block_k: int  # reduction step of both GEMMs
    num_warps: int = 4
    num_stages: int = 3


def moe_tiles(num_tokens: int, top_k: int, num_experts: int, dtype: torch.dtype) -> MoeTiles:
    """Tiles for a call, by the pairs each expert gets on average: 16 rows where it is
    a few (decode: Qwen3-30B-A3B's 8 of 128 experts leave most runs of one row, and a
    taller tile would be mostly padding), 32 and then 64 as runs grow (prefill: each
    weight tile loaded then serves more rows). Wide reduction steps in decode, where a
    program is little more than a stream of weights. fp32 halves block_k to keep the
    same shared memory: at most 72 KiB a program (64-row tiles, 3 stages on sm_90),
    under the 99 KiB of sm_86/sm_89. fp32 inputs (tests, not models) stop at 32 rows.

    vLLM-like sizes (its default and tuned configs for E=128, N=768 on the H100),
    checked to compile without spills for sm_90 and sm_80
    (tests/support/compile_kernels.py), not yet timed on a GPU."""
    per_expert = num_tokens * top_k / num_experts
    fp32 = dtype.itemsize == 4
    if per_expert <= 16:
        return MoeTiles(block_m=16, block_n=32, block_k=64 if fp32 else 128)
    if fp32:
        # An "ieee" fp32 dot is FMAs on operands held in registers (no tensor cores):
        # 64-row tiles spilled on sm_90 even at 8 warps; 32 rows at 8 warps do not.
        return MoeTiles(block_m=32, block_n=64, block_k=32, num_warps=8)
    return MoeTiles(block_m=32 if per_expert <= 48 else 64, block_n=64, block_k=64)


# --------------------------------------------------------------------------- align


# Integers that only bound masks are not specialized on (Triton would compile a variant
# for multiples of 16 and one for 1): one binary per tile size serves every batch.
@triton.jit(do_not_specialize=["num_pairs", "num_experts"])
def _moe_align_count_kernel(
    topk_ids_ptr,  # [P] int32 or int64: the expert of each (token, slot) pair
    expert_cursor_ptr,  # [E] int32, zeroed: ends as each expert's number of pairs
    chunk_offset_ptr,  # [num_chunks, E] int32: where a chunk's pairs start in each run
    rank_ptr,  # [P] int32: a pair's rank among its chunk's pairs of the same expert
    num_pairs,
    num_experts,
    CHUNK: tl.constexpr,  # pairs per program
    EXPERTS_PAD: tl.constexpr,  # E rounded up to a power of two
):
    chunk = tl.program_id(0)
    pairs = chunk * CHUNK + tl.arange(0, CHUNK)
    valid = pairs < num_pairs
    ids = tl.load(topk_ids_ptr + pairs, mask=valid, other=0).to(tl.int32)
    experts = tl.arange(0, EXPERTS_PAD)
    onehot = ((ids[:, None] == experts[None, :]) & valid[:, None]).to(tl.int32)
    counts = tl.sum(onehot, axis=0)  # [EXPERTS_PAD]
    rank = tl.sum(tl.cumsum(onehot, axis=0) * onehot, axis=1) - 1  # [CHUNK]
    # One lane per expert: the chunk reserves counts[e] places in each run at once.
    reserve = (experts < num_experts) & (counts > 0)
    offset = tl.atomic_add(expert_cursor_ptr + experts, counts, mask=reserve)
    tl.store(chunk_offset_ptr + chunk * num_experts + experts, offset, mask=reserve)
    tl.store(rank_ptr + pairs, rank, mask=valid)


@triton.jit(do_not_specialize=["num_pairs", "num_experts", "max_blocks"])
def _moe_align_place_kernel(
    topk_ids_ptr,  # [P] int32 or int64
    expert_cursor_ptr,  # [E] int32: each expert's number of pairs
    chunk_offset_ptr,  # [num_chunks, E] int32
    rank_ptr,  # [P] int32
    sorted_token_ids_ptr,  # [max_blocks * BLOCK_M] int32 out: pair, or P for padding
    expert_ids_ptr,  # [max_blocks] int32 out: E for blocks past the padded length
    num_tokens_post_padded_ptr,  # [1] int32 out: the padded length
    num_pairs,
    num_experts,
    max_blocks,
    CHUNK: tl.constexpr,  # pairs per program, as in the count kernel
    EXPERTS_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCKS_PER_PROGRAM: tl.constexpr,
):
    """Program i places chunk i's pairs and fills blocks [i, i + 1) * BLOCKS_PER_PROGRAM:
    their expert and their padding slots. The two write disjoint slots (a run's first
    count slots, its rest), so they need no ordering."""
    pid = tl.program_id(0)
    experts = tl.arange(0, EXPERTS_PAD)
    real = experts < num_experts
    counts = tl.load(expert_cursor_ptr + experts, mask=real, other=0)
    padded = tl.cdiv(counts, BLOCK_M) * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    if pid == 0:
        tl.store(num_tokens_post_padded_ptr, tl.sum(padded, axis=0))

    pairs = pid * CHUNK + tl.arange(0, CHUNK)
    valid = pairs < num_pairs
    ids = tl.load(topk_ids_ptr + pairs, mask=valid, other=0).to(tl.int32)
    onehot = ids[:, None] == experts[None, :]  # [CHUNK, EXPERTS_PAD]
    run_start = tl.sum(tl.where(onehot, starts[None, :], 0), axis=1)
    offset = tl.load(chunk_offset_ptr + pid * num_experts + ids, mask=valid, other=0)
    rank = tl.load(rank_ptr + pairs, mask=valid, other=0)
    tl.store(sorted_token_ids_ptr + run_start + offset + rank, pairs, mask=valid)

    blocks = pid * BLOCKS_PER_PROGRAM + tl.arange(0, BLOCKS_PER_PROGRAM)
    first = blocks * BLOCK_M
    # The block's expert: the number of runs that end at or before its first row
    # (empty runs included, so it is the first run that goes past it).
    before = (ends[None, :] <= first[:, None]) & real[None, :]  # [BLOCKS_PER_PROGRAM, EXPERTS_PAD]
    expert = tl.sum(before.to(tl.int32), axis=1)
    tl.store(expert_ids_ptr + blocks, expert, mask=blocks < max_blocks)
    # Past the end: no lane, or lane E's empty run at the end; either way all padding.
    mine = experts[None, :] == expert[:, None]
    block_start = tl.sum(tl.where(mine, starts[None, :], 0), axis=1)
    block_count = tl.sum(tl.where(mine, counts[None, :], 0), axis=1)
    slots = first[:, None] + tl.arange(0, BLOCK_M)[None, :]  # [BLOCKS_PER_PROGRAM, BLOCK_M]
    padding = (slots - block_start[:, None] >= block_count[:, None]) \
        & (blocks < max_blocks)[:, None]
    tl.store(sorted_token_ids_ptr + slots, tl.zeros_like(slots) + num_pairs, mask=padding)


@dataclass(frozen=True)
class MoeAlignment:
    """The (token, slot) pairs grouped by expert, in runs padded to whole blocks.

    sorted_token_ids:       [max_blocks * block_m] int32: pair index t * K + k, or
                            P = T * K for a padding slot (rows a kernel masks off)
    expert_ids:             [max_blocks] int32: the expert of each block; E for blocks
                            past the padded length, which no kernel reads
    num_tokens_post_padded: [1] int32: the padded length (device: never read on the host)
    """

    sorted_token_ids: torch.Tensor
    expert_ids: torch.Tensor
    num_tokens_post_padded: torch.Tensor
    block_m: int

    @property
    def max_blocks(self) -> int:
        """Blocks the GEMM grids launch: the static bound, most of them idle."""
        return self.expert_ids.shape[0]


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int,
                         block_m: int) -> MoeAlignment:
    """Group the pairs of topk_ids ([T, K] int32/int64, contiguous) by expert, each
    expert's run padded to a multiple of block_m (see the module docstring). Two
    launches and a memset, sized by shapes alone (CUDA-graph safe)."""
    num_pairs = topk_ids.numel()
    device = topk_ids.device
    max_blocks = triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m)
    experts_pad = triton.next_power_of_2(num_experts)
    chunk = max(16, min(1024, _ALIGN_TILE // experts_pad))
    num_chunks = triton.cdiv(num_pairs, chunk)
    blocks_per_program = max(1, min(64, _ALIGN_TILE // max(experts_pad, block_m)))
    cursor = torch.zeros(num_experts, dtype=torch.int32, device=device)
    chunk_offset = torch.empty(num_chunks, num_experts, dtype=torch.int32, device=device)
    rank = torch.empty(num_pairs, dtype=torch.int32, device=device)
    sorted_token_ids = torch.empty(max_blocks * block_m, dtype=torch.int32, device=device)
    expert_ids = torch.empty(max_blocks, dtype=torch.int32, device=device)
    num_tokens_post_padded = torch.empty(1, dtype=torch.int32, device=device)
    _moe_align_count_kernel[(num_chunks,)](
        topk_ids, cursor, chunk_offset, rank, num_pairs, num_experts,
        CHUNK=chunk, EXPERTS_PAD=experts_pad, num_warps=_ALIGN_WARPS)
    grid = (max(num_chunks, triton.cdiv(max_blocks, blocks_per_program)),)
    _moe_align_place_kernel[grid](
        topk_ids, cursor, chunk_offset, rank, sorted_token_ids, expert_ids,
        num_tokens_post_padded, num_pairs, num_experts, max_blocks,
        CHUNK=chunk, EXPERTS_PAD=experts_pad, BLOCK_M=block_m,
        BLOCKS_PER_PROGRAM=blocks_per_program, num_warps=_ALIGN_WARPS)
    return MoeAlignment(sorted_token_ids, expert_ids, num_tokens_post_padded, block_m)


# --------------------------------------------------------------------------- GEMMs


@triton.jit
def _packed_tile(q_ptr, s_ptr, z_ptr, k0, ks, rows, mask, row_mask, width,
                 BITS: tl.constexpr, GROUP: tl.constexpr):
    """[BLOCK_K, BLOCK_N] fp32: weight rows `rows` [BLOCK_N] (of all experts' stacked
    rows: expert e's row n is e * N + n) at input columns k0 + ks of a packed weight
    (kernels/quant.py's layout over `width` = E * N rows: qweight [K / P, width] int32,
    scales and zeros [K / G, width]), (code - zero) * scale. The tile lies in one group
    (BLOCK_K divides GROUP: the launcher sees to it), so it takes one row of scales and
    zeros."""
    PER_INT: tl.constexpr = 32 // BITS
    CODE: tl.constexpr = (1 << BITS) - 1
    kk = (k0 + ks).to(tl.int64)
    words = tl.load(q_ptr + (kk // PER_INT)[:, None] * width + rows[None, :], mask=mask,
                    other=0)
    codes = (words >> ((ks % PER_INT) * BITS)[:, None]) & CODE
    group = (k0 // GROUP) * width + rows  # (rows int64: every offset is)
    scale = tl.load(s_ptr + group, mask=row_mask, other=0.0).to(tl.float32)
    zero = tl.load(z_ptr + group, mask=row_mask, other=0.0).to(tl.float32)
    return (codes.to(tl.float32) - zero[None, :]) * scale[None, :]


@triton.jit(do_not_specialize=["num_pairs"])  # only bounds masks, as above
def _moe_gate_up_kernel(
    x_ptr,  # [T, H]
    w13_ptr,  # [E, 2 * I, H]: rows [:I] gate, [I:] up; packed (BITS): qweight [H / P, E * 2I]
    s13_ptr,  # packed: scales [H / G, E * 2I] (else unused)
    z13_ptr,  # packed: zeros [H / G, E * 2I] (else unused)
    inter_ptr,  # [P, I] out: silu(gate) * up of each pair
    b13_ptr,  # [E, 2 * I] gate then up biases (read only under HAS_BIAS)
    sorted_token_ids_ptr,  # [max_blocks * BLOCK_M] int32: pair, or P for padding
    expert_ids_ptr,  # [max_blocks] int32
    num_tokens_post_padded_ptr,  # [1] int32
    num_pairs,
    hidden,
    inter_size,
    num_experts,
    alpha,  # SWIGLU: the sigmoid's gain
    limit,  # SWIGLU: the clamp
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,  # sorted rows per program: all of one expert
    BLOCK_N: tl.constexpr,  # gate columns (and as many up columns) per program
    BLOCK_K: tl.constexpr,
    CAST_FP32: tl.constexpr,  # compute everything in fp32 (fp32 inputs, or interpreting)
    PRECISION: tl.constexpr,  # tl.dot input precision: "ieee" for fp32 inputs (no TF32)
    BITS: tl.constexpr,  # 0: w13 in x's dtype; 4 or 8: packed integer codes
    GROUP: tl.constexpr,  # packed: the group size along H
    HAS_BIAS: tl.constexpr,
    SWIGLU: tl.constexpr,  # gpt-oss's clamped SwiGLU instead of silu(gate) * up
):
    block = tl.program_id(0)
    if block * BLOCK_M >= tl.load(num_tokens_post_padded_ptr):
        return
    expert = tl.load(expert_ids_ptr + block).to(tl.int64)
    pair = tl.load(sorted_token_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = pair < num_pairs
    token = (pair // TOP_K).to(tl.int64)  # [BLOCK_M]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < inter_size
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token[:, None] * hidden + ks[None, :]  # [BLOCK_M, BLOCK_K]
    # [BLOCK_K, BLOCK_N]: column n of the tile is row n of the expert's gate
    gate_ptrs = w13_ptr + expert * 2 * inter_size * hidden + cols[None, :] * hidden \
        + ks[:, None]
    up_offset = inter_size * hidden
    gate_rows = expert * 2 * inter_size + cols  # packed: the expert's rows among all E * 2I
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, tl.cdiv(hidden, BLOCK_K)):
        k_mask = ks < hidden - k * BLOCK_K
        w_mask = k_mask[:, None] & col_mask[None, :]
        a = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        if BITS == 0:
            gate = tl.load(gate_ptrs, mask=w_mask, other=0.0)
            up = tl.load(gate_ptrs + up_offset, mask=w_mask, other=0.0)
        else:
            width = num_experts * 2 * inter_size
            gate = _packed_tile(w13_ptr, s13_ptr, z13_ptr, k * BLOCK_K, ks, gate_rows,
                                w_mask, col_mask, width, BITS, GROUP)
            up = _packed_tile(w13_ptr, s13_ptr, z13_ptr, k * BLOCK_K, ks,
                              gate_rows + inter_size, w_mask, col_mask, width, BITS, GROUP)
            if not CAST_FP32:
                gate = gate.to(x_ptr.dtype.element_ty)
                up = up.to(x_ptr.dtype.element_ty)
        if CAST_FP32:
            a = a.to(tl.float32)
            gate = gate.to(tl.float32)
            up = up.to(tl.float32)
        acc_gate = tl.dot(a, gate, acc_gate, input_precision=PRECISION)
        acc_up = tl.dot(a, up, acc_up, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
    if HAS_BIAS:
        bias = b13_ptr + expert * 2 * inter_size + cols
        acc_gate += tl.load(bias, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        acc_up += tl.load(bias + inter_size, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if SWIGLU:
        gate = tl.minimum(acc_gate, limit)
        up = tl.minimum(tl.maximum(acc_up, -limit), limit)
        h = gate / (1.0 + tl.exp(-alpha * gate)) * (up + 1.0)
    else:
        h = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up
    dest = inter_ptr + pair.to(tl.int64)[:, None] * inter_size + cols[None, :]
    tl.store(dest, h.to(inter_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_down_kernel(
    inter_ptr,  # [P, I]
    w2_ptr,  # [E, H, I]; packed (BITS): qweight [I / P, E * H]
    s2_ptr,  # packed: scales [I / G, E * H] (else unused)
    z2_ptr,  # packed: zeros [I / G, E * H] (else unused)
    out_ptr,  # [P, H] out: topk_weights * (inter @ w2[e]^T) of each pair
    b2_ptr,  # [E, H] biases (read only under HAS_BIAS)
    topk_weights_ptr,  # [P] fp32
    sorted_token_ids_ptr,  # [max_blocks * BLOCK_M] int32: pair, or P for padding
    expert_ids_ptr,  # [max_blocks] int32
    num_tokens_post_padded_ptr,  # [1] int32
    num_pairs,
    hidden,
    inter_size,
    num_experts,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # output (hidden) columns per program
    BLOCK_K: tl.constexpr,
    CAST_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    BITS: tl.constexpr,  # as the gate-up kernel's
    GROUP: tl.constexpr,  # packed: the group size along I
    HAS_BIAS: tl.constexpr,
):
    block = tl.program_id(0)
    if block * BLOCK_M >= tl.load(num_tokens_post_padded_ptr):
        return
    expert = tl.load(expert_ids_ptr + block).to(tl.int64)
    pair = tl.load(sorted_token_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = pair < num_pairs
    rows = pair.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < hidden
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = inter_ptr + rows[:, None] * inter_size + ks[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w2_ptr + expert * hidden * inter_size + cols[None, :] * inter_size \
        + ks[:, None]  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, tl.cdiv(inter_size, BLOCK_K)):
        k_mask = ks < inter_size - k * BLOCK_K
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & col_mask[None, :]
        if BITS == 0:
            w = tl.load(w_ptrs, mask=w_mask, other=0.0)
        else:
            w = _packed_tile(w2_ptr, s2_ptr, z2_ptr, k * BLOCK_K, ks, expert * hidden + cols,
                             w_mask, col_mask, num_experts * hidden, BITS, GROUP)
            if not CAST_FP32:
                w = w.to(inter_ptr.dtype.element_ty)
        if CAST_FP32:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b2_ptr + expert * hidden + cols, mask=col_mask,
                       other=0.0).to(tl.float32)[None, :]
    weight = tl.load(topk_weights_ptr + rows, mask=row_mask, other=0.0)
    acc = acc * weight[:, None]
    tl.store(out_ptr + rows[:, None] * hidden + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


# --------------------------------------------------------------------------- launcher


def _check(x: torch.Tensor, w13: Weights, w2: Weights, topk_weights: torch.Tensor,
           topk_ids: torch.Tensor) -> None:
    """Raise ValueError naming the first input that breaks fused_moe's contract. Expert
    ids are not range-checked: that would read them back to the host (a sync, and no
    CUDA graph); an id outside [0, E) is a device-side fault."""
    if x.dtype not in _DTYPES:
        raise ValueError(f"x must be fp32, fp16 or bf16, not {x.dtype}")
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous [T, H] tensor, got {tuple(x.shape)} "
                         f"with strides {x.stride()}")
    tokens, hidden = x.shape
    for name, w in (("w13", w13), ("w2", w2)):
        if isinstance(w, PackedWeight):
            for part, t in (("scales", w.scales), ("zeros", w.zeros)):
                if t.dtype != x.dtype or not t.is_contiguous():
                    raise ValueError(f"{name}'s {part} must be contiguous {x.dtype}, got "
                                     f"{t.dtype}")
            if w.perm is not None or not w.qweight.is_contiguous():
                raise ValueError(f"{name} must be packed contiguous, without act-order")
            continue
        if w.dtype != x.dtype:
            raise ValueError(f"{name} is {w.dtype}, x is {x.dtype}: they must match")
        if w.dim() != 3 or not w.is_contiguous():
            raise ValueError(f"{name} must be a contiguous [E, ., .] tensor, got "
                             f"{tuple(w.shape)} with strides {w.stride()}")
    experts = _num_experts(w2, hidden)
    num_experts, two_inter, w13_hidden = _stacked_shape(w13, experts)
    if two_inter % 2 or w13_hidden != hidden:
        raise ValueError(f"w13 must be [E, 2 * I, H] with H = {hidden} (x's), got "
                         f"{(num_experts, two_inter, w13_hidden)}")
    if _stacked_shape(w2, experts) != (num_experts, hidden, two_inter // 2):
        raise ValueError(f"w2 must be [E, H, I] = {(num_experts, hidden, two_inter // 2)} "
                         f"for w13 {(num_experts, two_inter, w13_hidden)}, got "
                         f"{_stacked_shape(w2, experts)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != tokens or not topk_ids.is_contiguous():
        raise ValueError(f"topk_ids must be a contiguous [T, K] tensor with T = {tokens}, "
                         f"got {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, not {topk_ids.dtype}")
    if not 0 < topk_ids.shape[1] <= num_experts:
        raise ValueError(f"top-k {topk_ids.shape[1]} must be in [1, E = {num_experts}]")
    if topk_weights.shape != topk_ids.shape or not topk_weights.is_contiguous():
        raise ValueError(f"topk_weights must be contiguous and shaped as topk_ids "
                         f"{tuple(topk_ids.shape)}, got {tuple(topk_weights.shape)}")
    if topk_weights.dtype != torch.float32:
        raise ValueError(f"topk_weights must be float32, not {topk_weights.dtype}")
    devices = {t.device for t in (x, topk_weights, topk_ids, *map(_data, (w13, w2)))}
    if len(devices) != 1:
        raise ValueError(f"fused_moe's inputs are on several devices: {sorted(map(str, devices))}")


# A stacked expert weight: [E, N, K] in x's dtype, or all E * N rows packed as one
# PackedWeight [E * N, K] (kernels/quant.py), expert e's rows e * N to (e + 1) * N.
Weights = torch.Tensor | PackedWeight


def _data(w: Weights) -> torch.Tensor:
    return w.qweight if isinstance(w, PackedWeight) else w


def _num_experts(w2: Weights, hidden: int) -> int:
    """E: w2's first dimension, or its E * H packed rows over x's hidden size H."""
    return w2.out_features // hidden if isinstance(w2, PackedWeight) else w2.shape[0]


def _stacked_shape(w: Weights, experts: int) -> tuple[int, int, int]:
    """(E, N, K) of a stacked weight (a packed one: its E * N rows over E)."""
    if not isinstance(w, PackedWeight):
        e, n, k = w.shape
        return e, n, k
    return experts, w.out_features // max(experts, 1), w.in_features


def _packing(w: Weights, block_k: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, int]]:
    """A weight's kernel arguments: (codes or weight, scales, zeros, BITS / GROUP /
    BLOCK_K), a packed weight's reduction tile inside one group (group sizes and tiles
    are powers of two: the smaller divides the larger)."""
    if isinstance(w, PackedWeight):
        return w.qweight, w.scales, w.zeros, dict(
            BITS=w.bits, GROUP=w.group_size, BLOCK_K=min(block_k, w.group_size))
    return w, w, w, dict(BITS=0, GROUP=1, BLOCK_K=block_k)


def fused_moe(x: torch.Tensor, w13: Weights, w2: Weights, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, tiles: MoeTiles | None = None,
              bias13: torch.Tensor | None = None, bias2: torch.Tensor | None = None,
              swiglu: tuple[float, float] | None = None) -> torch.Tensor:
    """The routed experts' SwiGLU MLPs, weighted and summed (see the module docstring).

    x:            [T, H] fp32/fp16/bf16, contiguous
    w13:          [E, 2 * I, H] x's dtype, contiguous: rows [:I] gate, [I:] up; or its
                  E * 2I rows as one PackedWeight (int4/int8 codes, scales and zeros in
                  x's dtype, dequantized tile by tile in the kernel)
    w2:           [E, H, I] x's dtype, contiguous; or its E * H rows packed likewise
    topk_weights: [T, K] fp32, contiguous: routing weights, applied as given
    topk_ids:     [T, K] int32/int64, contiguous: experts in [0, E)
    tiles:        tile sizes (None: `moe_tiles`), for tests and benchmarks
    bias13:       [E, 2 * I] (gate's, then up's) or None: added to the gate-up product
    bias2:        [E, H] or None: added to the down product, before the routing weight
    swiglu:       (alpha, limit): gpt-oss's clamped SwiGLU (module docstring) in place
                  of silu(gate) * up; None: SiLU
    returns       [T, H] x's dtype

    Reads nothing back to the host: its launches are fixed by the shapes, so it can be
    captured in a CUDA graph.
    """
    _check(x, w13, w2, topk_weights, topk_ids)
    tokens, hidden = x.shape
    num_experts, two_inter, _ = _stacked_shape(w13, _num_experts(w2, hidden))
    inter_size = two_inter // 2
    for bias, shape in ((bias13, (num_experts, two_inter)), (bias2, (num_experts, hidden))):
        if bias is not None and (tuple(bias.shape) != shape or not bias.is_contiguous()
                                 or bias.device != x.device):
            raise ValueError(f"an expert bias must be contiguous {shape} on {x.device}, "
                             f"got {tuple(bias.shape)} on {bias.device}")
    alpha, limit = swiglu if swiglu is not None else (1.0, 0.0)
    top_k = topk_ids.shape[1]
    if tokens == 0:
        return torch.empty_like(x)
    if tiles is None:
        tiles = moe_tiles(tokens, top_k, num_experts, x.dtype)
    align = moe_align_block_size(topk_ids, num_experts, tiles.block_m)
    num_pairs = tokens * top_k
    cast_fp32 = x.dtype == torch.float32 or interpreting()
    precision = "ieee" if cast_fp32 else None
    common = dict(CAST_FP32=cast_fp32, PRECISION=precision, num_warps=tiles.num_warps,
                  num_stages=tiles.num_stages)
    inter = torch.empty(num_pairs, inter_size, dtype=x.dtype, device=x.device)
    w, scales, zeros, packing = _packing(w13, tiles.block_k)
    _moe_gate_up_kernel[(align.max_blocks, triton.cdiv(inter_size, tiles.block_n))](
        x, w, scales, zeros, inter, x if bias13 is None else bias13, align.sorted_token_ids,
        align.expert_ids, align.num_tokens_post_padded, num_pairs, hidden, inter_size,
        num_experts, float(alpha), float(limit), TOP_K=top_k, BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n, HAS_BIAS=bias13 is not None, SWIGLU=swiglu is not None,
        **packing, **common)
    down_n = 2 * tiles.block_n
    per_pair = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    w, scales, zeros, packing = _packing(w2, tiles.block_k)
    _moe_down_kernel[(align.max_blocks, triton.cdiv(hidden, down_n))](
        inter, w, scales, zeros, per_pair, x if bias2 is None else bias2, topk_weights,
        align.sorted_token_ids, align.expert_ids, align.num_tokens_post_padded, num_pairs,
        hidden, inter_size, num_experts, BLOCK_M=tiles.block_m, BLOCK_N=down_n,
        HAS_BIAS=bias2 is not None, **packing, **common)
    if top_k == 1:
        return per_pair
    # torch sums 16-bit inputs in fp32 and rounds once
    return per_pair.view(tokens, top_k, hidden).sum(dim=1)
