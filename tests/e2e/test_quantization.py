"""Quantize on load (`quantization="int4"` / `"int8"` / `"fp8"`, issue 43) against
transformers on the same quantized weights (and, for fp8, activations).

The reference is transformers' own model with each projection's weight replaced by what
the packed form stands for (kernels/quant.py's `dequantize(quantize(w))`, which
tests/kernels/test_triton_quant.py checks by hand): quantizing a fused qkv or gate_up
weight is quantizing each part alone (groups run along a row's input columns), so
transformers' separate q/k/v and gate/up weights take the same values. Our engine runs
the packed weights through the Triton kernel (the interpreter, on the CPU) and must
give that model's greedy tokens, in fp32, token for token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import PROMPTS, gpt_oss_reference, runs_triton_kernels
from peft_adapters import argmax_along
from quantized_checkpoints import as_cpu_int_kernel, with_packed_experts

from pagellm import SamplingParams
from pagellm.demo.model import ModelSpec, make_model
from pagellm.executor.model.quantize import QUANTIZATIONS, group_size_for
from pagellm.kernels import cpu_int_gemm, fp8, quant

# The floors leg skips these (.ci/run): our kernels and loader against transformers' model,
# whose floor the family tests cover.
pytestmark = pytest.mark.own_code


GREEDY = SamplingParams(temperature=0.0, max_tokens=10)
HF_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                  "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa")  # (DeepSeek's)


def fake_quantized(model_dir: Path, quantization: str, tp: int = 1):
    """transformers' model with every projection's weight quantized and dequantized;
    for fp8 also every projection's input, per token, at each call (W8A8). With `tp`,
    o_proj and down_proj (row-parallel: K sliced) are quantized slice by slice, with the
    groups each rank uses."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return fake_quantize(model, quantization, tp)


def fake_quantize(model, quantization: str, tp: int = 1):
    """`model` (transformers') with its projections quantized as fake_quantized says;
    "cpu_int4" / "cpu_int8" are int4 / int8 on the CPU's own path (kernels/
    cpu_int_gemm.py): those weights, and activations per token and block of 32, symmetric
    int8, and the LM head as int8 the same way (quantized_checkpoints.as_cpu_int_kernel)."""
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] not in HF_PROJECTIONS:
                continue
            w = module.weight
            if quantization == "fp8":
                w.copy_(fp8.dequantize_rows(*fp8.quantize_rows(w)))
                module.register_forward_pre_hook(lambda _, args: tuple(
                    fp8.dequantize_rows(*fp8.quantize_rows(a.reshape(-1, a.shape[-1])))
                    .reshape(a.shape) for a in args))
            else:
                bits = QUANTIZATIONS[quantization.removeprefix("cpu_")]
                shards = tp if name.endswith(("o_proj", "down_proj")) else 1
                k = w.shape[1] // shards
                group = group_size_for(k, shards)
                w.copy_(torch.cat([quant.dequantize(quant.quantize(part, bits, group))
                                   for part in w.split(k, dim=1)], dim=1))
    return as_cpu_int_kernel(model) if quantization.startswith("cpu_") else model


def perturbed(model_dir: Path, seed: int):
    """(transformers' model with every weight moved by 0.05 * N(0, 1), a copy of its
    state dict): what a trainer pushes to its rollout engine."""
    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    return trained, {k: v.clone() for k, v in trained.state_dict().items()}


@runs_triton_kernels
@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["int4", "int8", "fp8"])
def test_quantized_on_load_equals_transformers_on_the_same_quantized_weights(
        quantization, model_dirs, make_llm):
    llm = make_llm(model_dirs["qwen2"], quantization=quantization, dtype="float32",
                   attention_backend="triton")
    model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    layer = model.model.layers[0]
    for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                 layer.mlp.down_proj):
        if quantization == "fp8":
            assert proj.quant.weight.dtype == torch.float8_e4m3fn
        else:
            assert proj.quant.bits == QUANTIZATIONS[quantization]
        assert proj.weight.is_meta  # the full-precision weight is gone
    reference = fake_quantized(model_dirs["qwen2"], quantization)
    outputs = llm.generate(PROMPTS[:4], GREEDY, use_tqdm=False)
    for out in outputs:
        ours = out.outputs[0].token_ids
        assert len(ours) == GREEDY.max_tokens
        assert argmax_along(reference, out.prompt_token_ids, ours) == ours


