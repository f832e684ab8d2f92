"""Weight-only int4 / int8 GEMM for the CPU: a small C++ kernel (csrc/cpu_int_gemm.cpp)
that streams the packed codes and multiplies them with AVX-512 VNNI's int8 dot products,
as llama.cpp runs its Q4_0 / Q8_0 files:

    y[m, n] = sum_b s[g, n] xs[m, b] (sum_{k in b} code[n, k] a[m, k] - z[g, n] sum_k a[m, k])

over blocks b of 32 input columns, g the weight group holding b. W[n, k] = s[g, n]
(code[n, k] - z[g, n]) is kernels/quant.py's group-wise weight (any group size that is a
multiple of 32; zero points as floats, so symmetric and asymmetric schemes are one path),
and x[m, k] ~ xs[m, b] a[m, k] its activations quantized per token and block of 32 to
int8 at each call (llama.cpp's Q8_0 activations; per weight group of 128 they cost int8
twice the perplexity). Every sum inside a block is exact in int32, so the result differs
from dequantize-then-matmul only by the activations' rounding (at most half a step of
xs per element).

Why a kernel of our own: torch's CPU ops for packed int4 / int8 weights
(`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`) ran 5-50x slower than fp32's GEMM
on this project's machines, and torchao's CPU kernels are not in its registry wheels
(benchmarks/cpu_quant_kernels.py; BENCHMARKS.md). The C++ source is compiled once per
machine on first use with pagellm's other CPU ops (kernels/cpu_ops.py) and runs on
torch's thread pool (at::parallel_for).

Layout: tiles of 16 output rows (`pack`), so that one 512-bit register holds 4 input
columns of 16 rows; see the C++ file's header for the byte order.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

from pagellm.kernels import cpu_ops
from pagellm.kernels.quant import PackedWeight, quantize_codes, unpack

TILE = 16  # output rows per tile (the kernel's 16 int32 lanes)
BLOCK = 32  # input columns per activation scale


@dataclass(frozen=True)
class CpuIntWeight:
    """A weight [N, K] in the kernel's tiled layout (module docstring)."""

    codes: torch.Tensor  # [ceil(N / 16), K / 4, 8 * bits] uint8
    scales: torch.Tensor  # [ceil(N / 16), K / G, 16] fp32
    zeros: torch.Tensor  # [ceil(N / 16), K / G, 16] fp32, in codes
    bits: int
    group_size: int
    out_features: int

    @property
    def in_features(self) -> int:
        return self.codes.shape[1] * 4

    @property
    def shape(self) -> tuple[int, int]:
        """[N, K]: the shape of the weight this stands for."""
        return self.out_features, self.in_features


