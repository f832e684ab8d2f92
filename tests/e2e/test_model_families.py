"""The model families beyond Llama/Qwen: each architecture, in two shapes, against
transformers on the same random weights (checkpoints written by transformers' own model
classes).

Greedy tokens equal transformers' in fp32 with chunked prefill and prefix caching on;
bf16 logprobs within transformers' own bf16 error; mixture-of-experts with top-k 1, 2
and 8 and experts no token picks; two tensor-parallel ranks equal one; and a trainer's
weights pushed by transformers 5's in-memory names (stacked experts) land. gpt-oss adds
attention sinks, alternating windows, YaRN, biased experts with a clamped SwiGLU and a
checkpoint of its own layout; DeepSeek-V2/V3 latent attention and grouped routing with
shared experts; GLM-4.5's partial RoPE with them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import (
    PROMPTS,
    deepseek_v2_reference,
    gpt_oss_reference,
    olmo3_reference,
    qwen3_5_reference,
    runs_triton_kernels,
)
from family_specs import FAMILY_SPECS

from pagellm import SamplingParams
from pagellm.demo.model import make_model
from pagellm.executor.model.config import resolve_model_config
from pagellm.executor.model.loader import load_model
from pagellm.executor.model.parallel import TensorParallel
from pagellm.protocol.engine_args import EngineArgs

MAX_TOKENS = 32
# Prompts of many lengths; two share a 40-token prefix, so the second run of the batch
# hits the prefix cache mid-prompt.
FAMILY_PROMPTS = [*PROMPTS[1:6], PROMPTS[4] + "tail"]

# The families whose layers keep a state per request beside (or instead of) a KV cache.
STATEFUL = ("lfm2", "lfm2_moe", "qwen3_5", "qwen3_5_moe", "qwen3_next", "granitemoehybrid")
_REFERENCE_MARKS = {"gpt_oss": gpt_oss_reference, "deepseek_v2": deepseek_v2_reference,
                    "olmo3": olmo3_reference, "qwen3_5": qwen3_5_reference,
                    "qwen3_5_moe": qwen3_5_reference}


def _names(*names: str) -> list[Any]:
    """Parameters of the families `names`, those transformers 5.0 cannot serve as a
    reference marked to skip there (conftest)."""
    return [pytest.param(n, marks=_REFERENCE_MARKS[n]) if n in _REFERENCE_MARKS else n
            for n in names]


class _FamilyDirs(dict[str, Path]):
    """Each family's checkpoint, written the first time a test asks for it (a run of
    some tests builds only their models; transformers 5.0 has no Qwen3.5 to build)."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root

    def __missing__(self, name: str) -> Path:
        self[name] = directory = make_model(self.root / name, FAMILY_SPECS[name])
        return directory


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return _FamilyDirs(tmp_path_factory.mktemp("families"))


@pytest.fixture(scope="module")
def hf_models(family_dirs: dict[str, Path]) -> Callable[[str], Any]:
    from transformers import AutoModelForCausalLM

    models: dict[str, Any] = {}

    def get(name: str) -> Any:
        if name not in models:
            models[name] = AutoModelForCausalLM.from_pretrained(
                family_dirs[name], dtype=torch.float32).eval()
        return models[name]

    return get


def hf_greedy(model: Any, prompt_ids: list[int], max_new_tokens: int = MAX_TOKENS
              ) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), do_sample=False,
                             max_new_tokens=max_new_tokens,
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
    return out[0, len(prompt_ids):].tolist()