@runs_triton_kernels
@pytest.mark.parametrize("quantization", ["int4", "fp8"])
def test_weight_updates_are_quantized_as_they_land(quantization, model_dirs, make_llm):
    """RL with a quantized rollout engine: the trainer pushes full-precision weights
    (every tensor of a changed model, q, k and v apart, as trainers name them), each is
    quantized into its rows of the fused projection, and the tokens are transformers'
    on the new weights quantized the same way; tensors that are not quantized (the
    embedding, norms) load as before."""
    llm = make_llm(model_dirs["llama"], quantization=quantization, dtype="float32",
                   attention_backend="triton")
    trained, state = perturbed(model_dirs["llama"], seed=11)
    assert llm.update_weights(list(state.items())) == len(state)
    reference = fake_quantize(trained, quantization)
    for out in llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False):
        ours = out.outputs[0].token_ids
        assert argmax_along(reference, out.prompt_token_ids, ours) == ours


def test_quantization_without_its_kernel_or_of_an_unknown_kind_is_refused(model_dirs,
                                                                          make_llm):
    from pagellm.protocol.engine_args import EngineArgs

    with pytest.raises(ValueError, match="quantization='fp8' needs CUDA"):
        make_llm(model_dirs["llama"], quantization="fp8", attention_backend="torch")
    with pytest.raises(ValueError, match="quantization"):
        EngineArgs(model="demo", quantization="bitsandbytes")


@runs_triton_kernels
def test_sleep_levels_1_and_2_keep_or_take_back_the_quantized_weights(model_dirs, make_llm):
    """Level 1 backs the packed tensors up and restores them; level 2 drops them, and
    the trainer's full-precision weights are quantized back in on waking: the tokens
    are the same as before either sleep. Asleep, the packed tensors hold no memory."""
    from transformers import AutoModelForCausalLM

    llm = make_llm(model_dirs["llama"], quantization="int4", dtype="float32",
                   attention_backend="triton", enable_sleep_mode=True)
    qkv = llm.llm_engine.model_executor.driver_worker.model_runner.model.model.layers[
        0].self_attn.qkv_proj
    before = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], GREEDY,
                                                           use_tqdm=False)]
    for level in (1, 2):
        llm.sleep(level=level)
        assert qkv.quant.qweight.numel() == 0 and qkv.quant.scales.numel() == 0
        llm.wake_up()
        if level == 2:
            state = AutoModelForCausalLM.from_pretrained(
                model_dirs["llama"], dtype=torch.float32).state_dict()
            llm.update_weights(list(state.items()))
        after = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], GREEDY,
                                                              use_tqdm=False)]
        assert after == before, level


@runs_triton_kernels
@pytest.mark.slow
def test_two_ranks_quantize_their_own_slices_and_equal_transformers(model_dirs, make_llm):
    """Tensor parallel 2: each rank quantizes its slice after loading (a row-parallel
    one along its own half of K; this model's halves are too narrow for one rank's
    groups, so they take the widest that fit: 32 of o_proj's 32, 64 of down_proj's
    64), and the tokens are transformers' on the same quantized weights."""
    llm = make_llm(model_dirs["llama"], quantization="int4", dtype="float32",
                   attention_backend="triton", tensor_parallel_size=2)
    reference = fake_quantized(model_dirs["llama"], "int4", tp=2)
    for out in llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False):
        ours = out.outputs[0].token_ids
        assert argmax_along(reference, out.prompt_token_ids, ours) == ours


