"""Quantize on load: `quantization="int4"` / `"int8"` keeps the decoder's projections
(qkv_proj, o_proj, gate_up_proj, down_proj; DeepSeek's latent attention's) as
weight-only integers with group-wise scales (kernels/quant.py), computed by the
fused-dequantize Triton GEMM (kernels/triton_quant.py): a decode step then reads 4 or 8
bits per weight instead of 16 or 32. `quantization="fp8"` keeps them in e4m3 with a
scale per output channel and quantizes activations per token at each call
(kernels/fp8.py: W8A8, vLLM's dynamic fp8). Without the Triton kernels (the CPU's own
path) `"int4"` and `"int8"` run the CPU's int kernel (kernels/cpu_int_gemm.py: the same
group-wise codes in its tiled layout, activations quantized per token and block of 32,
VNNI's int8 dot products).

Each rank quantizes its own slice (so tensor parallelism shards nothing of its own: a
row-parallel slice is quantized along its own K), while the checkpoint loads
(executor/model/loader.py: the packed forms laid out empty on the meta model, each
checkpoint tensor quantized into its rows as it arrives, so the full-precision model
never exists; dummy weights are quantized after they are drawn). Integer groups are
128 input columns, else 64 or 32 (`group_size_for`). The embedding, the LM head, norms
and MoE routers stay in the model's dtype, as vLLM's weight-only schemes leave them
(the CPU computes the LM head from an int8 copy: linear.INT_WEIGHTS, registered by the
model runner). MoE experts are packed too (moe.quantize_experts: in a MoE model they
are nearly all the bytes), but for fp8 (no fp8 fused MoE kernel). A quantized weight
becomes a meta placeholder of its old shape (its memory freed; shapes still readable),
and loading and weight updates land through `RequantizingDestination`: the rows of a
projection, or of an expert (a checkpoint tensor's part on this rank), are quantized
and written over those rows' codes and scales. Every scheme here scales each output
row on its own (per channel, or per group along that row's input columns), so
quantizing a part of the rows gives exactly what quantizing the whole weight would.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pagellm.executor.model import host_memory
from pagellm.executor.model.weight_map import Destination
from pagellm.kernels import cpu_int_gemm, fp8
from pagellm.kernels.cpu_int_gemm import CpuIntWeight
from pagellm.kernels.quant import PackedWeight, RowScaledWeight, quantize

# A projection's packed form: weight-only integers (Triton's layout, or the CPU kernel's),
# or FP8.
Quantized = PackedWeight | CpuIntWeight | RowScaledWeight
# quantize-on-load names -> bits of a weight-only integer scheme, or 8 for fp8
QUANTIZATIONS = {"int4": 4, "int8": 8, "fp8": 8}
PROJECTIONS = frozenset({"qkv_proj", "o_proj", "gate_up_proj", "down_proj",
                         # DeepSeek's latent attention (its kv_b_proj, applied per head in
                         # the absorbed form, stays in the model's dtype: deepseek.py)
                         "q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa"})


def group_size_for(in_features: int, shards: int = 1) -> int:
    """The group size of a projection whose whole weight has `in_features * shards`
    input columns, of which this rank holds `in_features` (shards > 1: a row-parallel
    slice): 128, else the largest of 64 and 32 dividing the whole K, so that every
    tensor-parallel size groups alike; where this rank's slice cannot hold such groups,
    the largest that it can (the grouping, and so the results, then differ from one
    rank's)."""
    for k in (in_features * shards, in_features):
        for size in (128, 64, 32):
            if k % size == 0 and in_features % size == 0:
                return size
    raise ValueError(f"a projection with {in_features} input columns (a multiple of none of "
                     "128, 64, 32) cannot be quantized group-wise")


def quantize_projections(model: nn.Module, quantization: str, triton: bool = True,
                         on_meta: bool = False) -> dict[int, nn.Module]:
    """Replace every projection's weight by its packed form (`module.quant`); returns the
    modules quantized, by their placeholder weight's id (the model's `quantized`).
    Without the Triton kernels (`triton` False: the CPU's own path) the integers take
    the CPU kernel's layout (kernels/cpu_int_gemm.py). The experts are
    moe.quantize_experts'. `on_meta`: the model is still on the meta device, before
    loading: the packed forms are made empty there (`empty_quantized`), the loader
    allocates them and each checkpoint tensor is quantized into its rows as it loads
    (`RequantizingDestination`), so the full-precision model never exists. Raises
    ValueError naming a projection that cannot be."""
    bits = QUANTIZATIONS[quantization]
    quantized: dict[int, nn.Module] = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] not in PROJECTIONS:
            continue
        assert hasattr(module, "quant"), f"{name} is not a layers.Linear / RowParallelLinear"
        weight = module.weight
        shards = module.tp.size if hasattr(module, "tp") else 1  # row-parallel: K sliced
        if on_meta:
            module.quant = empty_quantized(weight, quantization, triton, shards)
        elif quantization == "fp8":
            module.quant = fp8.quantize_weight(weight.detach())
        elif triton:
            module.quant = quantize(weight.detach(), bits,
                                    group_size_for(weight.shape[1], shards))
        else:
            module.quant = in_huge_pages(cpu_int_gemm.quantize(
                weight.detach(), bits, group_size_for(weight.shape[1], shards)))
        module.weight = placeholder(weight)
        quantized[id(module.weight)] = module
    return quantized


