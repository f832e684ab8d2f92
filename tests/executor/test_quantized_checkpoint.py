"""Quantized checkpoint formats (executor/model/quantized_checkpoint.py) read as the weights
their codes stand for: against the writers in tests/support/quantized_checkpoints.py
(each format stored as its own tool stores it, the reference computed from the codes) and,
where transformers reads the format itself, against transformers' load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import MODEL_SPECS
from helpers import ROOT
from quantized_checkpoints import write_fp8_checkpoint, write_int_checkpoint
from safetensors.torch import load_file
from torch import nn

from pagellm.demo.model import make_model
from pagellm.executor.model.quantize import place, requantize_rows
from pagellm.executor.model.quantized_checkpoint import (
    Kind,
    collect,
    dequantized,
    read_quantization_config,
)
from pagellm.kernels import fp8
from pagellm.kernels.quant import PackedWeight, dequantize, quantize

INT_CASES = {
    "gptq-4bit-act-order": ("gptq", {"bits": 4, "group": 32, "act_order": True}),
    "gptq-8bit-symmetric": ("gptq", {"bits": 8, "group": 64, "symmetric": True}),
    "awq-4bit": ("awq", {"bits": 4, "group": 32}),
    "ct-4bit-symmetric": ("compressed-tensors", {"bits": 4, "group": 32, "symmetric": True}),
    "ct-8bit-act-order": ("compressed-tensors", {"bits": 8, "group": 32, "act_order": True}),
    "gptq-4bit-per-channel": ("gptq", {"bits": 4, "group": None}),
    "ct-w8a8-int8-channel": ("compressed-tensors", {"bits": 8, "group": None,
                                                    "symmetric": True, "packed": False}),
    "ct-w8a8-int8-asymmetric": ("compressed-tensors", {"bits": 8, "group": None,
                                                       "packed": False}),
}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("qc") / "llama", MODEL_SPECS["llama"])


def _read(directory: Path, packed: bool) -> dict[str, object]:
    quant = read_quantization_config(
        json.loads((directory / "config.json").read_text())["quantization_config"])
    assert quant is not None
    tensors = load_file(str(directory / "model.safetensors")).items()
    return dict(collect(tensors, quant, lambda name: packed and name.endswith("proj.weight"),
                        lambda name: True))


@pytest.mark.parametrize("case", list(INT_CASES))
def test_each_integer_format_reads_as_the_weights_its_codes_stand_for(case, llama_dir,
                                                                      tmp_path):
    method, options = INT_CASES[case]
    directory, reference = write_int_checkpoint(llama_dir, tmp_path / case, method, **options)
    for packed in (False, True):
        weights = _read(directory, packed)
        assert weights.keys() == reference.keys()
        for name, weight in weights.items():
            if packed and name.endswith("proj.weight"):
                assert isinstance(weight, PackedWeight) and weight.bits == options["bits"]
                # act-order rows sorted by group: a permutation, not the identity
                assert (weight.perm is not None) == options.get("act_order", False)
            assert torch.equal(dequantized(weight), reference[name]), (name, packed)


def test_fp8_per_tensor_reads_as_its_codes_stand_for(llama_dir, tmp_path):
    """quant_method fp8 without blocks (AutoFP8's): one weight scale per tensor, spread
    over the output channels; the static input scale loads into nothing."""
    directory, reference = write_fp8_checkpoint(llama_dir, tmp_path / "fp8", None,
                                                per_tensor=True)
    weights = _read(directory, packed=True)
    assert weights.keys() == reference.keys()
    for name, weight in weights.items():
        if name.endswith("proj.weight"):
            assert isinstance(weight, fp8.Fp8Weight) and weight.scale.unique().numel() == 1
        assert torch.equal(dequantized(weight).float(), reference[name]), name


@pytest.mark.parametrize("block", [(32, 32), (32, 64), None], ids=["block", "wide-block",
                                                                     "channel"])
def test_fp8_formats_read_as_transformers_reads_them(block, llama_dir, tmp_path):
    """transformers reads both itself (FineGrainedFP8 dequantized, compressed-tensors
    decompressed): the same weights, to the bit."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig, FineGrainedFP8Config

    directory, reference = write_fp8_checkpoint(llama_dir, tmp_path / "fp8", block)
    config = FineGrainedFP8Config(dequantize=True) if block else \
        CompressedTensorsConfig(run_compressed=False)
    theirs = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                  quantization_config=config).state_dict()
    weights = _read(directory, packed=True)
    for name, weight in weights.items():
        if name.endswith("proj.weight"):
            # per channel stays packed (the FP8 GEMM); blocks load dequantized
            assert isinstance(weight, fp8.Fp8Weight) == (block is None)
        assert torch.equal(dequantized(weight).float(), theirs[name].float()), name
        assert torch.equal(dequantized(weight).float(), reference[name]), name