@runs_triton_kernels
def test_lora_adapters_on_a_quantized_base_equal_peft_on_the_same_weights(
        model_dirs, make_llm, tmp_path):
    """LoRA on an int8 base: the adapter's update adds to the quantized projection's
    output; the reference is PEFT's merge of the same adapter into transformers' model
    on the same quantized weights."""
    from peft import PeftModel
    from peft_adapters import make_adapter

    from pagellm import LoRARequest

    adapter = make_adapter(model_dirs["llama"], tmp_path / "adapter",
                           ["q_proj", "v_proj", "o_proj", "down_proj"], 8, 3)
    reference = PeftModel.from_pretrained(fake_quantized(model_dirs["llama"], "int8"),
                                          adapter).merge_and_unload().eval()
    base = fake_quantized(model_dirs["llama"], "int8")
    llm = make_llm(model_dirs["llama"], quantization="int8", dtype="float32",
                   attention_backend="triton", enable_lora=True, max_lora_rank=8)
    names = [True, False, True]
    outputs = llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False, lora_request=[
        LoRARequest("a", 1, str(adapter)) if n else None for n in names])
    for out, with_adapter in zip(outputs, names, strict=True):
        ours = out.outputs[0].token_ids
        model = reference if with_adapter else base
        assert argmax_along(model, out.prompt_token_ids, ours) == ours, with_adapter
    # The adapter changes something: its tokens are not the base model's choices.
    assert any(argmax_along(base, o.prompt_token_ids, o.outputs[0].token_ids)
               != o.outputs[0].token_ids for o, n in zip(outputs, names, strict=True) if n)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_the_cpus_own_int8_and_int4_equal_transformers(quantization, model_dirs, make_llm):
    """Without the Triton kernels int8 and int4 run the CPU's int kernel (group-wise
    weights, each projection's input quantized per token and block of 32): transformers
    with the same weights and activations quantized gives the same greedy tokens, also
    after a trainer's full-precision update (requantized as it lands)."""
    scheme = f"cpu_{quantization}"
    llm = make_llm(model_dirs["qwen2"], quantization=quantization, dtype="float32")
    model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.quant, cpu_int_gemm.CpuIntWeight) and qkv.weight.is_meta
    assert qkv.quant.bits == QUANTIZATIONS[quantization]
    reference = fake_quantized(model_dirs["qwen2"], scheme)
    for out in llm.generate(PROMPTS[:4], GREEDY, use_tqdm=False):
        ours = out.outputs[0].token_ids
        assert argmax_along(reference, out.prompt_token_ids, ours) == ours
    assert_int8_head(model, reference)
    trained, state = perturbed(model_dirs["qwen2"], seed=12)
    llm.update_weights(list(state.items()))
    reference = fake_quantize(trained, scheme)
    for out in llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False):
        ours = out.outputs[0].token_ids
        assert argmax_along(reference, out.prompt_token_ids, ours) == ours
    assert_int8_head(model, reference)  # the new head, quantized again


# top-2 of 8 experts, renormalised, layer 1 dense; experts of I = 32: down_proj's groups
# are 32 wide, gate_up's 64 (the hidden size)
MOE = ModelSpec(arch="qwen3_moe", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=1,
                head_dim=32, vocab_size=1024, tie_word_embeddings=False,
                intermediate_size=96, init_std=0.3, seed=11, config_extra=dict(
                    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                    norm_topk_prob=True, mlp_only_layers=[1]))

# Qwen2-MoE: the same with q/k/v biases, top-2 not renormalised and a shared expert of
# 64 columns (packed as a dense MLP's projections; its gate stays in full precision)
QWEN2_MOE = ModelSpec(arch="qwen2_moe", hidden_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, vocab_size=1024, tie_word_embeddings=False,
                      intermediate_size=96, init_std=0.3, seed=19, config_extra=dict(
                          num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                          shared_expert_intermediate_size=64, norm_topk_prob=False,
                          mlp_only_layers=[1]))


