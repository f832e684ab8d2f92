"""Weight-only integer quantization: the packed layout the GPU's fused-dequantize GEMM
reads (kernels/triton_quant.py), round-to-nearest group-wise quantization into it, and
its exact dequantization (the kernels' reference).

A weight W [N, K] (nn.Linear's: out x in) of BITS = 4 or 8 bits is kept as

    qweight [K / (32 / BITS), N] int32: 32 / BITS codes along K in each int32, code k
            at bits BITS * (k % (32 / BITS)), unsigned (0 .. 2^BITS - 1)
    scales  [K / G, N] the activations' dtype: one per group of G input columns
    zeros   [K / G, N] the same dtype: each group's zero point, in codes

    W[n, k] = (code[k, n] - zeros[k // G, n]) * scales[k // G, n]

This is GPTQ's qweight layout (K-major, so a GEMM tile of K rows is K / 8 contiguous
int32 rows), with the zero points unpacked: GPTQ, AWQ and compressed-tensors checkpoints
all map onto it at load (executor/model/quantized_checkpoint.py: their packings differ,
their arithmetic does not), and zeros as floats cost as much as the scales while making
symmetric (zeros = 2^(BITS-1)) and asymmetric schemes one code path.

GPTQ's act-order (desc_act) checkpoints quantize the input columns in another order and
keep each column's group in `g_idx`. At load their rows k are sorted by group, and
`perm` [K] remembers the order: row j of the packed weight is input column perm[j], so
y = x[:, perm] @ dequantize_sorted^T (one gather of x per call, as vLLM's exllama path).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import torch

GROUP_SIZES = (32, 64, 128, 256)


@dataclass(frozen=True)
class PackedWeight:
    """One weight in the layout above (module docstring)."""

    qweight: torch.Tensor  # [K / (32 / bits), N] int32
    scales: torch.Tensor  # [K / group_size, N]
    zeros: torch.Tensor  # [K / group_size, N]
    bits: int
    group_size: int
    perm: torch.Tensor | None = None  # [K] int64: act-order's input columns, sorted rows

    @property
    def shape(self) -> tuple[int, int]:
        """The [N, K] shape of the weight this stands for (a checkpoint tensor's, for
        weight_map's Destination)."""
        return self.out_features, self.in_features

    def narrow(self, dim: int, start: int, length: int) -> PackedWeight:
        """Rows (dim 0: output features, a column-parallel slice) or input columns
        (dim 1: a row-parallel slice, whole groups only) of the weight, as a view."""
        if start == 0 and length == self.shape[dim]:
            return self
        if dim == 0:
            cols = slice(start, start + length)
            return PackedWeight(self.qweight[:, cols], self.scales[:, cols],
                                self.zeros[:, cols], self.bits, self.group_size, self.perm)
        if self.perm is not None:
            raise ValueError("act-order (desc_act) weights cannot be split along their input "
                             "columns (tensor parallelism of a row-parallel projection)")
        per_int, g, end = 32 // self.bits, self.group_size, start + length
        if start % g == 0 and length % g == 0:
            groups = slice(start // g, end // g)
        elif start // g == (end - 1) // g and start % per_int == 0 and length % per_int == 0:
            groups, g = slice(start // g, start // g + 1), length  # inside one group
        else:
            raise ValueError(f"input columns {start}..{end} do not split into whole groups "
                             f"of {g}")
        return PackedWeight(self.qweight[start // per_int:end // per_int], self.scales[groups],
                            self.zeros[groups], self.bits, g)

    @property
    def in_features(self) -> int:
        return self.qweight.shape[0] * (32 // self.bits)

    @property
    def out_features(self) -> int:
        return self.qweight.shape[1]


_Scaled = TypeVar("_Scaled", bound="RowScaledWeight")


@dataclass(frozen=True)
class RowScaledWeight:
    """A weight of 8-bit codes with one fp32 scale per output channel (row): the layout
    of FP8's W8A8 GEMM (kernels/fp8.py: `Fp8Weight`)."""

    weight: torch.Tensor  # [N, K] e4m3 or int8
    scale: torch.Tensor  # [1, N] fp32: one per output channel

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        """[N, K]: the shape of the weight this stands for."""
        return self.weight.shape[0], self.weight.shape[1]

    @classmethod
    def from_rows(cls: type[_Scaled], q: torch.Tensor, scale: torch.Tensor) -> _Scaled:
        """A weight quantized row by row: codes [N, K], scales [N, 1] -> scale [1, N]."""
        return cls(q, scale.t().contiguous())

    def narrow(self, dim: int, start: int, length: int) -> RowScaledWeight:
        """Rows (dim 0, with their scales) or input columns (dim 1) of the weight."""
        if dim == 0:
            return type(self)(self.weight[start:start + length],
                              self.scale[:, start:start + length])
        return type(self)(self.weight[:, start:start + length], self.scale)


def row_scales(t: torch.Tensor, largest: float) -> torch.Tensor:
    """t [R, K] -> fp32 [R, 1]: each row's largest magnitude over `largest`, the code
    range's (an all-zero row gets a tiny positive scale: its codes are zeros)."""
    return (t.abs().amax(dim=1, keepdim=True).float() / largest).clamp(min=1e-12)


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What row-scaled codes [R, K] with scales [R, 1] stand for, in fp32 (the
    reference of kernels/fp8.py's quantize_rows)."""
    return q.float() * scale


def check_shape(out_features: int, in_features: int, bits: int, group_size: int) -> None:
    """Raise ValueError naming why a weight of this shape cannot take this scheme."""
    if bits not in (4, 8):
        raise ValueError(f"weight-only quantization takes 4 or 8 bits, not {bits}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, not {group_size}")
    if in_features % group_size:
        raise ValueError(f"in_features {in_features} is not a multiple of group_size "
                         f"{group_size}")
    if out_features < 1:
        raise ValueError(f"out_features must be positive, not {out_features}")


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [K, N] integers in [0, 2^bits) -> qweight [K / (32 / bits), N] int32."""
    per_int = 32 // bits
    k, n = codes.shape
    grouped = codes.to(torch.int64).reshape(k // per_int, per_int, n)
    shifts = (torch.arange(per_int, device=codes.device) * bits).view(1, per_int, 1)
    packed = (grouped << shifts).sum(dim=1)  # disjoint bits: the sum is an or
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """qweight [K / (32 / bits), N] int32 -> codes [K, N] int64 in [0, 2^bits)."""
    per_int = 32 // bits
    rows, n = qweight.shape
    shifts = (torch.arange(per_int, device=qweight.device) * bits).view(1, per_int, 1)
    codes = (qweight.to(torch.int64).unsqueeze(1) >> shifts) & (2**bits - 1)
    return codes.reshape(rows * per_int, n)


def quantize_codes(weight: torch.Tensor, bits: int, group_size: int,
                   dtype: torch.dtype | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest, asymmetric, group-wise: each group of `group_size` input
    columns of each output row maps its [min, max] (widened to include 0) onto the
    2^bits codes. weight [N, K] -> (codes [N, K] uint8, scales [N, K / G] and zeros
    [N, K / G] in `dtype`, default weight's). Computed in fp32; every element lands
    within half a step (scale / 2) of its value, plus the rounding of scales and zeros
    to `dtype`. `quantize` packs them in GPTQ's layout, cpu_int_gemm.quantize in the CPU
    kernel's."""
    out_features, in_features = weight.shape
    check_shape(out_features, in_features, bits, group_size)
    dtype = dtype or weight.dtype
    levels = 2**bits - 1
    groups = weight.float().reshape(out_features, in_features // group_size, group_size)
    low = groups.amin(dim=-1).clamp(max=0.0)  # [N, K / G]
    high = groups.amax(dim=-1).clamp(min=0.0)
    scales = ((high - low) / levels).clamp(min=torch.finfo(torch.float32).tiny)
    scales = scales.to(dtype).float()  # the scale the kernel will use
    zeros = (-low / scales).round().clamp(0, levels).to(dtype).float()
    codes = (groups / scales.unsqueeze(-1) + zeros.unsqueeze(-1)).round().clamp(0, levels)
    return (codes.to(torch.uint8).reshape(out_features, in_features), scales.to(dtype),
            zeros.to(dtype))


def quantize(weight: torch.Tensor, bits: int, group_size: int,
             dtype: torch.dtype | None = None) -> PackedWeight:
    """`quantize_codes` in GPTQ's layout: weight [N, K] -> PackedWeight with scales and
    zeros in `dtype` (default: weight's)."""
    codes, scales, zeros = quantize_codes(weight, bits, group_size, dtype)
    return PackedWeight(pack(codes.t(), bits), scales.t().contiguous(),
                        zeros.t().contiguous(), bits, group_size)


def dequantize(packed: PackedWeight) -> torch.Tensor:
    """The exact weight the packed form stands for: [N, K] in fp32 (in the input
    columns' own order where `perm` sorted them)."""
    codes = unpack(packed.qweight, packed.bits).float()  # [K, N]
    group = torch.arange(codes.shape[0], device=codes.device) // packed.group_size
    weight = (codes - packed.zeros.float()[group]) * packed.scales.float()[group]
    if packed.perm is None:
        return weight.t()
    unsorted = torch.empty_like(weight)
    unsorted[packed.perm] = weight
    return unsorted.t()