@pytest.mark.parametrize("options", [{"bits": 4, "group": 32},
                                     {"bits": 8, "group": None, "packed": False}],
                         ids=["pack-quantized", "int-quantized"])
def test_compressed_tensors_reads_as_transformers_reads_it(options, llama_dir, tmp_path):
    import transformers
    from packaging.version import Version
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    if options.get("packed", True) and Version(transformers.__version__) < Version("5.3"):
        # the reference itself fails there: it stores the packed int32 zero points in
        # int8 parameters, and compressed-tensors refuses to unpack them (fixed in 5.3)
        pytest.skip("transformers < 5.3 cannot decompress packed zero points")

    directory, _ = write_int_checkpoint(llama_dir, tmp_path / "ct", "compressed-tensors",
                                        **options)
    theirs = AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32,
        quantization_config=CompressedTensorsConfig(run_compressed=False)).state_dict()
    for name, weight in _read(directory, packed=True).items():
        assert torch.equal(dequantized(weight), theirs[name]), name


def test_narrowing_a_packed_weight_is_narrowing_the_weight():
    """Tensor-parallel slices: rows (column-parallel), whole groups of input columns
    (row-parallel), and a slice inside one group (a per-channel scale split in two)."""
    weight = torch.randn(48, 256, generator=torch.Generator().manual_seed(0))
    packed = quantize(weight, 4, 64)
    full = dequantize(packed)
    for dim, start, length in ((0, 16, 16), (1, 64, 128), (1, 128, 128), (1, 96, 32)):
        part = packed.narrow(dim, start, length)
        assert part.shape == full.narrow(dim, start, length).shape
        assert torch.equal(dequantize(part), full.narrow(dim, start, length)), (dim, start)
    assert packed.narrow(1, 96, 32).group_size == 32  # inside group 1: its own scale row
    with pytest.raises(ValueError, match="whole groups of 64"):
        packed.narrow(1, 32, 64)
    act_order = PackedWeight(packed.qweight, packed.scales, packed.zeros, 4, 64,
                             torch.randperm(256))
    with pytest.raises(ValueError, match="act-order"):
        act_order.narrow(1, 0, 128)
    assert act_order.narrow(1, 0, 256) is act_order  # the whole of K is no split


def test_wider_checkpoint_groups_repeat_into_the_kernels_groups():
    """A checkpoint with groups of 128 (or one scale per channel) placed into a
    projection whose kernel groups are 32: each scale and zero point repeats, and the
    weight is the same; rows land where `first` says."""
    weight = torch.randn(16, 256, generator=torch.Generator().manual_seed(1))
    part = quantize(weight, 4, 128)
    module = nn.Module()
    module.quant = PackedWeight(torch.zeros(32, 40, dtype=torch.int32),
                                torch.zeros(8, 40), torch.zeros(8, 40), 4, 32)
    place(module, 8, part)
    placed = dequantize(module.quant)
    assert torch.equal(placed[8:24], dequantize(part))
    assert torch.equal(placed[:8], torch.zeros(8, 256))


def test_act_order_parts_of_one_projection_must_share_their_order():
    weight = torch.randn(8, 64, generator=torch.Generator().manual_seed(2))
    base = quantize(weight, 4, 32)
    module = nn.Module()
    module.quant = PackedWeight(torch.zeros(8, 16, dtype=torch.int32), torch.zeros(2, 16),
                                torch.zeros(2, 16), 4, 32, torch.full((64,), -1))
    first = PackedWeight(base.qweight, base.scales, base.zeros, 4, 32, torch.randperm(64))
    place(module, 0, first)
    assert torch.equal(module.quant.perm, first.perm)
    with pytest.raises(ValueError, match="different act-order"):
        place(module, 8, PackedWeight(base.qweight, base.scales, base.zeros, 4, 32,
                                      torch.randperm(64)))
    with pytest.raises(ValueError, match="act-order"):  # its order is the quantizer's
        requantize_rows(module, 0, weight)


