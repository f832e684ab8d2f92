"""llama.cpp's GGUF files as models (pagellm/weights/gguf.py): written as llama.cpp writes
them (tests/support/gguf_files.py), they give transformers' own greedy tokens on the same
file (`gguf_file=`), token for token in fp32, with their quantized projections kept as
codes for the CPU's int kernel and for the Triton kernels (the interpreter here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import PROMPTS, runs_triton_kernels
from gguf_files import write_gguf
from peft_adapters import argmax_along
from quantized_checkpoints import as_cpu_int_kernel, with_packed_experts

from pagellm import SamplingParams
from pagellm.demo.model import ModelSpec, make_model
from pagellm.kernels.cpu_int_gemm import CpuIntWeight
from pagellm.kernels.quant import PackedWeight
from pagellm.weights import gguf as gguf_module
from pagellm.weights.gguf import TRANSFORMERS_FLOOR, gguf_model_dir, transformers_version

pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(transformers_version() < TRANSFORMERS_FLOOR,
                                reason="GGUF files need transformers >= 5.18 (its reader)")
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
# llama (q and k rows permuted by llama.cpp), GQA, untied head; no RoPE scaling (the
# writer does not store llama3's).
SPEC = ModelSpec(arch="llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                 intermediate_size=128, vocab_size=1024, init_std=0.1, seed=5)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("gguf") / "llama", SPEC)


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("PAGELLM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _transformers(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                dtype=torch.float32).eval()


def _assert_greedy_equal(llm, reference) -> None:
    for out in llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False):
        ours = out.outputs[0].token_ids
        assert len(ours) == GREEDY.max_tokens
        assert argmax_along(reference, out.prompt_token_ids, ours) == ours


@pytest.mark.parametrize("projections", ["F32", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_a_gguf_file_on_the_cpu_gives_transformers_tokens(projections, llama_dir, tmp_path,
                                                          make_llm):
    """F32 projections load as fp32 weights; the block types stay codes for the CPU's int
    kernel (4 bits for Q4_*, 8 for Q8_0 and Q5_*), whose activations (per token and block
    of 32, as llama.cpp's Q8_0 activations) and int8 LM head the reference then takes
    too."""
    path = write_gguf(llama_dir, tmp_path / f"model-{projections}.gguf", projections)
    llm = make_llm(str(path), dtype="float32")
    model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    reference = _transformers(path)
    packed = projections != "F32"
    assert bool(model.quantized) == packed
    if packed:
        quant = model.model.layers[0].self_attn.qkv_proj.quant
        assert isinstance(quant, CpuIntWeight) and quant.group_size == 32
        assert quant.bits == (4 if projections.startswith("Q4") else 8)
        reference = as_cpu_int_kernel(reference)
    _assert_greedy_equal(llm, reference)
    # The tokenizer is the file's: the same ids as the model directory's own.
    from transformers import AutoTokenizer

    assert llm.get_tokenizer()(PROMPTS[2])["input_ids"] == \
        AutoTokenizer.from_pretrained(llama_dir)(PROMPTS[2])["input_ids"]


# Each family's own fields: Qwen3's head_dim 128 (every Qwen3's; transformers' GGUF
# reader skips qwen3's key_length and assumes it); Qwen3-MoE's experts 768 wide (as
# Qwen3-30B-A3B's: the reader skips expert_feed_forward_length too).
FAMILY_FIELDS: dict[str, dict] = {
    "qwen3": dict(head_dim=128),
    "qwen3_moe": dict(head_dim=32, config_extra=dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=768,
        norm_topk_prob=True)),
    # Qwen2-MoE: Qwen1.5-MoE-A2.7B's widths, 1408 for the experts and 5632 for the shared
    # expert (the reader skips both fields too), unnormalised top-2; every layer sparse
    # (llama.cpp's qwen2moe has no dense MLP tensors)
    "qwen2_moe": dict(config_extra=dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632, norm_topk_prob=False))}


@pytest.mark.parametrize(("arch", "projections", "tp"), [
    ("qwen2", "Q8_0", 1), ("qwen3", "Q4_1", 1), ("phi3", "Q8_0", 1), ("phi3", "Q4_0", 2),
    ("gemma2", "Q8_0", 1), ("gemma3_text", "Q4_1", 1), ("qwen3_moe", "Q8_0", 1),
    ("qwen2_moe", "Q4_0", 1)])
def test_other_families_files_give_transformers_tokens(arch, projections, tp,
                                                      tmp_path_factory, tmp_path, make_llm):
    """The families most GGUF files on the hub hold beside llama, their projections kept
    as codes: Qwen2 (q/k/v biases, tied embeddings, rows not permuted), Qwen3 (q and k
    norms, a head_dim of its own), Phi-3, whose q/k/v and gate/up are one tensor each
    in the file and in the model (split by rows between two ranks), Gemma 2 and 3
    (norms stored as 1 + w, sliding windows, soft caps), and Qwen3-MoE, whose experts
    llama.cpp stacks (kept as codes an expert at a time: their inputs quantized too), and
    Qwen2-MoE, whose shared expert is codes as the dense projections are."""
    model_dir = make_model(tmp_path_factory.mktemp("gguf-family") / arch, ModelSpec(
        arch=arch, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
        intermediate_size=128, vocab_size=1024, init_std=0.1, seed=7,
        **FAMILY_FIELDS.get(arch, {})))
    path = write_gguf(model_dir, tmp_path / f"{arch}.gguf", projections)
    llm = make_llm(str(path), dtype="float32", tensor_parallel_size=tp)
    if tp == 1:
        model = llm.llm_engine.model_executor.driver_worker.model_runner.model
        # a layer's qkv, o, gate_up and down (a MoE layer's experts'), and a shared
        # expert's two
        assert len(model.quantized) == 4 * 2 + 2 * 2 * (arch == "qwen2_moe")
    assert json.loads((gguf_model_dir(path) / "config.json").read_text())[
        "quantization_config"]["ignore"] == ["lm_head"]  # every projection kept
    reference = _transformers(path)
    assert reference.config.model_type == arch
    if arch in ("qwen3_moe", "qwen2_moe"):
        with_packed_experts(reference, None)
    _assert_greedy_equal(llm, as_cpu_int_kernel(reference))


def test_a_mixtral_file_is_a_mixtral_with_its_experts_as_codes(tmp_path_factory, tmp_path,
                                                               make_llm):
    """convert_hf_to_gguf.py writes Mixtral as a llama with experts (llama.expert_count,
    stacked ffn_*_exps), which transformers' reader takes for a dense Llama. The
    conversion makes it a Mixtral (q and k unpermuted as llama's), its Q8_0 experts
    codes; the reference is transformers on the model's own directory with every
    projection's weights rounded through Q8_0, as the file holds them."""
    import gguf
    from transformers import AutoModelForCausalLM

    model_dir = make_model(tmp_path_factory.mktemp("gguf-mixtral") / "m", ModelSpec(
        arch="mixtral", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
        intermediate_size=64, vocab_size=1024, init_std=0.2, seed=13,
        config_extra=dict(num_local_experts=4, num_experts_per_tok=2)))
    path = write_gguf(model_dir, tmp_path / "mixtral.gguf", "Q8_0")
    config = json.loads((gguf_model_dir(path) / "config.json").read_text())
    assert (config["model_type"], config["num_local_experts"]) == ("mixtral", 4)
    llm = make_llm(str(path), dtype="float32")
    experts = llm.llm_engine.model_executor.driver_worker.model_runner.model.model.layers[
        1].mlp.experts
    assert experts.down_codes.quant.bits == 8 and experts.gate_up_proj.is_meta
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    q8 = gguf.GGMLQuantizationType.Q8_0
    with torch.no_grad():
        for name, weight in reference.named_parameters():
            if "_proj" in name and weight.dim() >= 2:
                rows = weight.reshape(-1, weight.shape[-1]).numpy()
                weight.copy_(torch.from_numpy(gguf.dequantize(gguf.quantize(rows, q8), q8))
                             .reshape(weight.shape))
    _assert_greedy_equal(llm, as_cpu_int_kernel(with_packed_experts(reference, None)))


def test_a_moe_files_unquantized_experts_load_as_weights(tmp_path_factory, tmp_path,
                                                        make_llm):
    """Layer 0's experts stored in F32 among Q8_0 attention: written stacked, as
    transformers assembles them, and ignored by pattern in the quantization_config, so
    the CPU's path loads them as weights (not requantized into codes); layer 1's Q4_0
    down projections are codes beside its F32 gate/up."""
    model_dir = make_model(tmp_path_factory.mktemp("gguf-moe") / "qwen3_moe", ModelSpec(
        arch="qwen3_moe", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
        intermediate_size=128, vocab_size=1024, init_std=0.1, seed=8,
        **FAMILY_FIELDS["qwen3_moe"]))
    types = {f"blk.{i}.ffn_{p}_exps.weight": "F32" for i in (0, 1) for p in ("gate", "up")}
    types.update({"blk.0.ffn_down_exps.weight": "F32", "blk.1.ffn_down_exps.weight": "Q4_0"})
    path = write_gguf(model_dir, tmp_path / "moe.gguf", "Q8_0", types)
    config = json.loads((gguf_model_dir(path) / "config.json").read_text())[
        "quantization_config"]
    assert sorted(config["ignore"]) == sorted([
        "lm_head", r"re:model\.layers\.0\.mlp\.experts\.\d+\.down_proj$",
        *(rf"re:model\.layers\.{i}\.mlp\.experts\.\d+\.(gate|up)_proj$" for i in (0, 1))])
    assert config["module_bits"] == {f"model.layers.1.mlp.experts.{e}.down_proj": 4
                                     for e in range(8)}
    llm = make_llm(str(path), dtype="float32")
    layers = llm.llm_engine.model_executor.driver_worker.model_runner.model.model.layers
    assert layers[0].mlp.experts.down_codes is None
    assert layers[1].mlp.experts.gate_up_codes is None
    assert not layers[1].mlp.experts.gate_up_proj.is_meta
    assert layers[1].mlp.experts.down_codes.quant.bits == 4
    reference = _transformers(path)
    reference.set_experts_implementation("eager")
    with_packed_experts(reference.model.layers[1], None, packed=("down_proj",))
    _assert_greedy_equal(llm, as_cpu_int_kernel(reference))


@runs_triton_kernels
def test_a_moe_files_experts_stay_packed_for_the_fused_moe_kernel(tmp_path_factory, tmp_path,
                                                                  make_llm):
    """A Qwen3-MoE file's Q4_0 experts with the Triton kernels: one PackedWeight per
    stacked weight (what the fused MoE kernel reads on CUDA; here each expert's slice
    through the weight-only GEMM), transformers' tokens on the file's weights (the
    Triton kernels are weight-only: no activation rounding)."""
    model_dir = make_model(tmp_path_factory.mktemp("gguf-moe-triton") / "m", ModelSpec(
        arch="qwen3_moe", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
        intermediate_size=128, vocab_size=1024, init_std=0.1, seed=7,
        **FAMILY_FIELDS["qwen3_moe"]))
    path = write_gguf(model_dir, tmp_path / "moe.gguf", "Q4_0")
    llm = make_llm(str(path), dtype="float32", attention_backend="triton")
    experts = llm.llm_engine.model_executor.driver_worker.model_runner.model.model.layers[
        1].mlp.experts
    assert isinstance(experts.gate_up_codes.quant, PackedWeight)
    assert experts.gate_up_codes.quant.bits == 4 and experts.gate_up_proj.is_meta
    _assert_greedy_equal(llm, _transformers(path))


@runs_triton_kernels
@pytest.mark.parametrize("projections", ["Q8_0", "Q4_0", "Q4_1"])
def test_block_projections_stay_packed_for_the_triton_kernels(projections, llama_dir,
                                                              tmp_path, make_llm):
    path = write_gguf(llama_dir, tmp_path / "model.gguf", projections)
    llm = make_llm(str(path), dtype="float32", attention_backend="triton")
    model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    assert len(model.quantized) == 4 * SPEC.num_layers
    assert model.model.layers[0].self_attn.qkv_proj.quant.bits == int(projections[1])
    _assert_greedy_equal(llm, _transformers(path))


@runs_triton_kernels
def test_a_mixed_file_keeps_each_projection_at_its_own_width(llama_dir, tmp_path, make_llm):
    """llama.cpp's mixes keep some tensors at a higher precision: layer 0's v_proj in Q8_0
    among Q4_0 takes q and k (computed with it, as one projection) to 8-bit codes too
    (theirs fit exactly); everything else stays 4-bit."""
    path = write_gguf(llama_dir, tmp_path / "mixed.gguf", "Q4_0",
                      {"blk.0.attn_v.weight": "Q8_0"})
    config = json.loads((gguf_model_dir(path) / "config.json").read_text())[
        "quantization_config"]
    assert (config["bits"], config["ignore"]) == (4, ["lm_head"])
    assert config["module_bits"] == {f"model.layers.0.self_attn.{p}_proj": 8 for p in "kqv"}
    llm = make_llm(str(path), dtype="float32", attention_backend="triton")
    layers = llm.llm_engine.model_executor.driver_worker.model_runner.model.model.layers
    assert layers[0].self_attn.qkv_proj.quant.bits == 8
    assert layers[0].mlp.gate_up_proj.quant.bits == 4
    assert layers[1].self_attn.qkv_proj.quant.bits == 4
    _assert_greedy_equal(llm, _transformers(path))


def test_two_ranks_split_a_mixed_file_on_the_cpus_int_kernel(llama_dir, tmp_path, make_llm):
    """Tensor parallel 2 over a file of two code widths: each rank's slices keep their
    module's width (layer 0's q/k/v 8 bits, the rest 4), o_proj and down_proj split on
    their input columns in whole groups of 32."""
    path = write_gguf(llama_dir, tmp_path / "mixed.gguf", "Q4_1",
                      {"blk.0.attn_v.weight": "Q8_0"})
    llm = make_llm(str(path), dtype="float32", tensor_parallel_size=2)
    _assert_greedy_equal(llm, as_cpu_int_kernel(_transformers(path)))


def _codes_weights(directory: Path, module: str) -> torch.Tensor:
    """What the "gguf" method's tensors of `module` in `directory` stand for: [N, K]."""
    from safetensors.torch import load_file

    from pagellm.kernels.quant import unpack

    state = load_file(str(directory / "model.safetensors"))
    qweight, scales, zeros = (state[f"{module}.{t}"] for t in ("qweight", "scales", "zeros"))
    bits = qweight.shape[0] // scales.shape[0]
    group = torch.arange(qweight.shape[0] * 32 // bits) // 32
    return ((unpack(qweight, bits).float() - zeros[group]) * scales[group]).t()


@pytest.mark.parametrize(("projections", "types", "eight_bit"), [
    # A *_K_M mix: layer 0's v_proj in Q6_K (sub-blocks of 16: re-quantized to 8-bit
    # codes) takes q and k (computed with it, as one projection) to 8 bits too; layer 1's
    # down_proj in Q5_K keeps its 8-bit codes among the file's 4-bit ones.
    ("Q4_K", {"blk.0.attn_v.weight": "Q6_K", "blk.1.ffn_down.weight": "Q5_K"},
     ["model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.q_proj",
      "model.layers.0.self_attn.v_proj", "model.layers.1.mlp.down_proj"]),
    ("Q5_K", {}, []),
], ids=["Q4_K_M-like", "Q5_K"])
def test_k_quant_files_keep_codes_and_give_transformers_tokens(
        projections, types, eight_bit, tmp_path_factory, tmp_path, make_llm):
    """K-quants need rows of 256 weights: a wider model. Its projections hold random
    blocks (gguf_files.RANDOM_BLOCKS), which transformers dequantizes as llama.cpp does;
    a Q6_K projection's 8-bit codes lie within half a step of that weight, and the
    reference takes the weights they stand for."""
    wide = make_model(tmp_path_factory.mktemp("gguf-k") / "llama", ModelSpec(
        arch="llama", hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
        intermediate_size=512, vocab_size=1024, init_std=0.1, seed=6))
    path = write_gguf(wide, tmp_path / f"{projections}.gguf", projections, types)
    directory = gguf_model_dir(path)
    config = json.loads((directory / "config.json").read_text())["quantization_config"]
    common = 4 if projections == "Q4_K" else 8
    assert (config["bits"], config["ignore"]) == (common, ["lm_head"])
    assert config["module_bits"] == dict.fromkeys(eight_bit, 8)
    reference = _transformers(path)
    if types:
        v_proj = "model.layers.0.self_attn.v_proj"
        ours, theirs = _codes_weights(directory, v_proj), reference.get_parameter(
            f"{v_proj}.weight").detach()
        groups = theirs.reshape(theirs.shape[0], -1, 32)
        half_step = (groups.amax(-1) - groups.amin(-1)).repeat_interleave(32, 1) / 510
        assert ((ours - theirs).abs() <= half_step * (1 + 1e-5) + 1e-7).all()
        assert not torch.equal(ours, theirs)  # re-quantized: not the file's own blocks
        with torch.no_grad():
            reference.get_parameter(f"{v_proj}.weight").copy_(ours)
    llm = make_llm(str(path), dtype="float32")
    layers = llm.llm_engine.model_executor.driver_worker.model_runner.model.model.layers
    assert layers[0].self_attn.qkv_proj.quant.bits == (8 if types else common)
    assert layers[1].self_attn.qkv_proj.quant.bits == common
    assert layers[1].mlp.down_proj.quant.bits == 8
    assert layers[1].mlp.down_proj.quant.group_size == 32
    _assert_greedy_equal(llm, as_cpu_int_kernel(reference))


@pytest.mark.parametrize(("arch", "layers"), [("gemma2", 46), ("gemma3_text", 62)])
def test_a_27b_gemma_file_scales_queries_as_llama_cpp(arch, layers, tmp_path_factory,
                                                     tmp_path, make_llm):
    """A Gemma 2 or 3 of 27B's depth scales its queries by 1 / sqrt(hidden / heads)
    (query_pre_attn_scalar 144 / 168 in its config), which its GGUF file cannot say and
    llama.cpp derives from the depth; transformers' reader leaves 256. The reference is
    transformers on the model's own directory, not on the file."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = make_model(tmp_path_factory.mktemp("gguf-27b") / arch, ModelSpec(
        arch=arch, hidden_size=32, num_layers=layers, num_heads=4, num_kv_heads=2,
        head_dim=16, intermediate_size=32, vocab_size=1024, init_std=0.3, seed=9,
        config_extra=dict(query_pre_attn_scalar=8)))
    path = write_gguf(model_dir, tmp_path / f"{arch}.gguf")
    read = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    assert read.query_pre_attn_scalar == 256  # what transformers' reader makes of it
    config = json.loads((gguf_model_dir(path) / "config.json").read_text())
    assert (config["query_pre_attn_scalar"], config["head_dim"]) == (8, 16)
    llm = make_llm(str(path), dtype="float32", max_model_len=128)
    _assert_greedy_equal(llm, AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32).eval())


# Widths apart from the config classes' defaults: Qwen3-MoE's experts (768), Qwen2-MoE's
# experts (1408) and shared expert (5632)
WIDTHS = {"qwen3_moe": dict(head_dim=32, config_extra=dict(
              num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
              norm_topk_prob=True)),
          "qwen2_moe": dict(config_extra=dict(
              num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
              shared_expert_intermediate_size=96, norm_topk_prob=False))}


@pytest.mark.parametrize("arch", WIDTHS)
def test_a_moe_files_experts_take_the_files_width(arch, tmp_path_factory, tmp_path,
                                                  make_llm):
    """llama.cpp takes Qwen3-MoE's and Qwen2-MoE's expert widths from the file
    (expert_feed_forward_length, and expert_shared_feed_forward_length for Qwen2-MoE's
    shared expert); transformers' reader leaves its config classes' (768 and 1408, 5632:
    Qwen3-30B-A3B's and Qwen1.5-MoE-A2.7B's), and fails on any other. The reference is
    transformers on the model's own directory (an F32 file: the same weights)."""
    from transformers import AutoModelForCausalLM

    model_dir = make_model(tmp_path_factory.mktemp("gguf-moe") / arch, ModelSpec(
        arch=arch, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
        intermediate_size=128, vocab_size=1024, init_std=0.3, seed=10, **WIDTHS[arch]))
    path = write_gguf(model_dir, tmp_path / f"{arch}.gguf")
    config = json.loads((gguf_model_dir(path) / "config.json").read_text())
    extra = WIDTHS[arch]["config_extra"]
    assert (config["norm_topk_prob"], config["moe_intermediate_size"]) == (
        extra["norm_topk_prob"], 64)
    assert config.get("shared_expert_intermediate_size") == extra.get(
        "shared_expert_intermediate_size")
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):  # transformers alone
        _transformers(path)
    llm = make_llm(str(path), dtype="float32")
    _assert_greedy_equal(llm, AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32).eval())


def test_a_file_converts_a_shard_at_a_time(llama_dir, tmp_path, cache, make_llm,
                                          monkeypatch):
    """The conversion writes as it reads, its memory one shard of the output whatever the
    model's size: with small shards the directory is several files and their index (as
    transformers shards a checkpoint), which the engine loads. An F32 projection among
    Q4_0 ones stays fp32 with the projections computed with it (layer 1's q/k/v), under
    `ignore`."""
    from safetensors import safe_open

    monkeypatch.setattr(gguf_module, "SHARD_BYTES", 48 << 10)
    path = write_gguf(llama_dir, tmp_path / "model.gguf", "Q4_0",
                      {"blk.1.attn_k.weight": "F32"})
    directory = gguf_model_dir(path)
    weight_map = json.loads((directory / "model.safetensors.index.json").read_text())[
        "weight_map"]
    shards = sorted(p.name for p in directory.glob("*.safetensors"))
    assert len(shards) >= 3 and sorted(set(weight_map.values())) == shards
    for shard in shards:
        with safe_open(str(directory / shard), "pt") as f:
            assert sorted(f.keys()) == sorted(k for k, v in weight_map.items() if v == shard)
    fp32 = [f"model.layers.1.self_attn.{p}_proj" for p in "kqv"]
    config = json.loads((directory / "config.json").read_text())["quantization_config"]
    assert (config["bits"], config["ignore"]) == (4, [*fp32, "lm_head"])
    assert {f"{m}.weight" for m in fp32} < weight_map.keys()
    assert f"{fp32[0]}.qweight" not in weight_map
    llm = make_llm(str(path), dtype="float32")
    model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    assert len(model.quantized) == 4 * SPEC.num_layers - 1
    _assert_greedy_equal(llm, as_cpu_int_kernel(_transformers(path), full_precision=fp32))


def test_a_file_without_a_weight_is_refused_naming_it(llama_dir, tmp_path, cache):
    """transformers would start the missing weight at random: the conversion names it."""
    path = write_gguf(llama_dir, tmp_path / "model.gguf", "Q8_0",
                      omit=("blk.1.ffn_down.weight",))
    with pytest.raises(ValueError, match=r"model\.gguf: it has no tensor for "
                                         r"model\.layers\.1\.mlp\.down_proj\.weight$"):
        gguf_model_dir(path)
    assert not any(cache.joinpath("gguf").iterdir())


def test_a_gguf_file_serves_as_a_draft_model(llama_dir, tmp_path, make_llm):
    """speculative_config's model may be a GGUF file too (converted as the target is):
    here the target's own file, whose every greedy proposal is accepted."""
    path = write_gguf(llama_dir, tmp_path / "model.gguf", "F32")
    llm = make_llm(str(path), dtype="float32", speculative_config={
        "model": str(path), "num_speculative_tokens": 3, "disable_by_batch_size": 64})
    assert llm.engine_args.speculative_config["model"] == llm.engine_args.model
    _assert_greedy_equal(llm, _transformers(path))
    stats = llm.get_stats()
    assert stats.spec_num_accepted_tokens >= 0.9 * stats.spec_num_draft_tokens > 0


def test_the_conversion_is_made_once_and_bad_files_are_named(llama_dir, tmp_path, cache):
    path = write_gguf(llama_dir, tmp_path / "model.gguf", "Q4_1")
    first = gguf_model_dir(path)
    built = (first / "model.safetensors").stat().st_mtime_ns
    assert gguf_model_dir(path) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == built  # not rebuilt
    assert [p.name for p in cache.joinpath("gguf").iterdir()] == [first.name]  # no debris
    # The dequantized form (the benchmarks' full-precision baseline) is a directory of its
    # own, with transformers' weights and no quantization_config.
    plain = gguf_model_dir(path, dequantized=True)
    assert plain != first and "quantization_config" not in json.loads(
        (plain / "config.json").read_text())
    assert gguf_model_dir(path) == first
    assert sorted(p.name for p in cache.joinpath("gguf").iterdir()) == sorted(
        [first.name, plain.name])
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(ValueError, match=r"cannot read the GGUF file .*broken\.gguf"):
        gguf_model_dir(bad)
    assert sorted(p.name for p in cache.joinpath("gguf").iterdir()) == sorted(
        [first.name, plain.name])


def test_a_transformers_older_than_its_gguf_reader_is_named(llama_dir, tmp_path, cache,
                                                            monkeypatch):
    """transformers 5.0-5.17 mis-read the tokenizer of a file with an EOS and no BOS
    (this writer's, and llama.cpp's for Qwen): refused up front, naming the version."""
    path = write_gguf(llama_dir, tmp_path / "model.gguf")
    monkeypatch.setattr(gguf_module, "transformers_version", lambda: (5, 17))
    with pytest.raises(ImportError, match=r"needs transformers >= 5\.18"):
        gguf_model_dir(path)
    assert not cache.joinpath("gguf").exists() or not any(cache.joinpath("gguf").iterdir())
