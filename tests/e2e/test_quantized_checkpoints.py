"""Quantized checkpoints end to end (issue 43): GPTQ, AWQ, compressed-tensors and FP8
directories, written as their tools write them (tests/support/quantized_checkpoints.py),
give transformers' greedy tokens on the weights they stand for, in fp32, token for token:
packed and through the Triton kernels (the interpreter, on the CPU), and dequantized at
load on the CPU's own path. compressed-tensors and FP8 references are transformers' own
loads of the same directories."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import PROMPTS, runs_triton_kernels
from peft_adapters import argmax_along
from quantized_checkpoints import (
    as_cpu_int_kernel,
    with_packed_experts,
    write_fp8_checkpoint,
    write_int_checkpoint,
)
from safetensors.torch import load_file

from pagellm import SamplingParams
from pagellm.demo.model import ModelSpec, make_model
from pagellm.executor.model.linear import INT_WEIGHTS
from pagellm.kernels import cpu_int_gemm, fp8
from pagellm.kernels.quant import PackedWeight

# The floors leg skips these (.ci/run): the formats' floors are covered by
# tests/executor/test_quantized_checkpoint.py.
pytestmark = pytest.mark.own_code


GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def _transformers(model_dir: Path, reference: dict[str, torch.Tensor]):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict(reference, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied: the embedding's
    return model


def _transformers_load(directory: Path, block: bool):
    """transformers' own reading of a compressed-tensors or FP8 directory, dequantized;
    per-channel FP8 (W8A8) also quantizes each projection's input per token, as the
    engine's FP8 GEMM does."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig, FineGrainedFP8Config

    config = FineGrainedFP8Config(dequantize=True) if block else \
        CompressedTensorsConfig(run_compressed=False)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                 quantization_config=config).eval()
    if not block and "float-quantized" in (directory / "config.json").read_text():
        for name, module in model.named_modules():
            if name.endswith("_proj"):
                module.register_forward_pre_hook(lambda _, args: tuple(
                    fp8.dequantize_rows(*fp8.quantize_rows(a.reshape(-1, a.shape[-1])))
                    .reshape(a.shape) for a in args))
    return model


def _assert_greedy_equal(llm, reference) -> None:
    for out in llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False):
        ours = out.outputs[0].token_ids
        assert len(ours) == GREEDY.max_tokens
        assert argmax_along(reference, out.prompt_token_ids, ours) == ours


CASES = {
    "gptq-4bit-act-order": ("gptq", {"bits": 4, "group": 32, "act_order": True}),
    "awq-4bit": ("awq", {"bits": 4, "group": 32}),
    "ct-8bit-symmetric-act-order": ("compressed-tensors", {"bits": 8, "group": 32,
                                                           "symmetric": True,
                                                           "act_order": True}),
    "ct-4bit": ("compressed-tensors", {"bits": 4, "group": 32}),
    "ct-w8a8-int8-per-channel": ("compressed-tensors", {"bits": 8, "group": None,
                                                        "symmetric": True, "packed": False}),
}


@runs_triton_kernels
@pytest.mark.parametrize("case", list(CASES))
def test_integer_checkpoints_stay_packed_and_equal_transformers(case, model_dirs, make_llm,
                                                                tmp_path):
    method, options = CASES[case]
    directory, reference = write_int_checkpoint(model_dirs["qwen2"], tmp_path / case, method,
                                                **options)
    llm = make_llm(str(directory), dtype="float32", attention_backend="triton")
    model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    for proj in (model.model.layers[1].self_attn.qkv_proj, model.model.layers[1].mlp.down_proj):
        assert isinstance(proj.quant, PackedWeight) and proj.quant.bits == options["bits"]
        assert proj.weight.is_meta  # no full-precision copy was ever made
        assert (proj.quant.perm is not None) == options.get("act_order", False)
    if method == "compressed-tensors" and not options.get("act_order"):
        # (compressed-tensors 0.20 no longer reads actorder "group", the g_idx layout
        # earlier releases wrote and vLLM still reads: that case takes the hand reference)
        from transformers import AutoModelForCausalLM, CompressedTensorsConfig

        expected = AutoModelForCausalLM.from_pretrained(
            directory, dtype=torch.float32,
            quantization_config=CompressedTensorsConfig(run_compressed=False)).eval()
    else:
        expected = _transformers(model_dirs["qwen2"], reference)
    _assert_greedy_equal(llm, expected)