def _tokens(outputs: list[Any]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("name", _names(*FAMILY_SPECS))
def test_greedy_matches_transformers_with_chunked_prefill_and_prefix_caching(
        name, family_dirs, hf_models, make_llm):
    """A step budget of 32 tokens splits the long prompts across steps; the batch runs
    twice, the second time from the prefix cache (LFM2 and Qwen3.5, whose convolutions
    and linear attention keep a state per request that no KV block holds, compute it
    again: the engine turns prefix caching off for them)."""
    llm = make_llm(family_dirs[name], max_num_batched_tokens=32, block_size=16)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    first = llm.generate(FAMILY_PROMPTS, params, use_tqdm=False)
    cache = llm.engine_core.core.scheduler.kv_cache_manager
    hits_before = cache.prefix_cache_hits
    second = llm.generate(FAMILY_PROMPTS, params, use_tqdm=False)
    assert (cache.prefix_cache_hits > hits_before) == (name not in STATEFUL)
    expected = [hf_greedy(hf_models(name), o.prompt_token_ids) for o in first]
    assert _tokens(first) == expected
    assert _tokens(second) == expected
    # The comparison means something only if the model's paths are varied.
    assert sum(len(set(r)) for r in expected) > 4 * len(expected)


def _chosen_experts(model: Any, prompt_ids: list[list[int]]) -> list[set[int]]:
    """Per MoE layer, the experts transformers' router chose for any token of the
    prompts (its router's third output: the top-k ids)."""
    chosen: dict[str, set[int]] = {}
    hooks = []
    for module_name, module in model.named_modules():
        if type(module).__name__.endswith("TopKRouter"):
            def record(_m: Any, _i: Any, out: Any, key: str = module_name) -> None:
                chosen.setdefault(key, set()).update(out[2].flatten().tolist())
            hooks.append(module.register_forward_hook(record))
    try:
        with torch.no_grad():
            for ids in prompt_ids:
                model(torch.tensor([ids]))
    finally:
        for hook in hooks:
            hook.remove()
    return list(chosen.values())


def test_experts_no_token_picks_are_skipped_and_the_output_still_matches(
        family_dirs, hf_models, make_llm):
    """Top-1 of 16 experts over two short prompts: some experts see no token (checked
    on transformers' router), and the tokens still equal transformers'."""
    name = "qwen3_moe_top1"
    llm = make_llm(family_dirs[name])
    prompts = [[5, 17, 300, 41], [900, 3]]
    chosen = _chosen_experts(hf_models(name), prompts)
    assert chosen and all(len(c) < 16 for c in chosen), chosen
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    assert _tokens(outputs) == [hf_greedy(hf_models(name), p, 8) for p in prompts]


@pytest.mark.parametrize("name", _names("qwen3_moe", "mixtral", "qwen2_moe", "gpt_oss",
                                         "deepseek_v3", "olmo3", "granite", "minimax_m2",
                                         "cohere2", "exaone4", "lfm2", "lfm2_moe",
                                         "qwen3_5", "granitemoehybrid"))
def test_bf16_logprobs_track_transformers(name, family_dirs, make_llm):
    """bf16: every prompt and sampled token's logprob within 1.5x transformers' own bf16
    error against fp32 on the same bf16-rounded weights (as tests/e2e/test_correctness.py
    checks the dense families). Mixtral keeps its routing weights in fp32, Qwen3-MoE
    rounds them to bf16: both as transformers does."""
    from transformers import AutoModelForCausalLM

    llm = make_llm(family_dirs[name], dtype="bfloat16")
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=0, prompt_logprobs=0)
    outputs = llm.generate(FAMILY_PROMPTS[:4], params, use_tqdm=False)
    exact_model = AutoModelForCausalLM.from_pretrained(family_dirs[name],
                                                       dtype=torch.float32).eval()
    with torch.no_grad():
        for p in exact_model.parameters():
            p.copy_(p.bfloat16().float())
    hf_bf16 = AutoModelForCausalLM.from_pretrained(family_dirs[name],
                                                   dtype=torch.bfloat16).eval()

    def logprobs(model: Any, tokens: list[int]) -> torch.Tensor:  # [len - 1] float64
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0, :-1].double()
        return logits.log_softmax(-1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]

    ours_err, hf_err = [], []
    for out in outputs:
        tokens = out.prompt_token_ids + out.outputs[0].token_ids
        ours = [next(iter(pos.values())).logprob for pos in out.prompt_logprobs[1:]]
        ours += [pos[t].logprob for pos, t in zip(out.outputs[0].logprobs,
                                                   out.outputs[0].token_ids, strict=True)]
        exact = logprobs(exact_model, tokens)
        ours_err.append((torch.tensor(ours, dtype=torch.float64) - exact).abs())
        hf_err.append((logprobs(hf_bf16, tokens) - exact).abs())
    ours_max, hf_max = float(torch.cat(ours_err).max()), float(torch.cat(hf_err).max())
    ours_mean, hf_mean = float(torch.cat(ours_err).mean()), float(torch.cat(hf_err).mean())
    assert ours_max <= 1.5 * hf_max and ours_mean <= 1.5 * hf_mean, \
        (ours_max, hf_max, ours_mean, hf_mean)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "olmoe", "qwen2_moe"])
