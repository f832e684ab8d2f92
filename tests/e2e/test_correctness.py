"""Greedy output equals transformers' token for token (fp32, CPU), however the engine
batches: all at once, staggered arrivals, or under preemption."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import PROMPTS, runs_triton_kernels

from pagellm import SamplingParams
from pagellm.executor.worker.cpu_decode import DENSE_ROWS
from pagellm.protocol.messages import EngineCoreOutput

MAX_TOKENS = 40


def _references(llm, name, hf_reference, prompts=PROMPTS, max_tokens=MAX_TOKENS):
    ids = [llm.tokenizer.encode(p) for p in prompts]
    return ids, [hf_reference(name, p, max_tokens) for p in ids]


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_greedy_matches_transformers(name, model_dirs, hf_reference, make_llm):
    llm = make_llm(model_dirs[name])
    prompt_ids, expected = _references(llm, name, hf_reference)
    assert len({len(p) for p in prompt_ids}) >= 8  # prompts of many different lengths
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                           use_tqdm=False)
    for prompt, ids, output, reference in zip(PROMPTS, prompt_ids, outputs, expected,
                                              strict=True):
        assert output.prompt == prompt and output.prompt_token_ids == ids
        assert output.outputs[0].token_ids == reference, prompt
    # The comparison means something only if the model's paths are varied.
    assert sum(len(set(r)) for r in expected) > 4 * len(expected)


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_greedy_matches_with_staggered_arrivals(name, model_dirs, hf_reference, make_llm):
    """New requests join while others are mid-decode (continuous batching), in a step
    budget small enough that long prompts are split across steps."""
    llm = make_llm(model_dirs[name], max_num_batched_tokens=48)
    prompt_ids, expected = _references(llm, name, hf_reference)
    core = llm.engine_core.core
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    got: dict[str, list[int]] = {}
    names: dict[str, str] = {}  # engine request id -> "r<i>"
    pending = list(enumerate(prompt_ids))
    step = 0
    mixed_steps = 0
    while pending or core.has_work():
        if pending and step % 3 == 0:  # one new request every third step
            i, ids = pending.pop(0)
            request = llm.input_processor.process_inputs(f"r{i}", {"prompt_token_ids": ids},
                                                   params).engine_requests[0]
            names[request.request_id] = f"r{i}"
            core.add_request(request)
        if core.scheduler.num_running and core.scheduler.num_waiting:
            mixed_steps += 1
        outputs: list[EngineCoreOutput] = [o for by_client in core.step().values()
                                           for o in by_client.all_outputs()]
        for out in outputs:
            got.setdefault(names[out.request_id], []).extend(out.new_token_ids)
        step += 1
    assert mixed_steps > 0
    for i, reference in enumerate(expected):
        assert got[f"r{i}"] == reference, PROMPTS[i]


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_greedy_matches_under_preemption(name, model_dirs, hf_reference, make_llm):
    """A KV cache far too small for all requests at once: requests are preempted,
    recomputed later, and still produce exactly transformers' tokens."""
    probe = make_llm(model_dirs[name])
    bytes_per_block = probe.engine_core.core.executor.runner.kv_cache_bytes_per_block()
    # 24 blocks of 16 tokens: enough for any single request here, not for all of them.
    llm = make_llm(model_dirs[name], kv_cache_memory_bytes=24 * bytes_per_block,
                   max_model_len=384)
    assert llm.info.num_kv_blocks == 24
    _, expected = _references(llm, name, hf_reference)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                           use_tqdm=False)
    assert llm.get_stats().num_preemptions > 0
    for output, reference in zip(outputs, expected, strict=True):
        assert output.outputs[0].token_ids == reference


@runs_triton_kernels
@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_greedy_matches_with_the_triton_kernels(name, model_dirs, hf_reference, make_llm):
    """The Triton attention path (through the interpreter on the CPU) gives exactly
    transformers' greedy tokens, over prompts, chunks and decodes."""
    llm = make_llm(model_dirs[name], attention_backend="triton", max_num_batched_tokens=24)
    prompts = PROMPTS[:3]
    _, expected = _references(llm, name, hf_reference, prompts, 8)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8),
                           use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected


@pytest.mark.parametrize("packed, fused", [(False, False), (True, False), (False, True)],
                         ids=["plain", "packed", "fused"])
def test_bf16_logprobs_track_transformers_on_the_same_weights(model_dirs, make_llm,
                                                              monkeypatch, packed, fused):
    """bf16 on the CPU, the dtype real checkpoints load in: the logprob of every prompt
    token (prefill) and every sampled token (decode) within bf16's rounding of
    transformers' fp32 on the same bf16-rounded weights. GEMMs on plain weights, or on
    packed ones (cpu_linear's path on CPUs with AMX or AVX512-BF16, forced here either
    way); six prompts at once, so that the fused decode step (executor/worker/
    cpu_decode.py) takes its more-than-4-rows GEMM, plain or packed, or (fused) at most 4
    a step, so that it takes its GEMV. Greedy tokens are not compared: bf16 rounding
    flips near-ties of random weights."""
    import torch
    from transformers import AutoModelForCausalLM

    from pagellm.executor.model import linear as cpu_linear

    if packed and cpu_linear.REORDER_WEIGHT is None:
        pytest.skip("this torch has no oneDNN packed weights")
    monkeypatch.setattr(cpu_linear, "THIS_CPU",
                        dataclasses.replace(cpu_linear.THIS_CPU, packed_bf16=packed))
    name, prompts = "qwen2", PROMPTS[1:7]
    copies = len(cpu_linear.PACKED_WEIGHTS)
    llm = make_llm(model_dirs[name], dtype="bfloat16",
                   **({"max_num_seqs": DENSE_ROWS} if fused else {}))
    assert llm.engine_core.core.executor.runner.cpu_decode is not None
    if packed:
        assert len(cpu_linear.PACKED_WEIGHTS) > copies  # made at load
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=0, prompt_logprobs=0)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(model_dirs[name], dtype=torch.float32).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.bfloat16().float())
    hf_bf16 = AutoModelForCausalLM.from_pretrained(model_dirs[name],
                                                   dtype=torch.bfloat16).eval()

    def logprobs(model, tokens: list[int]) -> torch.Tensor:  # [len(tokens) - 1] float64
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0, :-1].double()
        return logits.log_softmax(-1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]

    errors, hf_errors = [], []
    for out in outputs:
        tokens = out.prompt_token_ids + out.outputs[0].token_ids
        ours = [next(iter(pos.values())).logprob for pos in out.prompt_logprobs[1:]]
        ours += [pos[t].logprob for pos, t in zip(out.outputs[0].logprobs,
                                                   out.outputs[0].token_ids, strict=True)]
        exact = logprobs(hf, tokens)
        errors.append((torch.tensor(ours, dtype=torch.float64) - exact).abs())
        hf_errors.append((logprobs(hf_bf16, tokens) - exact).abs())
    ours_max, hf_max = float(torch.cat(errors).max()), float(torch.cat(hf_errors).max())
    ours_mean, hf_mean = float(torch.cat(errors).mean()), float(torch.cat(hf_errors).mean())
    # transformers' own bf16 is the yardstick (measured: max 0.167, mean 0.025 nats
    # here, ours the same); a wrong or stale weight is off by whole nats.
    assert ours_max <= 1.5 * hf_max and ours_mean <= 1.5 * hf_mean, \
        (ours_max, hf_max, ours_mean, hf_mean)
