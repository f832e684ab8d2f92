"""On a CUDA machine (`pytest -m gpu`): the Triton path on the GPU, with and without
CUDA graphs, against transformers; one host sync per step; the profiled KV cache.
Skipped cleanly without a GPU.

(The kernel tests in test_kernels_triton.py also run on the GPU there: conftest only
selects Triton's interpreter when there is no GPU.)"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import PROMPTS, qwen3_5_reference

from pagellm import SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GREEDY = SamplingParams(temperature=0.0, max_tokens=32)


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_fp32_greedy_on_the_gpu_matches_transformers(name, enforce_eager, model_dirs,
                                                     hf_reference, make_llm):
    llm = make_llm(model_dirs[name], device="cuda", dtype="float32",
                   attention_backend="triton", kv_cache_memory_bytes=64 * 2**20,
                   enforce_eager=enforce_eager)
    runner = llm.engine_core.core.executor.runner
    assert (runner.graphs is None) == enforce_eager
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        expected = hf_reference(name, llm.tokenizer.encode(prompt), 32)
        assert output.outputs[0].token_ids == expected, prompt


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_on_the_gpu_matches_transformers(method, model_dirs,
                                                              hf_reference, make_llm):
    """Proposals verified on the GPU (steps without any replay the decode graphs, and a
    draft model then computes the graph's padded batch eagerly): transformers' tokens,
    and proposals accepted. The draft is the model itself: nearly every one is."""
    config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
              "prompt_lookup_max": 3, "disable_by_batch_size": 1024} \
        if method == "ngram" else {"method": "draft_model", "num_speculative_tokens": 3,
                                   "model": str(model_dirs["llama"])}
    llm = make_llm(model_dirs["llama"], device="cuda", dtype="float32",
                   attention_backend="triton", kv_cache_memory_bytes=64 * 2**20,
                   speculative_config=config)
    assert llm.engine_core.core.executor.runner.graphs is not None
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        expected = hf_reference("llama", llm.tokenizer.encode(prompt), 32)
        assert output.outputs[0].token_ids == expected, prompt
    stats = llm.get_stats()
    assert stats.spec_num_accepted_tokens > 0
    if method == "draft_model":
        assert stats.spec_num_accepted_tokens >= 0.9 * stats.spec_num_draft_tokens


def test_async_scheduling_on_the_gpu_matches_transformers(model_dirs, hf_reference,
                                                          make_llm):
    """Steps on the executor's step thread (the model loaded and its graphs captured
    there, replayed while the engine core schedules the next step): transformers'
    greedy tokens, and seeded samples with logprobs as the synchronous engine's."""
    options = {"device": "cuda", "dtype": "float32", "attention_backend": "triton",
               "kv_cache_memory_bytes": 64 * 2**20}
    llm = make_llm(model_dirs["llama"], async_scheduling=True, **options)
    assert llm.engine_core.core.executor.runner.graphs is not None
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        expected = hf_reference("llama", llm.tokenizer.encode(prompt), 32)
        assert output.outputs[0].token_ids == expected, prompt
    seeded = SamplingParams(temperature=0.8, seed=5, max_tokens=32, logprobs=2)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, seeded, use_tqdm=False)]
    plain = make_llm(model_dirs["llama"], **options)
    assert got == [o.outputs[0].token_ids
                   for o in plain.generate(PROMPTS, seeded, use_tqdm=False)]


