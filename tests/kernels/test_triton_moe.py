"""The fused mixture-of-experts kernels (kernels/triton_moe.py) against a token-by-token
torch reference written here, through Triton's interpreter on the CPU
(TRITON_INTERPRET=1, set in conftest) or on a GPU.

Shapes hit the kernels' edges: I and H that are multiples of neither the row nor the
reduction tile (ragged column tiles and reduction steps in both GEMMs), experts that no
token picks (their weights NaN: touching them poisons the output), experts whose runs
span several blocks, and a static grid whose blocks past the padded length must do
nothing."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import runs_triton_kernels

from pagellm.kernels import triton_moe as tm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HIDDEN, INTER = 80, 72  # neither a multiple of 32 or 64: every tile is ragged somewhere


def reference_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                  swiglu: tuple[float, float] | None = None) -> torch.Tensor:
    """out[t] = sum_k w[t, k] * W2_e (silu(G_e x_t) * (U_e x_t)), one token and one
    expert at a time, in fp32 on the CPU. With biases and `swiglu` (alpha, limit):
    gpt-oss's experts as transformers writes them, W2_e h + b2_e with h = (u + 1) * g *
    sigmoid(alpha * g), g = min(G_e x_t + bg_e, limit), u = clamp(U_e x_t + bu_e)."""
    x, w13, w2 = x.float().cpu(), w13.float().cpu(), w2.float().cpu()
    inter = w2.shape[2]
    out = torch.zeros(x.shape)
    for t in range(x.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            gate, up = w13[e, :inter] @ x[t], w13[e, inter:] @ x[t]
            if b13 is not None:
                gate, up = gate + b13[e, :inter].float().cpu(), up + b13[e, inter:].float().cpu()
            if swiglu is None:
                h = F.silu(gate) * up
            else:
                alpha, limit = swiglu
                gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
                h = (up + 1) * gate * torch.sigmoid(alpha * gate)
            y = w2[e] @ h
            if b2 is not None:
                y = y + b2[e].float().cpu()
            out[t] += float(topk_weights[t, k]) * y
    return out


def make_moe(tokens: int, top_k: int, num_experts: int, dtype: torch.dtype,
             unused: int = 3, seed: int = 0, hidden: int = HIDDEN, inter: int = INTER
             ) -> tuple[torch.Tensor, ...]:
    """x, w13, w2, topk_weights, topk_ids: each token picks top_k distinct experts among
    all but `unused` of them (scattered, not the last ones), whose weights are NaN."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter ** 0.5
    experts = torch.randperm(num_experts, generator=gen)
    picked, never = experts[unused:], experts[:unused]
    w13[never] = float("nan")
    w2[never] = float("nan")
    topk_ids = torch.stack([picked[torch.randperm(len(picked), generator=gen)[:top_k]]
                            for _ in range(tokens)]).to(torch.int32)
    topk_weights = 0.1 + torch.rand(tokens, top_k, generator=gen)  # none 1, none alike
    return (x.to(DEVICE, dtype), w13.to(DEVICE, dtype), w2.to(DEVICE, dtype),
            topk_weights.to(DEVICE), topk_ids.to(DEVICE))


def assert_matches(got: torch.Tensor, expected: torch.Tensor) -> None:
    """fp32: fp32 rounding, relative to the output's scale. bf16: the intermediate and
    each slot's output are rounded to bf16 before the sum (and the interpreter truncates
    instead of rounding): a few bf16 steps of the scale; a wrong weight or expert is
    off by O(1) of it."""
    assert torch.isfinite(got).all()
    scale = expected.abs().max().item()
    if got.dtype == torch.float32:
        torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=1e-5 * scale)
    else:
        torch.testing.assert_close(got.float().cpu(), expected, rtol=0, atol=2**-5 * scale)


# (top_k, num_experts, tokens, dtype): every top-k and token count in fp32; bf16 (the
# interpreter's slowest) at a decode and at runs of several pairs an expert.
CASES = [pytest.param(k, e, t, dtype, id=f"top{k}-E{e}-T{t}-{name}")
         for k, e in ((1, 8), (2, 8), (8, 16)) for t in (1, 3, 37)
         for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16"))
         if dtype == torch.float32 or t != 3]