def _tiles(t: torch.Tensor) -> torch.Tensor:
    """t [N, C] -> [ceil(N / 16), 16, C], the last tile padded with zeros."""
    n, c = t.shape
    pad = -n % TILE
    if pad:
        t = torch.cat((t, t.new_zeros(pad, c)))
    return t.reshape(-1, TILE, c)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [N, K] in [0, 2^bits) -> the kernel's codes [ceil(N / 16), K / 4, 8 * bits]
    uint8: per tile and quad of input columns, byte c = 4 * row + kk holds code
    (row, 4 * quad + kk); for 4 bits, the 64 bytes of quads 2p and 2p + 1 hold quad 2p's
    byte c in their low nibbles and quad 2p + 1's in their high ones (one load and mask
    and one shift and mask give the kernel both quads)."""
    tiles = _tiles(codes.to(torch.uint8))  # [T, 16, K]
    t, _, k = tiles.shape
    quads = tiles.reshape(t, TILE, k // 4, 4).transpose(1, 2).reshape(t, k // 4, 4 * TILE)
    if bits == 8:
        return quads.contiguous()
    pairs = quads.reshape(t, k // 8, 2, 4 * TILE)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(t, k // 4, 2 * TILE).contiguous()


def unpack_codes(packed: torch.Tensor, bits: int, out_features: int) -> torch.Tensor:
    """pack_codes' inverse: [T, K / 4, 8 * bits] uint8 -> codes [N, K] uint8."""
    t, quads = packed.shape[:2]
    if bits == 4:
        pairs = packed.reshape(t, quads // 2, 4 * TILE)
        packed = torch.stack((pairs & 0x0F, pairs >> 4), dim=2).reshape(t, quads, 4 * TILE)
    rows = packed.reshape(t, quads, TILE, 4).transpose(1, 2).reshape(t * TILE, quads * 4)
    return rows[:out_features]


def _tiled_groups(t: torch.Tensor) -> torch.Tensor:
    """[K / G, N] per-group values -> [ceil(N / 16), K / G, 16] fp32."""
    return _tiles(t.t().float()).transpose(1, 2).contiguous()


def pack(weight: PackedWeight) -> CpuIntWeight:
    """kernels/quant.py's layout (GPTQ's, as quantize() and the checkpoint loaders make
    it) -> the CPU kernel's. Act-order weights (perm) are refused: the kernel reads the
    input columns in their own order."""
    if weight.perm is not None:
        raise ValueError("act-order (desc_act) weights do not run on the CPU's int kernel")
    if weight.group_size % BLOCK:
        raise ValueError(f"the CPU's int kernel takes group sizes that are multiples of "
                         f"{BLOCK}, not {weight.group_size}")
    codes = unpack(weight.qweight, weight.bits).t()  # [N, K]
    return CpuIntWeight(pack_codes(codes, weight.bits), _tiled_groups(weight.scales),
                        _tiled_groups(weight.zeros), weight.bits, weight.group_size,
                        weight.out_features)


def quantize(weight: torch.Tensor, bits: int, group_size: int) -> CpuIntWeight:
    """Quantize on load (kernels/quant.py's `quantize_codes`, fp32 scales and zeros)
    straight into the kernel's layout: `pack(quant.quantize(...))`'s values, without
    GPTQ's int32 words in between (they took half of quantize-on-load's time)."""
    if group_size % BLOCK:
        raise ValueError(f"the CPU's int kernel takes group sizes that are multiples of "
                         f"{BLOCK}, not {group_size}")
    codes, scales, zeros = quantize_codes(weight, bits, group_size, torch.float32)
    return CpuIntWeight(pack_codes(codes, bits), _tiled_groups(scales.t()),
                        _tiled_groups(zeros.t()), bits, group_size, weight.shape[0])


def concatenated(weights: list[CpuIntWeight]) -> CpuIntWeight:
    """Weights of one bits, group size and K, each of whole tiles (rows a multiple of
    16), as one whose rows are theirs in turn (stacked MoE experts)."""
    first = weights[0]
    assert all(w.out_features % TILE == 0 and w.shape[1] == first.shape[1]
               and (w.bits, w.group_size) == (first.bits, first.group_size) for w in weights)
    return CpuIntWeight(torch.cat([w.codes for w in weights]),
                        torch.cat([w.scales for w in weights]),
                        torch.cat([w.zeros for w in weights]),
                        first.bits, first.group_size, sum(w.out_features for w in weights))


def dequantize(weight: CpuIntWeight) -> torch.Tensor:
    """The exact weight [N, K] fp32 the packed form stands for."""
    n, k = weight.shape
    codes = unpack_codes(weight.codes, weight.bits, n).float()
    per_group = (weight.scales, weight.zeros)
    scales, zeros = (t.transpose(1, 2).reshape(-1, k // weight.group_size)[:n]
                     .repeat_interleave(weight.group_size, dim=1) for t in per_group)
    return (codes - zeros) * scales


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """What the kernel multiplies for x [M, K]: each token's blocks of 32 columns rounded
    to int8 steps of xs = max |x| / 127 (1 for an all-zero block), in fp32 as the kernel
    computes them (round half to even of x * (1 / xs)). The reference for the kernel's
    activations."""
    m, k = x.shape
    groups = x.float().reshape(m, k // BLOCK, BLOCK)
    amax = groups.abs().amax(dim=-1, keepdim=True)
    xs = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    codes = torch.round(groups * (1 / xs)).clamp(-127, 127)
    return (codes * xs).reshape(m, k)


def reference_linear(x: torch.Tensor, weight: CpuIntWeight) -> torch.Tensor:
    """The kernel's result computed with torch in fp64: x [M, K] -> [M, N] fp64."""
    xq = quantize_activations(x).double()
    return xq @ dequantize(weight).double().t()


def write_rows(weight: CpuIntWeight, first: int, part: PackedWeight) -> None:
    """Overwrite output rows first.. with `part` (kernels/quant.py's layout, the same bits
    and group size): repacks the tiles those rows touch (weight updates, and the parts of
    a fused projection loaded one by one)."""
    if part.bits != weight.bits or part.group_size != weight.group_size:
        raise ValueError(f"{part.bits}-bit rows in groups of {part.group_size} into a "
                         f"{weight.bits}-bit weight in groups of {weight.group_size}")
    if part.perm is not None:
        raise ValueError("act-order (desc_act) weights do not run on the CPU's int kernel")
    bits, last = weight.bits, first + part.out_features
    lo, hi = first // TILE, -(-last // TILE)  # the tiles touched
    span = slice(first - lo * TILE, last - lo * TILE)  # the rows, inside those tiles
    codes = unpack_codes(weight.codes[lo:hi], bits, (hi - lo) * TILE)
    codes[span] = unpack(part.qweight, bits).t()
    weight.codes[lo:hi] = pack_codes(codes, bits)
    for mine, theirs in ((weight.scales, part.scales), (weight.zeros, part.zeros)):
        rows = mine[lo:hi].transpose(1, 2).reshape(-1, mine.shape[1]).clone()  # [span, K/G]
        rows[span] = theirs.t()
        mine[lo:hi] = rows.reshape(hi - lo, TILE, -1).transpose(1, 2)


@cache
def fast_on_this_cpu() -> bool:
    """Whether the kernel was compiled with AVX-512 VNNI (otherwise it runs as plain
    loops: exact, but slower than fp32's GEMM)."""
    return bool(cpu_ops.load().vnni())


def fuses_silu_and_mul(weight: CpuIntWeight) -> bool:
    """Whether `int_linear_silu_and_mul` takes this [gate | up] weight: its halves must
    start on a tile (intermediate sizes that are multiples of 16: every model's)."""
    return weight.out_features % (2 * TILE) == 0


def int_linear_silu_and_mul(x: torch.Tensor, weight: CpuIntWeight) -> torch.Tensor:
    """F.silu(gate) * up of x [M, K] fp32 @ [gate | up]^T in one pass (csrc: a register
    block pairs gate tile p with up tile p) -> [M, N / 2] fp32; bit for bit `int_linear`
    then cpu_fused.silu_and_mul."""
    return cpu_ops.load().int_gemm_silu_and_mul(
        x.contiguous(), weight.codes, weight.scales, weight.zeros, weight.bits,
        weight.group_size, weight.out_features)


def int_linear(x: torch.Tensor, weight: CpuIntWeight, bias: torch.Tensor | None = None
               ) -> torch.Tensor:
    """x [M, K] (any float dtype) -> [M, N] in x's dtype (+ bias)."""
    y = cpu_ops.load().int_gemm(x.float().contiguous(), weight.codes, weight.scales, weight.zeros,
                        weight.bits, weight.group_size, weight.out_features)
    y = y.to(x.dtype)
    return y if bias is None else y + bias