def test_a_projection_missing_a_tensor_or_left_in_full_precision_is_named(llama_dir,
                                                                          tmp_path):
    directory, _ = write_int_checkpoint(llama_dir, tmp_path / "gptq", "gptq")
    quant = read_quantization_config(
        json.loads((directory / "config.json").read_text())["quantization_config"])
    assert quant is not None
    tensors = load_file(str(directory / "model.safetensors"))
    missing = {k: v for k, v in tensors.items() if not k.endswith("layers.1.mlp.up_proj.qzeros")}
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.up_proj: .* not \['qzeros'\]"):
        list(collect(missing.items(), quant, lambda n: False, lambda n: True))
    plain = dict(tensors)
    for suffix in ("qweight", "qzeros", "scales", "g_idx"):
        del plain[f"model.layers.0.mlp.down_proj.{suffix}"]
    plain["model.layers.0.mlp.down_proj.weight"] = torch.zeros(64, 128)
    with pytest.raises(ValueError, match=r"down_proj\.weight is torch\.float32, but"):
        list(collect(plain.items(), quant, lambda n: "proj" in n, lambda n: True))


@pytest.mark.parametrize(("config", "message"), [
    ({"quant_method": "bitsandbytes"}, "quant_method='bitsandbytes'"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "bits=3"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 100}, "group_size=100"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "checkpoint_format"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "version='gemv'"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}, "format="),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "g": {"weights": {"num_bits": 4, "type": "int", "strategy": "block"}}}},
     "strategy='block'"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
    ({"quant_method": "gguf", "bits": 4, "group_size": 256}, "group_size=256"),
    ({"quant_method": "gguf", "bits": 5, "group_size": 32}, "bits=5"),
    ({"quant_method": "gguf", "bits": 4, "group_size": 32, "ignore": "lm_head"}, "ignore="),
    ({"quant_method": "gguf", "bits": 4, "group_size": 32, "module_bits": {"a": 6}},
     r"module_bits\['a'\]=6"),
])
def test_unreadable_quantization_configs_are_refused_naming_the_field(config, message):
    with pytest.raises(ValueError, match=message):
        read_quantization_config(config)


def test_readable_configs_say_what_they_hold():
    gptq = read_quantization_config({"quant_method": "gptq", "bits": 4, "group_size": -1,
                                     "desc_act": True})
    assert gptq is not None and gptq.group_size is None and gptq.act_order
    assert gptq.zeros_minus_one and "g_idx" in gptq.tensors
    block = read_quantization_config({"quant_method": "fp8", "weight_block_size": [128, 128],
                                      "modules_to_not_convert": ["lm_head"]})
    assert block is not None and block.kind is Kind.FP8_BLOCK and block.ignores("lm_head")
    ct = read_quantization_config({
        "quant_method": "compressed-tensors", "format": "int-quantized",
        "ignore": ["re:.*layers\\.0\\..*", "lm_head"],
        "config_groups": {"g": {"weights": {"num_bits": 8, "type": "int",
                                            "strategy": "channel", "symmetric": True}}}})
    assert ct is not None and ct.kind is Kind.INT and ct.bits == 8 and ct.group_size is None
    assert ct.ignores("model.layers.0.mlp.down_proj")
    assert not ct.ignores("model.layers.1.mlp.down_proj")
    assert not ct.w8a8  # no input_activations: weight-only int8
    w8a8 = read_quantization_config({
        "quant_method": "compressed-tensors", "format": "int-quantized",
        "config_groups": {"g": {
            "weights": {"num_bits": 8, "type": "int", "strategy": "channel",
                        "symmetric": True},
            "input_activations": {"num_bits": 8, "type": "int", "strategy": "token",
                                  "dynamic": True, "symmetric": True}}}})
    assert w8a8 is not None and w8a8.w8a8


def test_gguf_names_its_unquantized_modules_exactly():
    """weights/gguf.py lists the projections it stored dequantized by name: layer 1's
    must not match layer 10's (as AWQ's substrings would)."""
    quant = read_quantization_config({"quant_method": "gguf", "bits": 4, "group_size": 32,
                                      "ignore": ["model.layers.1.mlp.down_proj", "lm_head"]})
    assert quant is not None and quant.kind is Kind.INT
    assert (quant.bits, quant.group_size) == (4, 32)
    assert quant.ignores("model.layers.1.mlp.down_proj") and quant.ignores("lm_head")
    assert not quant.ignores("model.layers.10.mlp.down_proj")
    assert quant.tensors == {"qweight", "scales", "zeros"}