def empty_quantized(weight: torch.Tensor, quantization: str, triton: bool, shards: int = 1
                    ) -> Quantized:
    """The packed form quantizing `weight` [N, K] (a projection's; `shards`: the
    tensor-parallel slices of its K) would give, empty, on the meta device."""
    n, k = weight.shape
    if quantization == "fp8":
        return empty_fp8(n, k)
    bits, group = QUANTIZATIONS[quantization], group_size_for(k, shards)
    return (empty_packed(n, k, bits, group, weight.dtype) if triton
            else empty_cpu_int(n, k, bits, group))


def empty_fp8(n: int, k: int) -> fp8.Fp8Weight:
    """An Fp8Weight [n, k] (e4m3, a scale per output channel) on the meta device."""
    with torch.device("meta"):
        return fp8.Fp8Weight(torch.empty(n, k, dtype=fp8.FP8),
                             torch.empty(1, n, dtype=torch.float32))


def empty_packed(n: int, k: int, bits: int, group: int, dtype: torch.dtype,
                 act_order: bool = False) -> PackedWeight:
    """A PackedWeight [n, k] on the meta device, scales and zeros in `dtype` (and an
    act-order permutation, `act_order`)."""
    with torch.device("meta"):
        return PackedWeight(torch.empty(k * bits // 32, n, dtype=torch.int32),
                            torch.empty(k // group, n, dtype=dtype),
                            torch.empty(k // group, n, dtype=dtype), bits, group,
                            torch.empty(k, dtype=torch.int64) if act_order else None)


def empty_cpu_int(n: int, k: int, bits: int, group: int) -> CpuIntWeight:
    """A CpuIntWeight [n, k] on the meta device."""
    tiles = -(-n // cpu_int_gemm.TILE)
    with torch.device("meta"):
        return CpuIntWeight(
            torch.empty(tiles, k // 4, cpu_int_gemm.TILE * bits // 2, dtype=torch.uint8),
            torch.empty(tiles, k // group, cpu_int_gemm.TILE),
            torch.empty(tiles, k // group, cpu_int_gemm.TILE), bits, group, n)


def placeholder(weight: torch.Tensor) -> nn.Parameter:
    """A meta parameter of `weight`'s shape and dtype: the packed form's stand-in."""
    return nn.Parameter(torch.empty(weight.shape, dtype=weight.dtype, device="meta"),
                        requires_grad=False)


def in_huge_pages(weight: CpuIntWeight) -> CpuIntWeight:
    """`weight` with its tensors copied into 2 MB pages (host_memory.py: streamed at
    batch 1, they are read faster from there)."""
    return dataclasses.replace(weight, codes=host_memory.copy(weight.codes),
                               scales=host_memory.copy(weight.scales),
                               zeros=host_memory.copy(weight.zeros))


def requantize_rows(module: nn.Module, first: int, rows: torch.Tensor) -> None:
    """Quantize `rows` [n, K] (full precision) as this projection's rows first..first+n
    and write them over the old ones (module docstring)."""
    quant: Quantized = module.quant  # type: ignore[assignment]
    if isinstance(quant, PackedWeight) and quant.perm is not None:
        raise ValueError("an act-order (desc_act) checkpoint's projections take no "
                         "full-precision updates: their column order is the quantizer's")
    last = first + rows.shape[0]
    with torch.no_grad():
        if isinstance(quant, RowScaledWeight):
            new = fp8.quantize_weight(rows.to(quant.weight.device))
            quant.weight[first:last].copy_(new.weight)
            quant.scale[:, first:last].copy_(new.scale)
            return
        if isinstance(quant, CpuIntWeight):
            cpu_int_gemm.write_rows(quant, first, quantize(
                rows.to(quant.codes.device), quant.bits, quant.group_size, torch.float32))
            return
        packed = quantize(rows.to(quant.qweight.device), quant.bits, quant.group_size,
                          quant.scales.dtype)
        quant.qweight[:, first:last].copy_(packed.qweight)
        quant.scales[:, first:last].copy_(packed.scales)
        quant.zeros[:, first:last].copy_(packed.zeros)


def place(module: nn.Module, first: int, part: Quantized) -> None:
    """Write a checkpoint projection's `part` (this rank's slice of it, packed) into
    rows first.. of `module`'s packed form. Where the checkpoint's groups are wider than
    the kernel's, their scales and zero points repeat; the parts of one fused
    projection must share an act-order permutation (they share their input)."""
    quant: Quantized = module.quant  # type: ignore[assignment]
    last = first + part.shape[0]
    with torch.no_grad():
        if isinstance(quant, CpuIntWeight):
            if not isinstance(part, PackedWeight):
                raise ValueError(f"a {type(part).__name__} checkpoint weight into the CPU's "
                                 "int kernel")
            cpu_int_gemm.write_rows(quant, first, _regrouped(part, quant.group_size))
            return
        if isinstance(quant, RowScaledWeight):
            if type(part) is not type(quant):
                raise ValueError(f"a {type(part).__name__} checkpoint weight into a "
                                 f"{type(quant).__name__} projection")
            quant.weight[first:last].copy_(part.weight)
            quant.scale[:, first:last].copy_(part.scale)
            return
        if not isinstance(part, PackedWeight) or part.bits != quant.bits:
            raise ValueError(f"a checkpoint weight of another kind than {quant.bits}-bit "
                             "integers")
        regrouped = _regrouped(part, quant.group_size)
        quant.qweight[:, first:last].copy_(part.qweight)
        quant.scales[:, first:last].copy_(regrouped.scales)
        quant.zeros[:, first:last].copy_(regrouped.zeros)
        if quant.perm is None:
            assert part.perm is None  # narrow() refuses act-order K slices
            return
        perm = part.perm if part.perm is not None else torch.arange(quant.in_features)
        if bool((quant.perm < 0).all()):
            quant.perm.copy_(perm)
        elif not torch.equal(quant.perm, perm.to(quant.perm.device)):
            raise ValueError("the parts of one fused projection have different act-order "
                             "g_idx")


def _regrouped(part: PackedWeight, group_size: int) -> PackedWeight:
    """`part` with groups of `group_size` (a divisor of its own): scales and zero points
    repeat."""
    repeat, rest = divmod(part.group_size, group_size)
    assert rest == 0, (part.group_size, group_size)
    return PackedWeight(part.qweight, part.scales.repeat_interleave(repeat, 0),
                        part.zeros.repeat_interleave(repeat, 0), part.bits, group_size,
                        part.perm)


@dataclass(frozen=True)
class RequantizingDestination(Destination):
    """A Destination into a quantized weight (a projection's, or stacked experts' whose
    E * N rows are one packed weight): `tensor` is a view of its meta placeholder,
    which says which rows the checkpoint tensor's part fills (a contiguous view is
    whole rows, from its offset on); `write` quantizes a full-precision part into those
    rows (`requantize_rows`), or copies a quantized checkpoint's part, already packed,
    in (quantized_checkpoint.py)."""

    module: Any = field(default=None, compare=False)

    def write(self, part: Any, non_blocking: bool = False) -> None:
        assert self.tensor is not None
        view, width = self.tensor, self.module.quant.shape[1]
        if view.shape[-1] != width or not view.is_contiguous():
            raise ValueError(f"a quantized weight takes whole rows, not a {tuple(view.shape)} "
                             f"view with strides {view.stride()}")
        first, rows = view.storage_offset() // width, view.numel() // width
        if isinstance(part, (PackedWeight, RowScaledWeight)):
            if tuple(part.shape) != (rows, width):
                raise ValueError(f"a packed part of {tuple(part.shape)} for rows of "
                                 f"{tuple(view.shape)}")
            place(self.module, first, part)
        else:  # in the model's dtype first, as the weight quantized after loading was
            requantize_rows(self.module, first, part.reshape(rows, width).to(view.dtype))

    def receiver(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        return None  # never written straight into: the placeholder holds no memory


def requantizing(dest: Destination, module: nn.Module) -> RequantizingDestination:
    """`dest` (and its parts) as requantizing destinations into `module`."""
    parts = tuple(requantizing(p, module) for p in dest.parts)
    fields = {f: getattr(dest, f) for f in ("tensor", "shape", "dim", "start", "length",
                                            "as_shape", "layout")}
    return RequantizingDestination(**fields, parts=parts, module=module)


def quantized_silu_and_mul(x: torch.Tensor, quant: Quantized) -> torch.Tensor | None:
    """F.silu(gate) * up of a [gate | up] projection in one kernel where its weight's
    kernel fuses them (the CPU's int kernel, fp32 activations: cpu_int_gemm), else None
    (the caller projects, then applies the activation)."""
    if isinstance(quant, CpuIntWeight) and x.dtype == torch.float32 \
            and cpu_int_gemm.fuses_silu_and_mul(quant):
        return cpu_int_gemm.int_linear_silu_and_mul(x, quant)
    return None


def quantized_linear(x: torch.Tensor, quant: Quantized, bias: torch.Tensor | None
                     ) -> torch.Tensor:
    """x [T, in] -> [T, out] (+ bias): the Triton kernel for packed integers, the CPU's
    int kernel for them in its layout, the FP8 GEMM for e4m3 weights."""
    if isinstance(quant, fp8.Fp8Weight):
        return fp8.fp8_linear(x, quant, bias)
    if isinstance(quant, CpuIntWeight):
        return cpu_int_gemm.int_linear(x, quant, bias)
    assert isinstance(quant, PackedWeight), type(quant)
    from pagellm.kernels.triton_quant import quant_matmul

    if quant.perm is not None:  # act-order: the input columns in the packed rows' order
        x = x.index_select(1, quant.perm)
    y = quant_matmul(x, quant)
    return y if bias is None else y + bias