@runs_triton_kernels
@pytest.mark.parametrize(("top_k", "num_experts", "tokens", "dtype"), CASES)
def test_fused_moe_matches_token_by_token_reference(top_k, num_experts, tokens, dtype):
    x, w13, w2, topk_weights, topk_ids = make_moe(tokens, top_k, num_experts, dtype)
    got = tm.fused_moe(x, w13, w2, topk_weights, topk_ids)
    assert got.shape == x.shape and got.dtype == dtype
    assert_matches(got, reference_moe(x, w13, w2, topk_weights, topk_ids))


@runs_triton_kernels
def test_runs_longer_than_a_block_and_int64_ids_match_reference():
    """16-row tiles on runs of about 25 pairs: each expert's run spans two blocks, the
    second padded; 32-wide columns and reduction steps: several tiles, the last ragged."""
    x, w13, w2, topk_weights, topk_ids = make_moe(37, 4, 8, torch.float32, unused=2)
    tiles = tm.MoeTiles(block_m=16, block_n=32, block_k=32)
    got = tm.fused_moe(x, w13, w2, topk_weights, topk_ids.long(), tiles=tiles)
    assert_matches(got, reference_moe(x, w13, w2, topk_weights, topk_ids))


def packed(w: torch.Tensor, bits: int, group: int) -> tm.PackedWeight:
    """A stacked [E, N, K] weight's E * N rows quantized as one PackedWeight (scales and
    zeros in w's dtype: the kernels' layout for packed experts)."""
    from pagellm.kernels.quant import quantize

    return quantize(w.reshape(-1, w.shape[2]).float(), bits, group, w.dtype)


def dequantized(w: tm.PackedWeight, experts: int) -> torch.Tensor:
    """What a packed stacked weight stands for, [E, N, K] fp32."""
    from pagellm.kernels.quant import dequantize

    return dequantize(w).reshape(experts, -1, w.in_features)


@runs_triton_kernels
@pytest.mark.parametrize(("bits", "tokens", "dtype", "which"), [
    (4, 1, torch.float32, "both"), (4, 37, torch.float32, "both"), (8, 37, torch.float32, "both"),
    (4, 5, torch.bfloat16, "both"), (8, 5, torch.float32, "w13"), (4, 5, torch.float32, "w2")])
def test_packed_experts_match_the_reference_on_their_dequantized_weights(bits, tokens, dtype,
                                                                         which):
    """Experts packed as int4/int8 codes in groups of 32 (quantize-on-load's and integer
    checkpoints' experts on CUDA), dequantized tile by tile in both GEMMs (or one of
    them packed, the other not): the reference runs on the weights the codes stand for.
    H = 96 and I = 64 leave ragged reduction tiles; never-picked experts are NaN."""
    x, w13, w2, topk_weights, topk_ids = make_moe(tokens, 2, 8, dtype, seed=bits,
                                                  hidden=96, inter=64)
    q13 = packed(w13, bits, 32) if which in ("both", "w13") else w13
    q2 = packed(w2, bits, 32) if which in ("both", "w2") else w2
    got = tm.fused_moe(x, q13, q2, topk_weights, topk_ids)
    assert got.shape == x.shape and got.dtype == dtype
    r13 = dequantized(q13, 8) if isinstance(q13, tm.PackedWeight) else w13
    r2 = dequantized(q2, 8) if isinstance(q2, tm.PackedWeight) else w2
    assert_matches(got, reference_moe(x, r13, r2, topk_weights, topk_ids))


@runs_triton_kernels
@pytest.mark.parametrize(("tokens", "dtype", "bits"), [(37, torch.float32, 0),
                                                       (1, torch.bfloat16, 0),
                                                       (5, torch.float32, 4)])
def test_gpt_oss_biases_and_clamped_swiglu_match_the_reference(tokens, dtype, bits):
    """gpt-oss's experts: a bias on each projection and (up + 1) * gate *
    sigmoid(alpha * gate) with the clamps biting (limit 0.7 on values ~ N(0, 1)), dense
    and packed; without either, the output is another."""
    x, w13, w2, topk_weights, topk_ids = make_moe(tokens, 2, 8, dtype, seed=5, hidden=96,
                                                  inter=64)
    gen = torch.Generator().manual_seed(6)
    b13 = (0.5 * torch.randn(8, 128, generator=gen)).to(DEVICE, dtype)
    b2 = (0.5 * torch.randn(8, 96, generator=gen)).to(DEVICE, dtype)
    swiglu = (1.702, 0.7)
    q13, q2 = (w13, w2) if not bits else (packed(w13, bits, 32), packed(w2, bits, 32))
    got = tm.fused_moe(x, q13, q2, topk_weights, topk_ids, bias13=b13, bias2=b2,
                       swiglu=swiglu)
    r13, r2 = (w13, w2) if not bits else (dequantized(q13, 8), dequantized(q2, 8))
    expected = reference_moe(x, r13, r2, topk_weights, topk_ids, b13, b2, swiglu)
    assert_matches(got, expected)
    for plain in (dict(bias13=b13, bias2=b2), dict(swiglu=swiglu)):
        other = tm.fused_moe(x, q13, q2, topk_weights, topk_ids, **plain)
        assert not torch.allclose(other.float().cpu(), expected, atol=0.05)
    with pytest.raises(ValueError, match="an expert bias must be contiguous"):
        tm.fused_moe(x, q13, q2, topk_weights, topk_ids, bias13=b2)