@pytest.mark.parametrize("spec", [MOE, QWEN2_MOE], ids=["qwen3_moe", "qwen2_moe"])
def test_the_cpus_int4_packs_moe_experts_and_takes_their_updates(spec, make_llm, tmp_path):
    """On the CPU's path the experts are packed too (moe.ExpertCodes: in a MoE model
    they are nearly all the bytes): the tokens are transformers' with every expert's
    weights quantized the same way and their inputs per token and block of 32. A
    trainer's update by transformers 5's stacked names is requantized as it lands;
    after sleep level 2 the checkpoint's own per-expert tensors bring the first model
    back."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from pagellm.executor.model.moe import ExpertCodes

    model_dir = make_model(tmp_path / "moe", spec)

    def reference(model):
        return with_packed_experts(fake_quantize(model, "cpu_int4"), 4)

    def assert_tokens(llm, model, prompts) -> list[list[int]]:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        for out in outputs:
            ours = out.outputs[0].token_ids
            assert argmax_along(model, out.prompt_token_ids, ours) == ours
        return [o.outputs[0].token_ids for o in outputs]

    llm = make_llm(model_dir, quantization="int4", dtype="float32", enable_sleep_mode=True)
    experts = llm.llm_engine.model_executor.driver_worker.model_runner.model.model.layers[
        0].mlp.experts
    for codes, placeholder in ((experts.gate_up_codes, experts.gate_up_proj),
                               (experts.down_codes, experts.down_proj)):
        assert isinstance(codes, ExpertCodes) and codes.quant.bits == 4
        assert placeholder.is_meta and codes.quant.shape == (
            placeholder.shape[0] * placeholder.shape[1], placeholder.shape[2])
    first = assert_tokens(llm, reference(AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32).eval()), PROMPTS[:4])
    trained, state = perturbed(model_dir, seed=13)
    assert "model.layers.0.mlp.experts.gate_up_proj" in state  # stacked [E, 2I, H]
    llm.update_weights(list(state.items()))
    assert assert_tokens(llm, reference(trained), PROMPTS[:4]) != first
    llm.sleep(level=2)
    llm.wake_up()
    checkpoint = load_file(model_dir / "model.safetensors")
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in checkpoint  # per expert
    llm.update_weights(list(checkpoint.items()))
    assert [o.outputs[0].token_ids for o in llm.generate(
        PROMPTS[:4], GREEDY, use_tqdm=False)] == first


def unstacked(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5's stacked experts (mlp.experts.gate_up_proj [E, 2I, H], down_proj
    [E, H, I]) as a checkpoint names them, one tensor per expert and projection."""
    out = {}
    for name, tensor in state.items():
        prefix, _, last = name.rpartition(".")
        if last == "gate_up_proj" and prefix.endswith(".experts"):
            size = tensor.shape[1] // 2
            for e, w in enumerate(tensor):
                out[f"{prefix}.{e}.gate_proj.weight"] = w[:size]
                out[f"{prefix}.{e}.up_proj.weight"] = w[size:]
        elif last == "down_proj" and prefix.endswith(".experts"):
            out.update({f"{prefix}.{e}.down_proj.weight": w for e, w in enumerate(tensor)})
        else:
            out[name] = tensor
    return out


# gpt-oss: biased experts (I = 32) with the clamped SwiGLU, attention sinks
GPT_OSS = ModelSpec(arch="gpt_oss", hidden_size=64, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=16, vocab_size=1024, tie_word_embeddings=False,
                    intermediate_size=32, init_std=0.3, seed=21, config_extra=dict(
                        num_local_experts=8, num_experts_per_tok=2, sliding_window=20,
                        swiglu_limit=1.5))