@runs_triton_kernels
@pytest.mark.parametrize("block", [(32, 32), None], ids=["fp8-block", "fp8-channel-w8a8"])
def test_fp8_checkpoints_equal_transformers_own_load(block, model_dirs, make_llm, tmp_path):
    """Per-channel FP8 stays packed (the FP8 GEMM, activations per token); block-wise
    scales load dequantized (no block-scaled GEMM yet)."""
    directory, _ = write_fp8_checkpoint(model_dirs["llama"], tmp_path / "fp8", block)
    llm = make_llm(str(directory), dtype="float32", attention_backend="triton")
    qkv = llm.llm_engine.model_executor.driver_worker.model_runner.model.model.layers[
        0].self_attn.qkv_proj
    assert isinstance(qkv.quant, fp8.Fp8Weight) == (block is None)
    _assert_greedy_equal(llm, _transformers_load(directory, block is not None))


def test_without_the_kernels_a_checkpoint_loads_dequantized(model_dirs, make_llm, tmp_path):
    """The CPU's own path (no Triton): the same tokens from full-precision weights made
    at load; vLLM's kernel-named aliases (gptq_marlin) name the same format."""
    directory, reference = write_int_checkpoint(model_dirs["llama"], tmp_path / "gptq",
                                                "gptq", bits=4, group=32, act_order=True)
    llm = make_llm(str(directory), dtype="float32", quantization="gptq_marlin")
    model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    assert not model.quantized and model.model.layers[0].self_attn.qkv_proj.quant is None
    _assert_greedy_equal(llm, _transformers(model_dirs["llama"], reference))


@pytest.mark.parametrize("case", ["awq-4bit", "ct-4bit"])
def test_integer_checkpoints_run_packed_on_the_cpus_int_kernel(case, model_dirs, make_llm,
                                                               tmp_path):
    """The CPU's own path keeps 4-bit checkpoints packed (kernels/cpu_int_gemm.py: no
    full-precision copy) and gives the tokens of transformers on the weights the codes
    stand for, with each projection's input quantized per token and block of 32 as the
    kernel does, and the LM head's int8 copy (`as_cpu_int_kernel`)."""
    method, options = CASES[case]
    directory, reference = write_int_checkpoint(model_dirs["qwen2"], tmp_path / case, method,
                                                **options)
    llm = make_llm(str(directory), dtype="float32")
    model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    for proj in (model.model.layers[1].self_attn.qkv_proj, model.model.layers[1].mlp.down_proj):
        assert isinstance(proj.quant, cpu_int_gemm.CpuIntWeight) and proj.weight.is_meta
        assert (proj.quant.bits, proj.quant.group_size) == (4, 32)
    assert INT_WEIGHTS.get(model.head_weight) is not None  # the LM head's int8 copy
    expected = _transformers(model_dirs["qwen2"], reference)
    _assert_greedy_equal(llm, as_cpu_int_kernel(expected))