def test_graphs_and_eager_give_identical_outputs(model_dirs, make_llm):
    """Every batch size from 1 to 10 decodes through the graphs (padded up the
    ladder) and gives exactly the eager run's tokens and logprobs."""
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=2)
    results = []
    for enforce_eager in (False, True):
        llm = make_llm(model_dirs["qwen3"], device="cuda", dtype="float32",
                       kv_cache_memory_bytes=64 * 2**20, enforce_eager=enforce_eager)
        runs = [llm.generate(PROMPTS[:n], params, use_tqdm=False) for n in (1, 3, 10)]
        results.append([[(c.token_ids, [sorted(lp.items()) for lp in c.logprobs or []])
                         for o in run for c in o.outputs] for run in runs])
    graphs, eager = results
    assert [[ids for ids, _ in run] for run in graphs] == \
        [[ids for ids, _ in run] for run in eager]
    for run_g, run_e in zip(graphs, eager, strict=True):
        for (_, lps_g), (_, lps_e) in zip(run_g, run_e, strict=True):
            for step_g, step_e in zip(lps_g, lps_e, strict=True):
                assert [t for t, _ in step_g] == [t for t, _ in step_e]
                for (_, a), (_, b) in zip(step_g, step_e, strict=True):
                    assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_bf16_logprobs_on_the_gpu_are_close_to_transformers(name, model_dirs, make_llm):
    """bf16 with CUDA graphs: each generated token's logprob is within bf16 tolerance
    of transformers' fp32 logprob of that token after the same prefix, and every
    chosen token is transformers' argmax or a near-tie with it."""
    from transformers import AutoModelForCausalLM

    llm = make_llm(model_dirs[name], device="cuda", dtype="bfloat16",
                   kv_cache_memory_bytes=64 * 2**20)
    hf = AutoModelForCausalLM.from_pretrained(model_dirs[name], dtype=torch.float32).eval()
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=0)
    for prompt, output in zip(PROMPTS, llm.generate(PROMPTS, params, use_tqdm=False),
                              strict=True):
        completion = output.outputs[0]
        ids = output.prompt_token_ids + completion.token_ids
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0].float()
        reference = logits.log_softmax(-1)[len(output.prompt_token_ids) - 1:-1]  # [N, V]
        for step, (token, lps) in enumerate(zip(completion.token_ids, completion.logprobs,
                                                strict=True)):
            ours = lps[token].logprob
            theirs = reference[step, token].item()
            # bf16 weights and activations against fp32: the CPU's bf16 path (fp32
            # accumulation, bf16 outputs, as cuBLAS) differs by up to 0.14 on qwen3.
            assert ours == pytest.approx(theirs, abs=0.2), (prompt, step)
            assert reference[step].max().item() - theirs < 0.2, (prompt, step)


def test_one_host_sync_per_decode_step(model_dirs, make_llm):
    """A plain greedy step waits on the device once: for its sampled ids."""
    llm = make_llm(model_dirs["llama"], device="cuda", dtype="float32",
                   kv_cache_memory_bytes=64 * 2**20)
    llm.generate(PROMPTS[:4], GREEDY, use_tqdm=False)  # warm up: kernels compiled
    runner = llm.engine_core.core.executor.runner
    syncs_per_step: list[int] = []
    execute = runner.execute_model

    def counted(scheduler_output):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = execute(scheduler_output)
        syncs_per_step.append(sum("synchroniz" in str(w.message) for w in caught))
        return result

    runner.execute_model = counted
    torch.cuda.set_sync_debug_mode("warn")
    try:
        llm.generate(PROMPTS[:4], GREEDY, use_tqdm=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        runner.execute_model = execute
    assert len(syncs_per_step) >= 32
    assert max(syncs_per_step) <= 1, syncs_per_step


def test_kv_cache_is_sized_by_profiling(model_dirs, make_llm):
    """Without kv_cache_memory_bytes the KV cache takes the engine's share of the GPU
    less weights and the profiled activations: under the share, and most of it."""
    share = 0.05
    llm = make_llm(model_dirs["llama"], device="cuda", dtype="float32",
                   kv_cache_memory_bytes=None, gpu_memory_utilization=share)
    executor = llm.engine_core.core.executor
    total = torch.cuda.get_device_properties(0).total_memory
    kv_bytes = executor.num_kv_blocks * executor.runner.kv_cache_bytes_per_block()
    assert 0.5 * share * total < kv_bytes < share * total
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 32 for o in outputs)