@gpt_oss_reference
def test_the_cpus_int4_packs_gpt_oss_experts_and_takes_their_updates(make_llm, tmp_path):
    """gpt-oss's experts, stored x @ W with gate and up interleaved, are packed like
    any MoE's (their biases kept): the tokens are transformers' with each expert's
    weights quantized the same way and their inputs per token and block of 32; a
    trainer's update by the checkpoint's names is requantized as it lands."""
    from transformers import AutoModelForCausalLM

    from pagellm.executor.model.moe import ExpertCodes

    model_dir = make_model(tmp_path / "gpt_oss", GPT_OSS)

    def reference(model):
        return with_packed_experts(fake_quantize(model, "cpu_int4"), 4)

    def assert_tokens(llm, model) -> list[list[int]]:
        outputs = llm.generate(PROMPTS[:4], GREEDY, use_tqdm=False)
        for out in outputs:
            ours = out.outputs[0].token_ids
            assert argmax_along(model, out.prompt_token_ids, ours) == ours
        return [o.outputs[0].token_ids for o in outputs]

    llm = make_llm(model_dir, quantization="int4", dtype="float32")
    experts = llm.llm_engine.model_executor.driver_worker.model_runner.model.model.layers[
        1].mlp.experts
    assert isinstance(experts.gate_up_codes, ExpertCodes) and experts.gate_up_proj.is_meta
    first = assert_tokens(llm, reference(AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32).eval()))
    trained, state = perturbed(model_dir, seed=14)
    assert state["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 64, 64)  # [E, H, 2I]
    llm.update_weights(list(state.items()))
    assert assert_tokens(llm, reference(trained)) != first


# DeepSeek-V3: latent attention (q through a latent of 64), grouped sigmoid routing,
# a shared expert; layer 0 dense
DEEPSEEK_V3 = ModelSpec(arch="deepseek_v3", hidden_size=64, num_layers=2, num_heads=4,
                        num_kv_heads=4, vocab_size=1024, tie_word_embeddings=False,
                        intermediate_size=96, init_std=0.3, seed=23, config_extra=dict(
                            kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
                            v_head_dim=32, q_lora_rank=64, n_routed_experts=8,
                            num_experts_per_tok=2, moe_intermediate_size=32,
                            n_shared_experts=1, n_group=4, topk_group=2,
                            routed_scaling_factor=2.5, norm_topk_prob=True,
                            first_k_dense_replace=1))


def test_the_cpus_int4_packs_deepseek_and_takes_its_updates(make_llm, tmp_path):
    """DeepSeek's experts, shared expert, MLP and latent attention's projections
    (q_a/q_b, kv_a, o) are packed, its per-head up-projection kv_b_proj kept: every
    prompt token's logprob tracks transformers' with those weights quantized the same way
    and their inputs per token and block of 32, before and after a trainer's full
    update (requantized as it lands). Logprobs, not greedy tokens: the absorbed latent
    attention sums in another order than transformers' (~1e-6), and an activation
    rounded to the other int8 step moves a later logprob by up to ~0.1; a projection
    quantized on one side only moves them by ~1 on average."""
    from transformers import AutoModelForCausalLM

    from pagellm.executor.model.moe import ExpertCodes

    model_dir = make_model(tmp_path / "deepseek", DEEPSEEK_V3)

    def assert_tracks(llm, model) -> None:
        reference = with_packed_experts(fake_quantize(model, "cpu_int4"), 4)
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
        errors = []
        for out in llm.generate(PROMPTS[:6], params, use_tqdm=False):
            ids = out.prompt_token_ids
            with torch.no_grad():
                expected = reference(torch.tensor([ids])).logits[0].log_softmax(-1)
            errors += [abs(pos[ids[i + 1]].logprob - float(expected[i, ids[i + 1]]))
                       for i, pos in enumerate(out.prompt_logprobs[1:])]
        error = torch.tensor(errors)
        assert len(error) > 200 and error.mean() < 0.03 and error.max() < 0.5, \
            (error.mean(), error.max())

    llm = make_llm(model_dir, quantization="int4", dtype="float32")
    layer = llm.llm_engine.model_executor.driver_worker.model_runner.model.model.layers[1]
    assert isinstance(layer.mlp.experts.gate_up_codes, ExpertCodes)
    for proj in (layer.self_attn.q_a_proj, layer.self_attn.q_b_proj,
                 layer.self_attn.kv_a_proj_with_mqa, layer.self_attn.o_proj,
                 layer.mlp.shared_experts.down_proj):
        assert isinstance(proj.quant, cpu_int_gemm.CpuIntWeight) and proj.weight.is_meta
    assert not layer.self_attn.kv_b_proj.weight.is_meta
    assert_tracks(llm, AutoModelForCausalLM.from_pretrained(model_dir,
                                                            dtype=torch.float32).eval())
    trained, state = perturbed(model_dir, seed=15)
    llm.update_weights(list(state.items()))
    assert_tracks(llm, trained)


@runs_triton_kernels
def test_int4_packs_moe_experts_for_the_triton_kernels(make_llm, tmp_path):
    """With the Triton kernels the experts are packed too, as one PackedWeight per
    stacked weight (what the fused MoE kernel reads on CUDA; here each expert's slice
    through the weight-only Triton GEMM): the tokens are transformers' with every
    expert's weights quantized the same way, and a trainer's update by the checkpoint's
    per-expert names lands requantized."""

    from pagellm.executor.model.moe import ExpertCodes

    model_dir = make_model(tmp_path / "moe", MOE)
    llm = make_llm(model_dir, quantization="int4", dtype="float32",
                   attention_backend="triton")
    experts = llm.llm_engine.model_executor.driver_worker.model_runner.model.model.layers[
        0].mlp.experts
    assert isinstance(experts.down_codes, ExpertCodes) and experts.down_proj.is_meta
    assert isinstance(experts.down_codes.quant, quant.PackedWeight)
    assert experts.down_codes.quant.shape == (8 * 64, 32)  # E * H rows, I columns
    reference = with_packed_experts(fake_quantized(model_dir, "int4"), 4, activations=False)
    for out in llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False):
        ours = out.outputs[0].token_ids
        assert argmax_along(reference, out.prompt_token_ids, ours) == ours
    trained, state = perturbed(model_dir, seed=14)
    llm.update_weights(list(unstacked(state).items()))
    reference = with_packed_experts(fake_quantize(trained, "int4"), 4, activations=False)
    for out in llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False):
        ours = out.outputs[0].token_ids
        assert argmax_along(reference, out.prompt_token_ids, ours) == ours