@runs_triton_kernels
@pytest.mark.parametrize(("tokens", "top_k", "num_experts", "block_m"), [
    (1, 8, 128, 16),  # decode: 8 runs of one pair among 128 experts
    (37, 8, 128, 16),  # several count chunks (64 pairs each) reserve places in a run
    (37, 2, 8, 64),  # runs shorter than a block
    (300, 4, 8, 16),  # runs of many blocks; more blocks than one program fills
])
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_align_places_every_pair_once_in_blocks_of_one_expert(tokens, top_k, num_experts,
                                                              block_m, ids_dtype):
    gen = torch.Generator().manual_seed(tokens)
    picked = torch.randperm(num_experts, generator=gen)[: max(top_k, num_experts - 3)]
    topk_ids = torch.stack([picked[torch.randperm(len(picked), generator=gen)[:top_k]]
                            for _ in range(tokens)]).to(ids_dtype)
    align = tm.moe_align_block_size(topk_ids.to(DEVICE), num_experts, block_m)
    num_pairs = tokens * top_k
    ids = align.sorted_token_ids.cpu()
    blocks = align.expert_ids.cpu()
    padded_len = int(align.num_tokens_post_padded.item())
    flat = topk_ids.flatten()
    counts = torch.bincount(flat, minlength=num_experts)

    # The static bound, and the real padded length: each expert's count rounded up.
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    assert align.max_blocks == -(-bound // block_m) and ids.shape == (align.max_blocks * block_m,)
    assert padded_len == int(((counts + block_m - 1) // block_m * block_m).sum())
    # Every (token, slot) pair exactly once; the rest padding (P), past the end too.
    valid = ids[ids != num_pairs]
    assert sorted(valid.tolist()) == list(range(num_pairs))
    assert (ids[padded_len:] == num_pairs).all()
    # Each block holds one expert's pairs (and padding); blocks past the end are E.
    used = padded_len // block_m
    for b in range(used):
        rows = ids[b * block_m:(b + 1) * block_m]
        rows = rows[rows != num_pairs]
        assert len(rows) > 0, f"block {b} is all padding"
        assert (flat[rows.long()] == blocks[b]).all(), (b, flat[rows.long()], blocks[b])
    assert (blocks[used:] == num_experts).all()
    # Experts in order, each as many blocks as its count needs; none for unpicked ones.
    assert (blocks[:used].diff() >= 0).all()
    per_expert = torch.bincount(blocks[:used].long(), minlength=num_experts)
    assert per_expert.tolist() == ((counts + block_m - 1) // block_m).tolist()


class _Recorder:
    """A kernel stand-in: records the grid of each `kernel[grid](...)` launch."""

    def __init__(self) -> None:
        self.grids: list[tuple[int, ...]] = []

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        self.grids.append(grid)
        return lambda *args, **kwargs: None


def test_launch_reads_nothing_back_to_the_host(monkeypatch):
    """The whole call runs on meta tensors, which have no values: any read on the host
    (a count, the padded length) would raise. So its launches depend on shapes alone,
    as a CUDA graph needs; the GEMM grids take the static bound on the padded blocks."""
    names = ("_moe_align_count_kernel", "_moe_align_place_kernel", "_moe_gate_up_kernel",
             "_moe_down_kernel")
    recorders = {name: _Recorder() for name in names}
    for name, recorder in recorders.items():
        monkeypatch.setattr(tm, name, recorder)
    tokens, top_k, experts, hidden, inter = 256, 8, 128, 2048, 768
    meta = torch.device("meta")
    x = torch.empty(tokens, hidden, dtype=torch.bfloat16, device=meta)
    out = tm.fused_moe(
        x, torch.empty(experts, 2 * inter, hidden, dtype=torch.bfloat16, device=meta),
        torch.empty(experts, hidden, inter, dtype=torch.bfloat16, device=meta),
        torch.empty(tokens, top_k, device=meta),
        torch.empty(tokens, top_k, dtype=torch.int32, device=meta))
    assert out.shape == x.shape and out.dtype == x.dtype
    tiles = tm.moe_tiles(tokens, top_k, experts, torch.bfloat16)
    max_blocks = -(-(tokens * top_k + experts * (tiles.block_m - 1)) // tiles.block_m)
    assert recorders["_moe_gate_up_kernel"].grids == [(max_blocks, -(-inter // tiles.block_n))]
    assert recorders["_moe_down_kernel"].grids == [(max_blocks,
                                                     -(-hidden // (2 * tiles.block_n)))]
    assert all(len(r.grids) == 1 for r in recorders.values())


def _inputs(**changes: Any) -> dict[str, torch.Tensor]:
    tokens, top_k, experts = 3, 2, 4
    inputs = dict(x=torch.zeros(tokens, 8), w13=torch.zeros(experts, 12, 8),
                  w2=torch.zeros(experts, 8, 6), topk_weights=torch.zeros(tokens, top_k),
                  topk_ids=torch.zeros(tokens, top_k, dtype=torch.int32))
    inputs.update(changes)
    return inputs


@pytest.mark.parametrize(("changes", "message"), [
    (dict(x=torch.zeros(3, 8, dtype=torch.float64)), "x must be fp32, fp16 or bf16"),
    (dict(x=torch.zeros(8, 3).t()), "x must be a contiguous"),
    (dict(w13=torch.zeros(4, 12, 8, dtype=torch.bfloat16)), "w13 is torch.bfloat16"),
    (dict(w13=torch.zeros(4, 11, 8)), "w13 must be"),
    (dict(w13=torch.zeros(4, 12, 7)), "w13 must be"),
    (dict(w2=torch.zeros(4, 6, 8)), "w2 must be"),
    (dict(w2=torch.zeros(4, 6, 8).transpose(1, 2)), "w2 must be a contiguous"),
    (dict(topk_ids=torch.zeros(3, 2)), "topk_ids must be int32 or int64"),
    (dict(topk_ids=torch.zeros(2, 2, dtype=torch.int32)), "topk_ids must be a contiguous"),
    (dict(topk_ids=torch.zeros(3, 5, dtype=torch.int32),
          topk_weights=torch.zeros(3, 5)), "top-k 5 must be in"),
    (dict(topk_weights=torch.zeros(3, 2, dtype=torch.bfloat16)), "must be float32"),
    (dict(topk_weights=torch.zeros(3, 1)), "topk_weights must be contiguous and shaped"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_launcher_names_what_breaks_the_contract(changes, message):
    with pytest.raises(ValueError, match=message):
        tm.fused_moe(**_inputs(**changes))


def test_packed_weights_that_break_the_contract_are_named():
    """A packed stacked weight's scales in another dtype than x's, or act-order codes
    (the kernel reads the input columns in order), or its rows not E * N."""
    from pagellm.kernels.quant import quantize

    inputs = _inputs(w13=torch.zeros(4, 12, 64), w2=torch.zeros(4, 8, 6), x=torch.zeros(3, 64))
    w13 = quantize(torch.randn(4 * 12, 64), 4, 32)
    with pytest.raises(ValueError, match=r"w13.s scales must be contiguous torch\.float32"):
        tm.fused_moe(**{**inputs, "w13": quantize(torch.randn(48, 64), 4, 32, torch.bfloat16)})
    with pytest.raises(ValueError, match="without act-order"):
        tm.fused_moe(**{**inputs, "w13": tm.PackedWeight(
            w13.qweight, w13.scales, w13.zeros, 4, 32, torch.arange(64))})
    with pytest.raises(ValueError, match="w13 must be"):
        tm.fused_moe(**{**inputs, "w13": quantize(torch.randn(4 * 12, 32), 4, 32)})


def test_no_tokens_launch_nothing(monkeypatch):
    for name in ("_moe_align_count_kernel", "_moe_align_place_kernel",
                 "_moe_gate_up_kernel", "_moe_down_kernel"):
        monkeypatch.setattr(tm, name, None)  # a launch would fail
    out = tm.fused_moe(**_inputs(x=torch.zeros(0, 8), topk_weights=torch.zeros(0, 2),
                                 topk_ids=torch.zeros(0, 2, dtype=torch.int32)))
    assert out.shape == (0, 8)
