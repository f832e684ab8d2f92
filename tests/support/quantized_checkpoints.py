"""Quantized checkpoints written the way their own tools write them, from a full-precision
test model, with the weights they stand for as the tests' reference.

Each projection's weight W [N, K] is quantized round-to-nearest into integer codes,
zero points and fp16 scales (or e4m3 and fp32 scales); the reference weight is what
those stand for, computed here from the codes: (code - zero) * scale. Then each
format's writer stores them as its tool does, from the format's own description:

- gptq: AutoGPTQ's `QuantLinear.pack`: qweight [K/pk, N] with code k*pk + j of a column
  at bits j*b of row k; qzeros [K/G, N/pk] along N, each zero minus one (format v1);
  g_idx [K]. Act-order: the input columns are quantized in a random order, group g
  taking columns order[g*G:(g+1)*G], and g_idx gives each column its group.
- awq: AutoAWQ's `WQLinear_GEMM.from_linear`: qweight [K, N/8], bits 4i of int c
  holding column 8c + ORDER[i] with ORDER = 0 2 4 6 1 3 5 7; qzeros likewise.
- compressed-tensors: the `compressed_tensors` library's own `pack_to_int32` packs the
  signed codes (code - 2^(b-1)) along K, and the zero points along N.
- fp8: e4m3 weights with a scale per block (weight_scale_inv) or per channel.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# The projections that share an input (and so an act order).
SITES = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "o",
         "gate_proj": "gate_up", "up_proj": "gate_up", "down_proj": "down"}


def _int32(values: torch.Tensor) -> torch.Tensor:
    """int64 holding 32-bit patterns -> int32 with the same bits."""
    return torch.where(values >= 2**31, values - 2**32, values).to(torch.int32)


def pack_along_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [R, C] -> [R / pk, C]: code r*pk + j at bits j*bits (GPTQ's qweight)."""
    per_int = 32 // bits
    out = torch.zeros(codes.shape[0] // per_int, codes.shape[1], dtype=torch.int64)
    for j in range(per_int):
        out |= codes[j::per_int].to(torch.int64) << (bits * j)
    return _int32(out)


def pack_awq(codes: torch.Tensor) -> torch.Tensor:
    """codes [R, C] -> [R, C / 8] in AWQ's order."""
    out = torch.zeros(codes.shape[0], codes.shape[1] // 8, dtype=torch.int64)
    for i, column in enumerate(AWQ_ORDER):
        out |= codes[:, column::8].to(torch.int64) << (4 * i)
    return _int32(out)


def quantize_int(weight: torch.Tensor, bits: int, group: int, symmetric: bool,
                 g_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                               torch.Tensor]:
    """weight [N, K], g_idx [K] -> (codes [K, N], zeros [K/G, N], scales [K/G, N] fp16,
    the reference weight [N, K] fp32). Asymmetric zero points are kept in 1..2^b - 1
    (GPTQ's v1 format cannot store zero)."""
    n, k = weight.shape
    top = 2**bits - 1
    codes = torch.empty(k, n, dtype=torch.int64)
    zeros = torch.empty(k // group, n, dtype=torch.int64)
    scales = torch.empty(k // group, n, dtype=torch.float16)
    for g in range(k // group):
        cols = (g_idx == g).nonzero().flatten()
        w = weight[:, cols].double()  # [N, G]
        if symmetric:
            scale = (w.abs().amax(1) / (2 ** (bits - 1) - 1)).clamp(min=1e-4)
            zero = torch.full((n,), 2 ** (bits - 1), dtype=torch.float64)
        else:
            low, high = w.amin(1).clamp(max=0), w.amax(1).clamp(min=0)
            scale = ((high - low) / top).clamp(min=1e-4)
            zero = (-low / scale).round().clamp(1, top)
        scale = scale.half().double()
        scales[g] = scale.half()
        zeros[g] = zero.long()
        codes[cols] = (w / scale[:, None] + zero[:, None]).round().clamp(0, top).long().t()
    group_of = g_idx.long()
    reference = (codes - zeros[group_of]).double() * scales.double()[group_of]
    return codes, zeros, scales, reference.t().float().contiguous()


def _write(model_dir: Path, out: Path, tensors: dict[str, torch.Tensor],
           quantization_config: dict[str, Any]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, out / f.name)
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out


def write_int_checkpoint(model_dir: Path, out: Path, method: str, bits: int = 4,
                         group: int | None = 32, symmetric: bool = False,
                         act_order: bool = False, packed: bool = True, seed: int = 0
                         ) -> tuple[Path, dict[str, torch.Tensor]]:
    """`model_dir`'s model with every projection quantized in `method`'s format (gptq,
    awq, compressed-tensors: `packed` pack-quantized, else int-quantized, W8A8's int8
    weights); `group` None: one scale per output channel. Returns (the new directory,
    the reference state dict: transformers' names, the projections' weights as their
    codes stand for them)."""
    state = load_file(str(model_dir / "model.safetensors"))
    generator = torch.Generator().manual_seed(seed)
    tensors, reference = {}, dict(state)
    orders: dict[str, torch.Tensor] = {}
    for name, weight in state.items():
        prefix, _, last = name.rpartition(".")
        if last != "weight" or prefix.rsplit(".", 1)[-1] not in PROJECTIONS:
            tensors[name] = weight
            continue
        k = weight.shape[1]
        size = group or k
        if act_order:  # columns quantized in a random order, one per input (GPTQ's order
            # follows the input's Hessian: q, k and v share theirs, gate and up theirs)
            site = prefix.rsplit(".", 1)[0] + SITES[prefix.rsplit(".", 1)[-1]]
            order = orders.setdefault(site, torch.randperm(k, generator=generator))
            g_idx = torch.empty(k, dtype=torch.int32)
            g_idx[order] = (torch.arange(k) // size).to(torch.int32)
        else:
            g_idx = (torch.arange(k) // size).to(torch.int32)
        codes, zeros, scales, reference[name] = quantize_int(weight, bits, size, symmetric,
                                                             g_idx)
        if method == "gptq":
            tensors[f"{prefix}.qweight"] = pack_along_rows(codes, bits)
            tensors[f"{prefix}.qzeros"] = pack_along_rows((zeros - 1).t(), bits).t()
            tensors[f"{prefix}.scales"] = scales
            tensors[f"{prefix}.g_idx"] = g_idx
        elif method == "awq":
            tensors[f"{prefix}.qweight"] = pack_awq(codes)
            tensors[f"{prefix}.qzeros"] = pack_awq(zeros)
            tensors[f"{prefix}.scales"] = scales
        elif packed:
            from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

            offset = 2 ** (bits - 1)
            tensors[f"{prefix}.weight_packed"] = pack_to_int32(
                (codes - offset).t().to(torch.int8).contiguous(), bits, packed_dim=1)
            tensors[f"{prefix}.weight_scale"] = scales.t().float()  # the model's dtype
            tensors[f"{prefix}.weight_shape"] = torch.tensor(list(weight.shape))
            if not symmetric:
                tensors[f"{prefix}.weight_zero_point"] = pack_to_int32(
                    (zeros - offset).t().to(torch.int8).contiguous(), bits, packed_dim=0)
        else:  # int-quantized: the signed int8 codes as the weight itself
            offset = 2 ** (bits - 1)
            tensors[name] = (codes - offset).t().to(torch.int8).contiguous()
            tensors[f"{prefix}.weight_scale"] = scales.t().float()
            if not symmetric:
                tensors[f"{prefix}.weight_zero_point"] = (zeros - offset).t().to(torch.int8)
        if method == "compressed-tensors" and act_order:
            tensors[f"{prefix}.weight_g_idx"] = g_idx
    config = _int_config(method, bits, group, symmetric, act_order, packed)
    return _write(model_dir, out, tensors, config), reference


def _int_config(method: str, bits: int, group: int | None, symmetric: bool, act_order: bool,
                packed: bool) -> dict[str, Any]:
    if method == "gptq":
        return {"quant_method": "gptq", "bits": bits, "group_size": group or -1,
                "sym": symmetric, "desc_act": act_order, "checkpoint_format": "gptq"}
    if method == "awq":
        return {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": None}
    weights = {"num_bits": bits, "type": "int", "strategy": "group" if group else "channel",
               "group_size": group, "symmetric": symmetric, "dynamic": False,
               "actorder": "group" if act_order else None}
    activations = None if packed else {"num_bits": 8, "type": "int", "strategy": "token",
                                       "dynamic": True, "symmetric": True}
    return {"quant_method": "compressed-tensors",
            "format": "pack-quantized" if packed else "int-quantized",
            "quantization_status": "compressed", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": activations}}}


def write_fp8_checkpoint(model_dir: Path, out: Path, block: tuple[int, int] | None,
                         per_tensor: bool = False, projections: Collection[str] = PROJECTIONS
                         ) -> tuple[Path, dict[str, torch.Tensor]]:
    """FP8 weights: block-wise (quant_method fp8, weight_block_size, weight_scale_inv,
    as DeepSeek's and Qwen's FP8 releases); with `block` None, per channel
    (compressed-tensors float-quantized, dynamic per-token activations, as
    llm-compressor's FP8_DYNAMIC) or `per_tensor` (quant_method fp8 with one weight
    scale and a static input scale, as AutoFP8 wrote). The modules `projections` names
    are quantized. Returns (the directory, the reference state dict)."""
    state = load_file(str(model_dir / "model.safetensors"))
    tensors, reference = {}, dict(state)
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    for name, weight in state.items():
        prefix, _, last = name.rpartition(".")
        if last != "weight" or prefix.rsplit(".", 1)[-1] not in projections:
            tensors[name] = weight
            continue
        n, k = weight.shape
        if block is None and per_tensor:
            scale = weight.abs().amax() / fp8_max  # []
            full = scale
            tensors[f"{prefix}.weight_scale"] = scale
            tensors[f"{prefix}.input_scale"] = torch.tensor(0.05)  # static: replaced
        elif block is None:
            scale = weight.abs().amax(1, keepdim=True) / fp8_max  # [N, 1]
            full = scale
            tensors[f"{prefix}.weight_scale"] = scale
        else:
            bn, bk = block
            blocks = weight.reshape(n // bn, bn, k // bk, bk)
            scale = blocks.abs().amax(dim=(1, 3)) / fp8_max  # [N/bn, K/bk]
            full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)
            tensors[f"{prefix}.weight_scale_inv"] = scale
        q = (weight / full).to(torch.float8_e4m3fn)
        tensors[name] = q
        reference[name] = q.float() * full
    if per_tensor:
        config = {"quant_method": "fp8", "activation_scheme": "static"}
    elif block is None:
        config = {"quant_method": "compressed-tensors", "format": "float-quantized",
                  "quantization_status": "compressed", "ignore": ["lm_head"],
                  "config_groups": {"group_0": {
                      "targets": ["Linear"],
                      "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                                  "symmetric": True, "dynamic": False},
                      "input_activations": {"num_bits": 8, "type": "float",
                                            "strategy": "token", "dynamic": True}}}}
    else:
        config = {"quant_method": "fp8", "activation_scheme": "dynamic",
                  "weight_block_size": list(block)}
    return _write(model_dir, out, tensors, config), reference


def as_cpu_int_kernel(model: Any, full_precision: Collection[str] = ()) -> Any:
    """transformers' `model` (weights already what the codes stand for) computed as the
    CPU's int kernel computes a quantized model (kernels/cpu_int_gemm.py): each
    projection's input quantized per token and block of 32 (but those named in
    `full_precision`, which the checkpoint keeps unquantized), and the LM head an int8
    copy of its weight (untied from the embedding first) with its input quantized so."""
    from pagellm.executor.model.quantize import group_size_for
    from pagellm.kernels import cpu_int_gemm
    from pagellm.kernels.quant import dequantize, quantize

    def hook(_: Any, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return tuple(cpu_int_gemm.quantize_activations(a.reshape(-1, a.shape[-1]))
                     .reshape(a.shape) for a in args)

    with torch.no_grad():
        head = model.lm_head
        weight = head.weight.detach().float()
        head.weight = torch.nn.Parameter(dequantize(quantize(
            weight, 8, group_size_for(weight.shape[1]))), requires_grad=False)
        head.register_forward_pre_hook(hook)
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in (*PROJECTIONS, "qkv_proj", "gate_up_proj",
                                           "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa") \
                    and name not in full_precision:  # (Phi-3's are fused in the model)
                module.register_forward_pre_hook(hook)
    return model


def with_packed_experts(model: Any, bits: int | None, shards: int = 1,
                        packed: tuple[str, ...] = ("gate_up_proj", "down_proj"),
                        activations: bool = True) -> Any:
    """transformers' `model` with every MoE layer's stacked experts (transformers 5's
    `*Experts` modules: gate_up_proj [E, 2I, H], down_proj [E, H, I]) as the engine
    computes packed experts (moe.ExpertCodes): quantized on load, each expert's weights
    quantized to `bits` and dequantized group-wise (down_proj's K in `shards` slices, as
    each tensor-parallel rank quantizes its own); `bits` None: the weights are already
    what a checkpoint's codes stand for. With `activations` (the CPU's int kernel; the
    Triton kernels are weight-only), the input of each of their projections quantized
    per token and block of 32 (F.linear wrapped during the module's forward:
    transformers' own per-expert loop, its "eager" experts implementation; the default
    grouped_mm calls no F.linear: for `model` a part of one, the caller sets it). Only
    the stacked weights `packed` names are taken so (a file's experts may keep gate/up
    in full precision and down as codes). gpt-oss's experts compute x @ W ([E, K, N]:
    each expert's transpose is quantized; their inputs are quantized at `@`)."""
    from unittest import mock

    from pagellm.executor.model.quantize import group_size_for
    from pagellm.kernels import cpu_int_gemm
    from pagellm.kernels.quant import dequantize, quantize

    plain = torch.nn.functional.linear

    def quantizing(stacked: list[torch.Tensor]) -> Any:
        """F.linear with its input quantized where its weight is a slice of `stacked`."""
        storages = {t.untyped_storage().data_ptr() for t in stacked}

        def linear(x: torch.Tensor, w: torch.Tensor, b: Any = None) -> torch.Tensor:
            if w.untyped_storage().data_ptr() in storages:
                x = cpu_int_gemm.quantize_activations(x.reshape(-1, x.shape[-1])).reshape(
                    x.shape)
            return plain(x, w, b)

        return linear

    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")
    def wrapped(forward: Any, linear: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            with mock.patch.object(torch.nn.functional, "linear", linear):
                return forward(*args, **kwargs)

        return run

    def matmul_quantizing(stacked: list[torch.Tensor]) -> Any:
        """Tensor.__matmul__ with its left side quantized where the right one is a
        slice of `stacked` (gpt-oss's experts)."""
        linear = quantizing(stacked)

        def matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return linear(x, w.t()) if w.dim() == 2 else torch.matmul(x, w)

        return matmul

    count = 0
    for module in model.modules():
        stacked = getattr(module, "gate_up_proj", None)
        if not isinstance(stacked, torch.nn.Parameter) or stacked.dim() != 3:
            continue
        transposed = hasattr(module, "gate_up_proj_bias")  # gpt-oss: [E, K, N], x @ W
        with torch.no_grad():
            for weight, k_shards in ((module.gate_up_proj, 1), (module.down_proj, shards)):
                if bits is None or not any(weight is getattr(module, p) for p in packed):
                    continue
                k = weight.shape[1 if transposed else 2] // k_shards
                group = group_size_for(k, k_shards)
                for expert in weight:
                    rows = expert.t() if transposed else expert  # [N, K]
                    rows.copy_(torch.cat([dequantize(quantize(part, bits, group))
                                          for part in rows.split(k, dim=1)], dim=1))

        if activations and transposed:
            matmul = matmul_quantizing([getattr(module, p) for p in packed])
            forward = module.forward

            def run(*args: Any, forward: Any = forward, matmul: Any = matmul) -> Any:
                with mock.patch.object(torch.Tensor, "__matmul__", matmul):
                    return forward(*args)

            module.forward = run
        elif activations:
            module.forward = wrapped(module.forward,
                                     quantizing([getattr(module, p) for p in packed]))
        count += 1
    assert count, "no stacked experts in the model"
    return model


E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def mxfp4_quantized(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., N, K] -> (blocks [..., N, K / 32, 16] uint8, scales [..., N, K / 32]
    uint8) as OpenAI's gpt-oss checkpoints store MXFP4, written from the OCP format's
    definition: per block of 32 along K the power of two 2^e with e = ceil(log2(amax /
    6)) (the largest magnitude then fits e2m1's 6), each value its nearest e2m1 code
    (sign in bit 3), two codes a byte, the even element in the low nibble; scale e + 127."""
    w = weight.float().reshape(*weight.shape[:-1], -1, 32)  # [..., N, G, 32]
    amax = w.abs().amax(dim=-1).clamp(min=2.0 ** -120)
    exponent = torch.ceil(torch.log2(amax / 6.0))  # [..., N, G]
    scaled = w / torch.exp2(exponent)[..., None]
    magnitudes = torch.tensor(E2M1_MAGNITUDES)
    nearest = (scaled.abs()[..., None] - magnitudes).abs().argmin(dim=-1)  # [..., 32]
    codes = (nearest + 8 * (scaled < 0)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent + 127).to(torch.uint8)


def write_mxfp4_gpt_oss(source: Path, out: Path) -> Path:
    """A copy of gpt-oss model directory `source` as OpenAI ships the model: every
    expert weight MXFP4 (`<name>_blocks`, `<name>_scales`, in the [E, N, K] orientation:
    the bf16 tensors transposed), the rest as it was, and config.json's
    quantization_config {"quant_method": "mxfp4"}."""
    shutil.copytree(source, out)
    tensors = load_file(source / "model.safetensors")
    written: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            blocks, scales = mxfp4_quantized(tensor.transpose(1, 2))
            written[f"{name}_blocks"], written[f"{name}_scales"] = blocks, scales
        else:
            written[name] = tensor
    save_file(written, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