def assert_int8_head(model, reference) -> None:
    """The engine's logits are the reference's int8 LM head (dequantized weights,
    activations quantized per token and block of 32) applied to the same hidden states, to
    fp32 rounding: far closer than a full-precision head's (whose logits differ by the
    int8 error, ~1e-3 here)."""
    hidden = torch.randn(5, model.spec.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = model.compute_logits(hidden)
        theirs = reference.lm_head(hidden)
        full = hidden @ model.head_weight.t()
    tolerance = 1e-5 * theirs.abs().max().item()
    assert (ours - theirs).abs().max().item() < tolerance
    assert (full - theirs).abs().max().item() > 20 * tolerance


def _e4m3(t: torch.Tensor) -> torch.Tensor:
    return t.clamp(-448, 448).to(torch.float8_e4m3fn).to(t.dtype)


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(t.dtype)


# kv_cache_dtype -> (the cache's dtype, how it rounds a value, blocks per fp32 block)
KV_CACHE_DTYPES = {"fp8": (torch.float8_e4m3fn, _e4m3, 4), "bfloat16": (torch.bfloat16, _bf16, 2)}


@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=runs_triton_kernels)])
def test_a_narrow_kv_cache_equals_transformers_with_its_keys_and_values_rounded(
        backend, kv_cache_dtype, model_dirs, make_llm, monkeypatch):
    """kv_cache_dtype="fp8" / "bfloat16" under an fp32 model: the cache holds e4m3 (scale
    1.0, saturating) or bf16, a fresh prompt attends to what the cache holds, so the
    tokens are transformers' with every key (after RoPE) and value rounded so; the same
    memory holds 4x / 2x fp32's blocks. On the CPU decode steps are the fused C++ step
    (fp32 queries against the narrow cache's widened values); the logprobs move off the
    fp32 cache's."""
    import transformers.models.llama.modeling_llama as llama
    from transformers import AutoModelForCausalLM

    cache_dtype, rounded, ratio = KV_CACHE_DTYPES[kv_cache_dtype]
    rope = llama.apply_rotary_pos_emb

    def rounded_rope(q, k, *args, **kwargs):
        q, k = rope(q, k, *args, **kwargs)
        return q, rounded(k)

    monkeypatch.setattr(llama, "apply_rotary_pos_emb", rounded_rope)
    reference = AutoModelForCausalLM.from_pretrained(model_dirs["llama"],
                                                     dtype=torch.float32).eval()
    for layer in reference.model.layers:
        layer.self_attn.v_proj.register_forward_hook(lambda _, __, out: rounded(out))
    llm = make_llm(model_dirs["llama"], kv_cache_dtype=kv_cache_dtype, dtype="float32",
                   attention_backend=backend)
    plain = make_llm(model_dirs["llama"], dtype="float32", attention_backend=backend)
    runners = [x.llm_engine.model_executor.driver_worker.model_runner for x in (llm, plain)]
    assert runners[0].kv_caches[0].dtype == cache_dtype
    assert runners[0].kv_caches[0].shape[1] == ratio * runners[1].kv_caches[0].shape[1]
    if backend == "torch" and kv_cache_dtype == "bfloat16":
        assert runners[0].cpu_decode is not None  # the fused step takes a bf16 cache
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=0)
    outputs = llm.generate(PROMPTS[:4], params, use_tqdm=False)
    for out in outputs:
        ours = out.outputs[0].token_ids
        assert argmax_along(reference, out.prompt_token_ids, ours) == ours
    # The rounding changes something: the chosen tokens' logprobs are not the fp32 cache's.
    mine = [[next(iter(p.values())).logprob for p in o.outputs[0].logprobs] for o in outputs]
    theirs = [[next(iter(p.values())).logprob for p in o.outputs[0].logprobs]
              for o in plain.generate(PROMPTS[:4], params, use_tqdm=False)]
    assert mine != theirs