def test_each_ranks_experts_are_its_slice_of_the_checkpoint(name, family_dirs, hf_models):
    """Two ranks' stacked experts, router and (OLMoE) all-head q/k norms, loaded from the
    per-expert checkpoint, put back together equal transformers' stacked parameters."""
    config = resolve_model_config(EngineArgs(model=str(family_dirs[name])))
    ranks = [dict(load_model(config, torch.device("cpu"),
                             TensorParallel.layout(config.spec, rank, 2)).named_parameters())
             for rank in range(2)]
    hf = dict(hf_models(name).named_parameters())
    size = config.spec.moe.intermediate_size // 2
    for layer in range(config.spec.num_layers):
        prefix = f"model.layers.{layer}"
        if f"{prefix}.mlp.experts.gate_up_proj" not in ranks[0]:
            continue  # a dense layer
        whole = hf[f"{prefix}.mlp.experts.gate_up_proj"]  # [E, 2I, H]
        gate = torch.cat([r[f"{prefix}.mlp.experts.gate_up_proj"][:, :size] for r in ranks], 1)
        up = torch.cat([r[f"{prefix}.mlp.experts.gate_up_proj"][:, size:] for r in ranks], 1)
        assert torch.equal(torch.cat([gate, up], 1), whole)
        down = torch.cat([r[f"{prefix}.mlp.experts.down_proj"] for r in ranks], 2)
        assert torch.equal(down, hf[f"{prefix}.mlp.experts.down_proj"])
        for r in ranks:
            assert torch.equal(r[f"{prefix}.mlp.gate.weight"], hf[f"{prefix}.mlp.gate.weight"])
        if name == "olmoe":
            for norm in ("q_norm", "k_norm"):
                key = f"{prefix}.self_attn.{norm}.weight"
                assert torch.equal(torch.cat([r[key] for r in ranks]), hf[key])


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_each_ranks_mamba_heads_and_groups_are_its_slice_of_the_checkpoint(groups, tmp_path):
    """Granite 4.0-H's Mamba-2 layers on two ranks: each holds its 4 of the 8 heads' rows
    of in_proj (z, x, dt), of the convolution (x) and of dt_bias, A_log, D and the norm,
    and the B and C rows of the groups those heads read: its own (4 groups: two each),
    the one its heads lie in (2 groups), or the only one, on both (1). Put back
    together, they equal transformers' parameters."""
    from dataclasses import replace

    from transformers import AutoModelForCausalLM

    base = FAMILY_SPECS["granitemoehybrid"]
    directory = make_model(tmp_path / "granite", replace(base, config_extra={
        **(base.config_extra or {}), "mamba_n_groups": groups}))
    config = resolve_model_config(EngineArgs(model=str(directory)))
    ranks = [dict(load_model(config, torch.device("cpu"),
                             TensorParallel.layout(config.spec, rank, 2)).named_parameters())
             for rank in range(2)]
    hf = dict(AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
              .named_parameters())
    inner, n, heads = 128, 16, 8  # 8 heads of 16; B and C of 16 a group
    p = "model.layers.0.mamba"
    for rank, params in enumerate(ranks):
        mine = slice(rank * inner // 2, (rank + 1) * inner // 2)
        first = rank * groups // 2 if groups > 1 else 0
        read = slice(first * n, (first + max(1, groups // 2)) * n)  # its groups' B / C
        whole = hf[f"{p}.in_proj.weight"]  # [z | x | B | C | dt]
        z, x, b, c, dt = whole.split([inner, inner, groups * n, groups * n, heads])
        expected = torch.cat([z[mine], x[mine], b[read], c[read],
                              dt[rank * heads // 2:(rank + 1) * heads // 2]])
        assert torch.equal(params[f"{p}.in_proj.weight"], expected)
        for conv in ("weight", "bias"):
            cx, cb, cc = hf[f"{p}.conv1d.{conv}"].split([inner, groups * n, groups * n])
            assert torch.equal(params[f"{p}.conv1d.{conv}"],
                               torch.cat([cx[mine], cb[read], cc[read]]))
        for name in ("dt_bias", "A_log", "D"):
            assert torch.equal(params[f"{p}.{name}"],
                               hf[f"{p}.{name}"][rank * heads // 2:(rank + 1) * heads // 2])
        assert torch.equal(params[f"{p}.norm.weight"], hf[f"{p}.norm.weight"][mine])
        assert torch.equal(params[f"{p}.out_proj.weight"], hf[f"{p}.out_proj.weight"][:, mine])


def test_gpt_oss_ranks_hold_their_slices_in_the_shared_layout(family_dirs, hf_models):
    """gpt-oss's checkpoint stores its experts as x @ W with gate and up columns
    interleaved ([E, H, 2I], [E, I, H]): two ranks' stacked experts (the shared
    [E, 2I, H] gate-rows-first layout), expert biases and attention sinks, put back
    together, equal transformers' parameters; the down bias is whole on each rank."""
    config = resolve_model_config(EngineArgs(model=str(family_dirs["gpt_oss"])))
    ranks = [dict(load_model(config, torch.device("cpu"),
                             TensorParallel.layout(config.spec, rank, 2)).named_parameters())
             for rank in range(2)]
    hf = dict(hf_models("gpt_oss").named_parameters())
    size = config.spec.moe.intermediate_size // 2
    for layer in range(config.spec.num_layers):
        p = f"model.layers.{layer}"
        whole = hf[f"{p}.mlp.experts.gate_up_proj"]  # [E, H, 2I]
        ours = [r[f"{p}.mlp.experts.gate_up_proj"] for r in ranks]  # [E, 2 * I/2, H]
        gate = torch.cat([w[:, :size] for w in ours], 1).transpose(1, 2)
        up = torch.cat([w[:, size:] for w in ours], 1).transpose(1, 2)
        assert torch.equal(gate, whole[..., ::2]) and torch.equal(up, whole[..., 1::2])
        bias = hf[f"{p}.mlp.experts.gate_up_proj_bias"]
        ours_bias = [r[f"{p}.mlp.experts.gate_up_proj_bias"] for r in ranks]
        assert torch.equal(torch.cat([b[:, :size] for b in ours_bias], 1), bias[:, ::2])
        assert torch.equal(torch.cat([b[:, size:] for b in ours_bias], 1), bias[:, 1::2])
        down = torch.cat([r[f"{p}.mlp.experts.down_proj"] for r in ranks], 2)
        assert torch.equal(down, hf[f"{p}.mlp.experts.down_proj"].transpose(1, 2))
        sinks = torch.cat([r[f"{p}.self_attn.sinks"] for r in ranks])
        assert torch.equal(sinks, hf[f"{p}.self_attn.sinks"])
        for r in ranks:
            for name in ("mlp.experts.down_proj_bias", "mlp.router.weight", "mlp.router.bias"):
                assert torch.equal(r[f"{p}.{name}"], hf[f"{p}.{name}"])


@runs_triton_kernels
@gpt_oss_reference
def test_gpt_oss_on_the_triton_kernels_matches_transformers(family_dirs, hf_models, make_llm):
    """The Triton attention kernels (Triton's interpreter on the CPU) apply the sinks,
    in prompts and decodes, on both layer kinds: transformers' greedy tokens."""
    llm = make_llm(family_dirs["gpt_oss"], attention_backend="triton", block_size=16)
    prompts = FAMILY_PROMPTS[:3]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12),
                           use_tqdm=False)
    assert _tokens(outputs) == [hf_greedy(hf_models("gpt_oss"), o.prompt_token_ids, 12)
                                for o in outputs]


@gpt_oss_reference
def test_gpt_oss_mxfp4_checkpoint_loads_as_transformers_reads_it(family_dirs, make_llm,
                                                                tmp_path):
    """OpenAI's checkpoints store the experts as MXFP4 blocks and scales: the engine
    gives transformers' greedy tokens on the same file (transformers dequantizes it on
    the CPU); with quantization="int4" the experts it stands for are packed on load
    (tokens: transformers' with those weights quantized so); a blocks tensor without
    its scales is named."""
    from quantized_checkpoints import with_packed_experts, write_mxfp4_gpt_oss
    from safetensors.torch import load_file, save_file
    from test_quantization import fake_quantize
    from transformers import AutoModelForCausalLM

    from pagellm.executor.model.moe import ExpertCodes

    directory = write_mxfp4_gpt_oss(family_dirs["gpt_oss"], tmp_path / "mxfp4")
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    prompts = FAMILY_PROMPTS[:3]
    outputs = make_llm(directory).generate(prompts, SamplingParams(temperature=0.0,
                                                                   max_tokens=16),
                                           use_tqdm=False)
    assert _tokens(outputs) == [hf_greedy(hf, o.prompt_token_ids, 16) for o in outputs]
    original = AutoModelForCausalLM.from_pretrained(family_dirs["gpt_oss"],
                                                    dtype=torch.float32).eval()
    assert _tokens(outputs) != [hf_greedy(original, o.prompt_token_ids, 16)
                                for o in outputs]  # MXFP4 moved the weights
    llm = make_llm(directory, quantization="int4")
    experts = llm.llm_engine.model_executor.driver_worker.model_runner.model.model.layers[
        0].mlp.experts
    assert isinstance(experts.down_codes, ExpertCodes)
    reference = with_packed_experts(fake_quantize(hf, "cpu_int4"), 4)
    for out in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8),
                            use_tqdm=False):
        tokens = out.prompt_token_ids + out.outputs[0].token_ids
        with torch.no_grad():
            logits = reference(torch.tensor([tokens[:-1]])).logits[0]
        assert logits[len(out.prompt_token_ids) - 1:].argmax(-1).tolist() == \
            out.outputs[0].token_ids
    tensors = load_file(directory / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, directory / "model.safetensors")
    with pytest.raises(ValueError, match="without their blocks or scales: "
                       r"\['model.layers.1.mlp.experts.down_proj_blocks'\]"):
        make_llm(directory)


@pytest.mark.slow
@pytest.mark.parametrize("name", _names("qwen3_moe", "olmoe", "qwen2_moe", "gpt_oss",
                                         "deepseek_v3", "deepseek_v2", "glm4_moe", "olmo2",
                                         "minimax_m2", "cohere2", "lfm2", "qwen3_5",
                                         "qwen3_next", "granitemoehybrid"))
def test_two_ranks_equal_one_and_transformers(name, family_dirs, hf_models, make_llm):
    """Each rank holds half of every expert (and, for OLMoE, half of the all-head q/k
    norms, their statistic summed over the ranks): greedy tokens equal transformers',
    logprobs the one-rank engine's within 1e-4."""
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=2)
    prompts = FAMILY_PROMPTS[:4]
    one = make_llm(family_dirs[name]).generate(prompts, params, use_tqdm=False)
    two = make_llm(family_dirs[name], tensor_parallel_size=2).generate(prompts, params,
                                                                      use_tqdm=False)
    for a, b in zip(one, two, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids \
            == hf_greedy(hf_models(name), a.prompt_token_ids, 24)
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert la.keys() == lb.keys()
            assert all(abs(lp.logprob - lb[t].logprob) < 1e-4 for t, lp in la.items())


@pytest.mark.parametrize("name", _names("mixtral", "gpt_oss", "deepseek_v3", "minimax_m2",
                                         "lfm2_moe", "qwen3_5_moe", "granitemoehybrid"))
def test_a_trainers_stacked_expert_weights_load_by_their_in_memory_names(
        name, family_dirs, make_llm):
    """RL trainers on transformers 5 send `model.named_parameters()`: the experts as
    `mlp.experts.gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I] (gpt-oss: its own
    layout and biases). After a training step (here: a perturbation), those names load
    into the engine, which then generates the trained model's tokens. (Mixtral's and
    MiniMax-M2's checkpoints spell their experts w1/w2/w3 under block_sparse_moe;
    DeepSeek's latent up-projection is perturbed too. The choice bias, a buffer, is sent
    by its in-memory name as well: DeepSeek's `mlp.gate.e_score_correction_bias`,
    MiniMax-M2's `mlp.e_score_correction_bias`; LFM2-MoE's names are its own:
    `feed_forward.experts.gate_up_proj`, `feed_forward.gate`, `feed_forward.expert_bias`.)"""
    from transformers import AutoModelForCausalLM

    llm = make_llm(family_dirs[name])
    trained = AutoModelForCausalLM.from_pretrained(family_dirs[name],
                                                   dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(0)
    biases = [(b, t) for b, t in trained.named_buffers()
              if b.endswith(("e_score_correction_bias", "expert_bias"))]
    with torch.no_grad():
        for pname, p in [*trained.named_parameters(), *biases]:
            if ".experts." in pname or ".block_sparse_moe." in pname or pname.endswith((
                                                       "mlp.gate.weight", "router.weight",
                                                       "feed_forward.gate.weight",
                                                       "kv_b_proj.weight",
                                                       "e_score_correction_bias",
                                                       "expert_bias")):
                p.add_(0.2 * torch.randn(p.shape, generator=generator))
    model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    loaded = model.load_weights([*trained.named_parameters(), *biases])
    assert loaded == model.checkpoint_keys()  # the family's names, all of them
    prompts = FAMILY_PROMPTS[:3]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16),
                           use_tqdm=False)
    expected = [hf_greedy(trained, o.prompt_token_ids, 16) for o in outputs]
    assert _tokens(outputs) == expected
    original = AutoModelForCausalLM.from_pretrained(family_dirs[name],
                                                    dtype=torch.float32).eval()
    assert expected != [hf_greedy(original, o.prompt_token_ids, 16) for o in outputs]


@pytest.mark.parametrize(("name", "extra", "match"), [
    ("mixtral", dict(hidden_act="gelu"), "unsupported hidden_act 'gelu'"),
    ("mixtral", dict(sliding_window=-4), "sliding_window must be a positive integer, got -4"),
    ("mixtral", dict(architectures=["JambaForCausalLM"], model_type="mixtral"),
     "unsupported architecture 'JambaForCausalLM'"),
    ("mixtral", dict(swiglu_limit=float("inf")), "swiglu_limit must be a finite number"),
    # config.json may say no experts (Granite 4.0's dense models); Mixtral's block needs some
    ("mixtral", dict(num_local_experts=0, num_experts_per_tok=0),
     "a mixture-of-experts layer needs 1 <= num_experts_per_tok"),
    ("mixtral", dict(quantization_config={"quant_method": "mxfp4"}),  # gpt-oss's only
     "quantization_config.quant_method='mxfp4'"),
    # DeepSeek's routing and latent sizes
    ("deepseek_v3", dict(n_group=3), r"n_routed_experts \(8\) must be a multiple of n_group \(3\)"),
    ("deepseek_v3", dict(topk_group=5), r"topk_group \(5\) must be at most n_group \(4\)"),
    ("deepseek_v3", dict(topk_group=1, num_experts_per_tok=3),
     r"num_experts_per_tok \(3\) must be at most the experts of topk_group \(1\) groups"),
    ("deepseek_v3", dict(n_group=8, topk_group=2), "fewer than two experts per group"),
    ("deepseek_v3", dict(kv_lora_rank=0), "kv_lora_rank must be a positive integer, got 0"),
    ("deepseek_v3", dict(routed_scaling_factor=-1.0), "routed_scaling_factor must be"),
    ("deepseek_v3", dict(n_shared_experts=-1), r"n_shared_experts must be an integer in \[0, "),
    ("deepseek_v2", dict(topk_method="noaux_tc"), "unsupported topk_method 'noaux_tc'"),
    # SmolLM3's NoPE flags and MLP biases
    ("smollm3", dict(no_rope_layers=[1, 0]), r"no_rope_layers must hold a 0 or 1 per layer"),
    ("smollm3", dict(no_rope_layers=[1, 2, 1, 0]), "no_rope_layers must hold a 0 or 1"),
    ("smollm3", dict(mlp_bias=True), "mlp_bias=True is not supported"),
    # Granite's scalars
    ("granite", dict(logits_scaling=0), "logits_scaling must be a positive number, got 0"),
    ("granite", dict(residual_multiplier=-1.0), "residual_multiplier must be a positive"),
    # MiniMax-M2's rotary part
    ("minimax_m2", dict(rotary_dim=7), r"rotary_dim must be an even number in \(0, head_dim "
                                       r"\(32\)\], got 7"),
    ("minimax_m2", dict(rotary_dim=64), "rotary_dim must be an even number"),
    ("glm4", dict(mlp_bias=True), "mlp_bias=True is not supported"),
    # Cohere's
    ("cohere", dict(use_qk_norm=True), "use_qk_norm=True is not supported"),
    ("cohere2", dict(logit_scale=-0.5), "logit_scale must be a positive number, got -0.5"),
    ("exaone4", dict(mlp_bias=True), "mlp_bias=True is not supported"),
    ("ernie4_5", dict(use_bias=True), "use_bias=True is not supported"),
    ("ernie4_5_moe", dict(moe_layer_interval=0), "moe_layer_interval must be at least 1"),
    ("lfm2", dict(layer_types=["conv", "mamba", "full_attention", "conv"]),
     "layer_types must list 'conv' or 'full_attention'"),
    ("lfm2", dict(conv_L_cache=0), "conv_L_cache must be an integer from 1 to 64"),
    ("lfm2", dict(layer_types=["conv"] * 4),
     "layer_types must include at least one 'full_attention' layer"),
    ("lfm2_moe", dict(num_dense_layers=9), "num_dense_layers must be an integer from 0"),
    ("granitemoehybrid", dict(layer_types=["mamba", "sliding_attention", "attention", "mamba"]),
     "layer_types must (list|be a list strings in)"),  # ours; transformers 5.0's
    ("granitemoehybrid", dict(mamba_n_groups=3), r"mamba_n_heads \(8\) must be a multiple "
                                                 r"of mamba_n_groups \(3\)"),
    ("granitemoehybrid", dict(time_step_limit=[0.001, 0.1]),
     r"time_step_limit=\[0.001, 0.1\] is not supported"),
    ("granitemoehybrid", dict(mamba_d_state=0), "mamba_d_state must be a positive integer"),
    pytest.param("qwen3_5", dict(linear_num_value_heads=3),
                 r"linear_num_value_heads \(3\) must be a multiple of linear_num_key_heads "
                 r"\(2\)", marks=qwen3_5_reference),
    ("glm", dict(partial_rotary_factor=0.3, rope_parameters=dict(
        rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.3)),
     "partial_rotary_factor=0.3 gives rotary_dim"),
])
def test_a_config_the_engine_cannot_serve_is_refused_naming_the_field(
        tmp_path, family_dirs, name, extra, match):
    import json
    import shutil

    directory = shutil.copytree(family_dirs[name], tmp_path / name)
    raw = json.loads((directory / "config.json").read_text())
    raw.update(extra)
    (directory / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=match):
        resolve_model_config(EngineArgs(model=str(directory)))


@pytest.mark.parametrize("name", ["deepseek_v3", "minimax_m2", "ernie4_5_moe"])
def test_a_checkpoints_multi_token_prediction_layer_is_not_loaded(
        name, tmp_path, family_dirs, hf_models, make_llm):
    """DeepSeek-V3 (and MiniMax-M2) checkpoints append their multi-token-prediction
    modules as layers from num_hidden_layers on, ERNIE 4.5's as `mtp_*` modules
    (transformers ignores both): the engine loads the rest and serves the same
    tokens."""
    import shutil

    from safetensors.torch import load_file, save_file

    directory = tmp_path / "with_mtp"
    shutil.copytree(family_dirs[name], directory)
    weights = load_file(directory / "model.safetensors")
    last = FAMILY_SPECS[name].num_layers - 1
    extra = "model.mtp_block.0." if name == "ernie4_5_moe" else f"model.layers.{last + 1}."
    mtp = {key.replace(f"model.layers.{last}.", extra): t.clone()
           for key, t in weights.items() if key.startswith(f"model.layers.{last}.")}
    mtp[("model.mtp_linear_proj.0.weight" if name == "ernie4_5_moe"
         else f"model.layers.{last + 1}.eh_proj.weight")] = torch.zeros(64, 128)
    save_file({**weights, **mtp}, directory / "model.safetensors", metadata={"format": "pt"})
    llm = make_llm(directory)
    prompts = FAMILY_PROMPTS[:2]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8),
                           use_tqdm=False)
    assert _tokens(outputs) == [hf_greedy(hf_models(name), o.prompt_token_ids, 8)
                                for o in outputs]


def test_deepseek_v3s_own_fp8_checkpoint_loads_as_the_weights_its_codes_stand_for(
        tmp_path, family_dirs, make_llm):
    """DeepSeek-V3's release format: every projection, the latent attention's (kv_b_proj
    included) and each expert's, e4m3 with a scale per 16 x 16 block
    (weight_scale_inv); loaded dequantized, greedy tokens equal transformers' on the
    weights those codes and scales stand for (the experts stacked as it holds them)."""
    import re

    from quantized_checkpoints import PROJECTIONS, write_fp8_checkpoint
    from transformers import AutoModelForCausalLM

    directory, reference = write_fp8_checkpoint(
        family_dirs["deepseek_v3"], tmp_path / "fp8", (16, 16),
        projections=(*PROJECTIONS, "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"))
    state: dict[str, Any] = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, tensor in reference.items():
        m = re.fullmatch(r"(.+\.experts)\.(\d+)\.(gate|up|down)_proj\.weight", name)
        if m is None:
            state[name] = tensor
        else:
            experts.setdefault((m[1], m[3]), {})[int(m[2])] = tensor
    for prefix in {prefix for prefix, _ in experts}:
        gate, up, down = (experts[prefix, p] for p in ("gate", "up", "down"))
        state[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([gate[e], up[e]])
                                                      for e in sorted(gate)])
        state[f"{prefix}.down_proj"] = torch.stack([down[e] for e in sorted(down)])
    outputs = make_llm(directory).generate(FAMILY_PROMPTS[:4], SamplingParams(
        temperature=0.0, max_tokens=16), use_tqdm=False)
    original = AutoModelForCausalLM.from_pretrained(family_dirs["deepseek_v3"],
                                                    dtype=torch.float32).eval()
    theirs = AutoModelForCausalLM.from_pretrained(family_dirs["deepseek_v3"],
                                                  dtype=torch.float32).eval()
    assert not theirs.load_state_dict(state, strict=False).missing_keys
    assert _tokens(outputs) == [hf_greedy(theirs, o.prompt_token_ids, 16) for o in outputs]
    # the rounding to e4m3 shows
    assert _tokens(outputs) != [hf_greedy(original, o.prompt_token_ids, 16) for o in outputs]


def test_deepseek_v3s_choice_bias_stays_float32_in_a_bf16_model(family_dirs):
    """e_score_correction_bias decides which experts run; neighbouring experts' biases
    differ by less than bf16 resolves: a bf16 model keeps it in float32, to the
    checkpoint's bit (as transformers and vLLM do)."""
    from safetensors.torch import load_file

    directory = family_dirs["deepseek_v3"]
    config = resolve_model_config(EngineArgs(model=str(directory), dtype="bfloat16"))
    params = dict(load_model(config, torch.device("cpu")).named_parameters())
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert params[name].dtype == torch.float32
    assert torch.equal(params[name], load_file(directory / "model.safetensors")[name])
    assert params["model.layers.1.mlp.gate.weight"].dtype == torch.float32  # (ERNIE's)
    assert params["model.layers.1.mlp.experts.gate_up_proj"].dtype == torch.bfloat16


def test_deepseeks_cache_holds_the_latent_once(family_dirs, make_llm):
    """The latent is its own value: each layer's cache is one plane (kv_lora_rank +
    qk_rope_head_dim per token), its K and V halves views of the same memory, so a
    block costs half what a key-and-value cache of that width would (the greedy tests
    above run on it)."""
    llm = make_llm(family_dirs["deepseek_v3"])
    runner = llm.llm_engine.model_executor.driver_worker.model_runner
    spec = runner.model_config.spec
    assert spec.head_dim == 32 + 16 and spec.num_kv_heads == 1
    for layer in runner.kv_caches:
        assert layer.shape[0] == 2 and layer[0].data_ptr() == layer[1].data_ptr()
    assert runner.kv_cache_bytes_per_block() == spec.num_layers * 16 * spec.head_dim * 4


@pytest.mark.parametrize("name", _names(*FAMILY_SPECS))
def test_the_names_a_model_loads_from_are_its_checkpoints_own(name, family_dirs):
    """`checkpoint_keys` (what the loader checks a checkpoint for, and what a wake from
    level-2 sleep reads back from disk) is exactly the tensor names the family's
    checkpoint holds: its spelling of the experts (Mixtral's and MiniMax-M2's
    block_sparse_moe w1/w3/w2) and of the choice bias included."""
    from safetensors import safe_open

    config = resolve_model_config(EngineArgs(model=str(family_dirs[name])))
    model = load_model(config, torch.device("cpu"))
    with safe_open(str(family_dirs[name] / "model.safetensors"), "pt") as f:
        assert model.checkpoint_keys() == set(f.keys())


@qwen3_5_reference
def test_states_too_large_for_the_memory_are_refused_naming_max_num_seqs(family_dirs,
                                                                         make_llm):
    """Qwen3.5's linear attention keeps a float32 state row per possible request
    (max_num_seqs of them, allocated up front from the KV cache's budget): when they
    leave no room for one request's KV blocks, start-up says so and what to lower,
    and fewer rows fit."""
    probe = make_llm(family_dirs["qwen3_5"], max_num_seqs=1).engine_core.core.executor.runner
    per_row = probe.state_bytes()
    budget = 64 * per_row
    with pytest.raises(Exception, match=r"3 stateful layers take .* for max_num_seqs=256 "
                                        rf"rows \({per_row} bytes a request\).*lower "
                                        "max_num_seqs"):
        make_llm(family_dirs["qwen3_5"], kv_cache_memory_bytes=budget, max_model_len=256)
    llm = make_llm(family_dirs["qwen3_5"], kv_cache_memory_bytes=budget, max_model_len=256,
                   max_num_seqs=32)
    assert llm.info.num_kv_blocks == (budget - 32 * per_row) // \
        llm.engine_core.core.executor.runner.kv_cache_bytes_per_block()


def test_lfm2_requests_preempted_and_recomputed_start_their_state_afresh(
        family_dirs, hf_models, make_llm):
    """LFM2's convolutions carry a state per request from step to step, which no KV
    block holds. A KV cache too small for the batch (its budget less the states')
    preempts requests mid-decode; each is recomputed from its first token (no cached
    prefix: the runner refuses one) in whatever row of the batch it gets: the tokens
    are still transformers'. (Rows reused after requests end: the greedy test's second
    batch.)"""
    probe = make_llm(family_dirs["lfm2"], block_size=16).engine_core.core.executor.runner
    per_block, states = probe.kv_cache_bytes_per_block(), probe.state_bytes()
    assert states == 3 * 256 * 2 * 64 * 4  # 3 layers, max_num_seqs rows, K - 1 = 2, fp32
    llm = make_llm(family_dirs["lfm2"], block_size=16, max_num_batched_tokens=32,
                   kv_cache_memory_bytes=states + 12 * per_block, max_model_len=192)
    assert llm.info.num_kv_blocks == 12
    prompts = FAMILY_PROMPTS[:4]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                   ignore_eos=True), use_tqdm=False)
    assert llm.get_stats().num_preemptions > 0
    for output in outputs:
        assert output.outputs[0].token_ids == hf_greedy(hf_models("lfm2"),
                                                        output.prompt_token_ids)