def test_gguf_modules_keep_their_own_code_widths():
    """A mixed file's modules of the other width are listed with theirs; the parts of
    one fused projection must agree."""
    quant = read_quantization_config({
        "quant_method": "gguf", "bits": 4, "group_size": 32,
        "module_bits": {"model.layers.0.self_attn.v_proj": 8}})
    assert quant is not None
    assert quant.bits_of(["model.layers.1.self_attn.v_proj"]) == 4
    assert quant.bits_of(["model.layers.0.self_attn.v_proj"]) == 8
    with pytest.raises(ValueError, match=r"codes of \[4, 8\] bits"):
        quant.bits_of(["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj"])


def test_gguf_tensors_read_as_scale_times_code_minus_a_float_zero():
    """The "gguf" method's projection: codes in quant.py's layout, fp32 scales and float
    zero points (a block's minimum over its step), read as scale * (code - zero)."""
    from pagellm.kernels.quant import pack

    torch.manual_seed(0)
    n, k = 16, 64
    codes = torch.randint(0, 16, (k, n))
    scales = torch.rand(k // 32, n) * 0.01 + 0.001
    zeros = torch.rand(k // 32, n) * 20 - 5  # not integers, and outside the codes' range
    quant = read_quantization_config({"quant_method": "gguf", "bits": 4, "group_size": 32})
    assert quant is not None
    group = torch.arange(k) // 32
    expected = ((codes.float() - zeros[group]) * scales[group]).t()
    for bits in (4, 8):  # a module's own width: qweight's rows per group of 32
        pieces = [("p.qweight", pack(codes, bits)), ("p.scales", scales), ("p.zeros", zeros)]
        ((name, weight),) = collect(pieces, quant, lambda _: True, lambda _: True)
        assert name == "p.weight" and isinstance(weight, PackedWeight) and weight.bits == bits
        torch.testing.assert_close(dequantize(weight), expected, rtol=0, atol=0)
    pieces = [("p.qweight", pack(codes, 4)), ("p.scales", scales), ("p.zeros", zeros)]
    with pytest.raises(ValueError, match="do not hold 4- or 8-bit codes"):
        list(collect([("p.qweight", pack(codes, 4)[:-1]), *pieces[1:]], quant,
                     lambda _: True, lambda _: True))
    with pytest.raises(ValueError, match=r"zeros is torch\.float16, not float32"):
        list(collect([*pieces[:2], ("p.zeros", zeros.half())], quant, lambda _: True,
                     lambda _: True))


@pytest.mark.parametrize("triton", [False, True], ids=["cpu", "triton"])
def test_only_integer_experts_get_a_packed_home(triton):
    """On the meta model of a Qwen3-MoE, `prepare` packs the experts of an integer
    checkpoint (the CPU int kernel's layout, or one PackedWeight per stacked weight for
    the fused MoE kernel), all E * N rows, in the checkpoint's groups; an act-order or
    FP8 checkpoint's experts stay stacked weights (loaded dequantized), as do those an
    `ignore` names."""
    from pagellm.executor.model.config import resolve_model_config
    from pagellm.executor.model.loader import _meta_model
    from pagellm.executor.model.quantized_checkpoint import prepare
    from pagellm.kernels.cpu_int_gemm import CpuIntWeight
    from pagellm.protocol.engine_args import EngineArgs

    config = resolve_model_config(EngineArgs(
        model=str(ROOT / "benchmarks" / "configs" / "qwen3-moe-32experts-2layers"),
        load_format="dummy",
        skip_tokenizer_init=True, dtype="bfloat16"))

    def experts(quantization_config: dict) -> list:
        model = _meta_model(config, None)
        quant = read_quantization_config(quantization_config)
        assert quant is not None
        prepare(model, quant, model.checkpoint_parts, torch.bfloat16, triton=triton)
        return [model.model.layers[i].mlp.experts for i in (0, 1)]

    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}
    layer0, layer1 = experts(gptq)
    codes = layer0.gate_up_codes.quant
    assert isinstance(codes, PackedWeight if triton else CpuIntWeight)
    assert codes.shape == (32 * 2 * 768, 2048) and (codes.bits, codes.group_size) == (4, 128)
    assert layer0.down_codes.quant.shape == (32 * 2048, 768) and layer0.down_proj.is_meta
    assert layer1.down_codes is not None
    awq = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm",
           "modules_to_not_convert": ["layers.1.mlp.experts"]}
    layer0, layer1 = experts(awq)
    assert layer0.down_codes is not None and layer1.down_codes is None
    for unpacked in ({**gptq, "desc_act": True},
                     {"quant_method": "fp8", "weight_block_size": None}):
        assert all(e.gate_up_codes is None and e.down_codes is None
                   for e in experts(unpacked)), unpacked