def test_a_w8a8_int8_checkpoint_runs_as_its_own_scheme_on_the_cpu(model_dirs, make_llm,
                                                                  tmp_path):
    """compressed-tensors' W8A8 int8 (per-channel int8 weights, dynamic per-token int8
    activations) on the CPU's own path: its weights go straight into the CPU's int
    kernel in groups of whole rows, and the tokens are transformers' own load of the
    directory with each projection's input quantized as the kernel does (per token and
    block of 32: finer than the checkpoint's per-token scheme)."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    directory, _ = write_int_checkpoint(model_dirs["qwen2"], tmp_path / "w8a8",
                                        "compressed-tensors", bits=8, group=None,
                                        symmetric=True, packed=False)
    llm = make_llm(str(directory), dtype="float32")
    qkv = llm.llm_engine.model_executor.driver_worker.model_runner.model.model.layers[
        0].self_attn.qkv_proj
    assert isinstance(qkv.quant, cpu_int_gemm.CpuIntWeight) and qkv.weight.is_meta
    assert qkv.quant.group_size == qkv.quant.in_features  # the checkpoint's scales
    reference = AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32,
        quantization_config=CompressedTensorsConfig(run_compressed=False)).eval()
    _assert_greedy_equal(llm, as_cpu_int_kernel(reference))


@runs_triton_kernels
@pytest.mark.slow
def test_two_ranks_load_their_slices_of_a_packed_checkpoint(model_dirs, make_llm, tmp_path):
    """Tensor parallel 2: q/k/v and gate/up narrowed on their output rows, o_proj and
    down_proj on their input columns in whole groups (32 of o_proj's 64: each rank one
    group; groups of 64 in down_proj's 128)."""
    directory, reference = write_int_checkpoint(model_dirs["llama"], tmp_path / "gptq",
                                                "gptq", bits=4, group=32)
    llm = make_llm(str(directory), dtype="float32", attention_backend="triton",
                   tensor_parallel_size=2)
    _assert_greedy_equal(llm, _transformers(model_dirs["llama"], reference))


def _stacked(reference: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's per-expert weights (model.layers.N.mlp.experts.E.gate_proj.weight,
    ...) as transformers 5's model holds them: gate_up_proj [E, 2I, H], down_proj
    [E, H, I] per layer."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, tensor in reference.items():
        if ".experts." not in name:
            out[name] = tensor
            continue
        layer, rest = name.split(".experts.")
        expert, proj, _ = rest.split(".")
        experts.setdefault((layer, proj), {})[int(expert)] = tensor
    for (layer, proj), by_expert in experts.items():
        if proj == "down_proj":
            out[f"{layer}.experts.down_proj"] = torch.stack(
                [by_expert[e] for e in sorted(by_expert)])
        elif proj == "gate_proj":
            up = experts[(layer, "up_proj")]
            out[f"{layer}.experts.gate_up_proj"] = torch.stack(
                [torch.cat([by_expert[e], up[e]]) for e in sorted(by_expert)])
    return out


@pytest.mark.parametrize(("arch", "tp", "backend"), [
    ("qwen3_moe", 1, "torch"), pytest.param("qwen3_moe", 2, "torch", marks=pytest.mark.slow),
    pytest.param("qwen3_moe", 1, "triton", marks=runs_triton_kernels),
    ("qwen2_moe", 1, "torch"), pytest.param("qwen2_moe", 2, "torch", marks=pytest.mark.slow)])
def test_a_moe_checkpoints_experts_stay_packed(arch, tp, backend, make_llm, tmp_path):
    """A GPTQ Qwen3-MoE checkpoint (every expert's projections quantized, as GPTQModel
    writes them) keeps its experts packed (moe.ExpertCodes: no full-precision copy),
    each expert's tensors into its rows: in the CPU int kernel's layout, or with the
    Triton kernels as one PackedWeight per stacked weight (the fused MoE kernel's on
    CUDA). Two ranks narrow the experts' rows, and down_proj's input columns in whole
    groups (32 of each rank's 64). Tokens: transformers on the weights the codes stand
    for; on the CPU's path every projection's input (the experts' too) quantized per
    token and block of 32. A Qwen2-MoE's shared expert (64 columns, each rank 32) is
    quantized as the dense projections are; its gate stays in full precision."""
    from pagellm.executor.model.moe import ExpertCodes

    model_dir = make_model(tmp_path / "moe", ModelSpec(
        arch=arch, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
        vocab_size=1024, intermediate_size=96, init_std=0.3, seed=21, config_extra=dict(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
            norm_topk_prob=True,
            **(dict(shared_expert_intermediate_size=64) if arch == "qwen2_moe" else {}))))
    directory, reference = write_int_checkpoint(model_dir, tmp_path / "gptq", "gptq",
                                                bits=4, group=32)
    tensors = load_file(directory / "model.safetensors")
    assert "model.layers.1.mlp.experts.2.down_proj.qweight" in tensors
    if arch == "qwen2_moe":
        assert {"model.layers.1.mlp.shared_expert.down_proj.qweight",
                "model.layers.1.mlp.shared_expert_gate.weight"} <= tensors.keys()
    llm = make_llm(str(directory), dtype="float32", tensor_parallel_size=tp,
                   attention_backend=backend)
    if tp == 1:
        experts = llm.llm_engine.model_executor.driver_worker.model_runner.model.model.layers[
            1].mlp.experts
        assert isinstance(experts.down_codes, ExpertCodes) and experts.down_proj.is_meta
        assert isinstance(experts.down_codes.quant, PackedWeight if backend == "triton"
                          else cpu_int_gemm.CpuIntWeight)
        assert (experts.down_codes.quant.bits, experts.down_codes.quant.group_size) == (4, 32)
    expected = _transformers(model_dir, _stacked(reference))
    if backend == "triton":
        _assert_greedy_equal(llm, with_packed_experts(expected, None, activations=False))
    else:
        _assert_greedy_equal(llm, as_cpu_int_kernel(with_packed_experts(expected, None)))


def test_experts_a_checkpoint_leaves_in_full_precision_load_as_weights(make_llm, tmp_path):
    """AutoGPTQ picks modules by name: Mixtral's experts (w1/w3/w2, not *_proj) stay
    fp32 in its checkpoint, named in no `ignore`. They load as stacked weights (not
    refused as a projection the config says is quantized), the attention packed."""
    from transformers import AutoModelForCausalLM

    model_dir = make_model(tmp_path / "mixtral", ModelSpec(
        arch="mixtral", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
        vocab_size=1024, intermediate_size=64, init_std=0.2, seed=13,
        config_extra=dict(num_local_experts=4, num_experts_per_tok=2)))
    directory, reference = write_int_checkpoint(model_dir, tmp_path / "gptq", "gptq",
                                                bits=4, group=32)
    stored = load_file(directory / "model.safetensors")
    assert stored["model.layers.0.block_sparse_moe.experts.1.w2.weight"].dtype == torch.float32
    assert "model.layers.0.self_attn.q_proj.qweight" in stored
    llm = make_llm(str(directory), dtype="float32")
    layer = llm.llm_engine.model_executor.driver_worker.model_runner.model.model.layers[0]
    assert layer.mlp.experts.gate_up_codes is None and not layer.mlp.experts.down_proj.is_meta
    assert isinstance(layer.self_attn.qkv_proj.quant, cpu_int_gemm.CpuIntWeight)
    expected = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected.load_state_dict({k: v for k, v in reference.items() if ".experts." not in k},
                             strict=False)  # the attention's weights as their codes stand
    _assert_greedy_equal(llm, as_cpu_int_kernel(expected))


def test_the_quantization_argument_must_fit_the_checkpoint(model_dirs, make_llm, tmp_path):
    directory, _ = write_int_checkpoint(model_dirs["llama"], tmp_path / "gptq", "gptq")
    for asked, message in (("awq", "is a gptq checkpoint"), ("int4", "is a gptq checkpoint")):
        with pytest.raises(ValueError, match=message):
            make_llm(str(directory), quantization=asked)
    with pytest.raises(ValueError, match=r"names a checkpoint format, but .* has no "
                                         r"quantization_config"):
        make_llm(model_dirs["llama"], quantization="gptq")
    with pytest.raises(ValueError, match="load_format='dummy' draws"):
        make_llm(str(directory), load_format="dummy", attention_backend="triton")