@pytest.mark.parametrize(("name", "arch"), [
    ("lfm2", "Lfm2ForCausalLM"), ("granitemoehybrid", "GraniteMoeHybridForCausalLM"),
    pytest.param("qwen3_5", "Qwen3_5ForCausalLM", marks=qwen3_5_reference)])
def test_models_with_state_refuse_speculative_decoding(name, arch, family_dirs):
    """Rejected proposals would have advanced the convolutions' (and the linear
    attention's) states: refused at start-up, naming the setting and why."""
    with pytest.raises(ValueError, match=f"speculative_config is not supported for {arch}"):
        resolve_model_config(EngineArgs(
            model=str(family_dirs[name]),
            speculative_config={"method": "ngram", "num_speculative_tokens": 2}))


@pytest.mark.parametrize(("name", "match"), [
    pytest.param("qwen3_5", "Qwen3_5ForCausalLM yet: its query projection",
                 marks=qwen3_5_reference),
    ("granitemoehybrid", "GraniteMoeHybridForCausalLM yet: adapters of its Mamba-2"),
    ("granitemoehybrid_dense", "GraniteMoeHybridForCausalLM yet")])
def test_models_whose_adapters_are_not_mapped_refuse_lora(name, match, family_dirs):
    """Qwen3.5's q_proj holds each head's query and output gate (an adapter's q_proj
    update would not land as PEFT's); Granite 4.0's Mamba-2 layers and fused shared MLP
    have no adapter mapping yet: LoRA is refused at start-up, by name."""
    with pytest.raises(ValueError, match=f"enable_lora is not supported for {match}"):
        resolve_model_config(EngineArgs(model=str(family_dirs[name]), enable_lora=True))