def test_structured_outputs_on_the_gpu_with_and_without_graphs(model_dirs, make_llm):
    """Issue 39 on CUDA: the bitmask reaches the GPU and xgrammar's CUDA apply kernel
    masks the logits after the decode graph: every constrained output matches its
    grammar, graphs and eager give the same tokens, and a free request beside them is
    what it is alone."""
    import json
    import re

    import jsonschema

    from pagellm import StructuredOutputsParams

    schema = {"type": "object", "required": ["n", "e"], "additionalProperties": False,
              "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                             "e": {"enum": ["red", "green"]}}}
    constrained = [
        SamplingParams(max_tokens=48, seed=i, structured_outputs=StructuredOutputsParams(
            json=schema, disable_any_whitespace=True)) for i in range(3)] + [
        SamplingParams(max_tokens=16, seed=7, structured_outputs=StructuredOutputsParams(
            regex=r"[a-f]{3}-[0-9]{2}"))]
    results = []
    for enforce_eager in (False, True):
        llm = make_llm(model_dirs["llama"], device="cuda", dtype="float32",
                       kv_cache_memory_bytes=64 * 2**20, enforce_eager=enforce_eager)
        alone = llm.generate(PROMPTS[4:5], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        outs = llm.generate(PROMPTS[:5], [*constrained, GREEDY], use_tqdm=False)
        texts = [o.outputs[0].text for o in outs]
        for text in texts[:3]:
            jsonschema.validate(json.loads(text), schema)
        assert re.fullmatch(r"[a-f]{3}-[0-9]{2}", texts[3])
        assert outs[4].outputs[0].token_ids == alone
        results.append([o.outputs[0].token_ids for o in outs])
    assert results[0] == results[1]


def test_lora_on_the_gpu_with_and_without_graphs(model_dirs, make_llm, tmp_path):
    """Issue 42 on CUDA: the Triton shrink/expand kernels (kernels/triton_lora.py) in
    mixed batches of three adapters and the base model, through the decode graphs and
    eagerly: every token is transformers + PEFT's merged model's greedy choice, and a
    base-model batch after the adapters (graphs replayed on empty runs) is the base
    model's."""
    from peft_adapters import argmax_along, make_adapter, merged

    from pagellm import LoRARequest

    base = model_dirs["llama"]
    targets = {"qv": ["q_proj", "v_proj"], "o_down": ["o_proj", "down_proj"],
               "all": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                       "down_proj"]}
    paths = {name: make_adapter(base, tmp_path / name, t, 8, seed)
             for seed, (name, t) in enumerate(targets.items())}
    references = {None: merged(base, None)} | {n: merged(base, p) for n, p in paths.items()}
    names = ["qv", None, "o_down", "all", None, "qv", "all"]
    requests = [None if n is None else LoRARequest(n, list(paths).index(n) + 1, str(paths[n]))
                for n in names]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    for enforce_eager in (False, True):
        llm = make_llm(base, device="cuda", dtype="float32", kv_cache_memory_bytes=64 * 2**20,
                       enable_lora=True, max_loras=3, max_lora_rank=8,
                       enforce_eager=enforce_eager)
        runner = llm.engine_core.core.executor.runner
        assert (runner.graphs is None) == enforce_eager and runner.lora.batch.kernels
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
        for batch in (names, [None] * len(names)):
            outputs = llm.generate(prompts, params, use_tqdm=False,
                                   lora_request=requests if batch is names else None)
            for out, name in zip(outputs, batch, strict=True):
                ours = out.outputs[0].token_ids
                assert argmax_along(references[name], out.prompt_token_ids, ours) == ours, \
                    (name, enforce_eager)


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v2", "glm4_moe", "olmo3",
                                  "minimax_m2", "glm4", "cohere2", "exaone4", "lfm2",
                                  pytest.param("qwen3_5", marks=qwen3_5_reference),
                                  "qwen3_next", "granitemoehybrid"])
def test_newer_families_on_the_gpu_match_transformers(name, make_llm, tmp_path):
    """DeepSeek's latent attention on CUDA (its one 48-wide latent head: "auto" takes
    torch's attention ops, eager), GLM-4.5's GQA heads on the Triton kernels in CUDA
    graphs, both with the fused MoE kernel under DeepSeek's float32 routing weights and
    the fused rotary and norms; OLMo 3's sliding and full layers (its fp32-scaled norms
    as torch ops), MiniMax-M2's all-head q/k norms and partial rotary, GLM-4-0414's
    interleaved rotary pairs and sandwich norms and Command A's parallel blocks (its
    LayerNorms as torch ops) and NoPE full layers, and EXAONE 4's post-norm layers on
    the Triton kernels, and LFM2's short convolutions, Qwen3.5's and Qwen3-Next's
    linear attention and Granite 4.0-H's Mamba-2 layers (their states, one row per
    request, on the device; steps eager: no CUDA graphs for them yet): fp32 greedy
    tokens equal transformers' on the CPU."""
    from family_specs import FAMILY_SPECS
    from transformers import AutoModelForCausalLM

    from pagellm.demo.model import make_model

    directory = make_model(tmp_path / name, FAMILY_SPECS[name])
    llm = make_llm(directory, device="cuda", dtype="float32",
                   kv_cache_memory_bytes=64 * 2**20)
    runner = llm.engine_core.core.executor.runner
    assert runner.attention.name == ("torch" if name.startswith("deepseek") else "triton")
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    for output in llm.generate(PROMPTS, GREEDY, use_tqdm=False):
        ids = output.prompt_token_ids
        with torch.no_grad():
            expected = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=32,
                                   attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        assert output.outputs[0].token_ids == expected[0, len(ids):].tolist()