@qwen3_5_reference
def test_qwen3_5s_linear_attention_splits_by_key_heads(family_dirs):
    """Four ranks cannot split its two key heads: refused before any rank starts, by
    name (parallel.check_divisible, the one check)."""
    from pagellm.executor.model.parallel import check_divisible

    config = resolve_model_config(EngineArgs(model=str(family_dirs["qwen3_5"])))
    with pytest.raises(ValueError, match="linear_num_key_heads=2 is not divisible by it"):
        check_divisible(config.spec, 4)


@qwen3_5_reference
def test_qwen3_5s_released_checkpoints_serve_their_text_model(
        tmp_path, family_dirs, hf_models, make_llm):
    """Qwen3.5 ships as Qwen3_5ForConditionalGeneration: the text model under
    `model.language_model.`, a vision tower beside it. Written by transformers' own
    class around the text model's weights, the checkpoint serves that model's tokens
    (the vision tower is not loaded; a checkpoint missing a text tensor is refused)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, Qwen3_5ForConditionalGeneration

    text_dir = family_dirs["qwen3_5"]
    text = json.loads((text_dir / "config.json").read_text())
    config = AutoConfig.for_model(
        "qwen3_5", text_config=text, tie_word_embeddings=False,
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2,
                           patch_size=4, out_hidden_size=text["hidden_size"]))
    model = Qwen3_5ForConditionalGeneration(config)
    model.model.language_model.load_state_dict(hf_models("qwen3_5").model.state_dict())
    model.lm_head.load_state_dict(hf_models("qwen3_5").lm_head.state_dict())
    directory = tmp_path / "released"
    model.save_pretrained(directory)
    for f in text_dir.iterdir():
        if f.name.startswith(("tokenizer", "generation_config", "special_tokens",
                              "chat_template")):
            shutil.copy(f, directory / f.name)
    names = load_file(directory / "model.safetensors")
    assert any(n.startswith("model.visual.") for n in names)
    llm = make_llm(directory)
    params = SamplingParams(temperature=0.0, max_tokens=16)
    for output in llm.generate(FAMILY_PROMPTS[:3], params, use_tqdm=False):
        assert output.outputs[0].token_ids == hf_greedy(hf_models("qwen3_5"),
                                                        output.prompt_token_ids, 16)
    del names["model.language_model.layers.0.linear_attn.A_log"]
    save_file(names, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(Exception, match=r"model\.language_model\.layers\.0\.linear_attn\.A_log"):
        make_llm(directory)
