"""Greedy output equals transformers' token for token (fp32, CPU), however the engine
batches: all at once, staggered arrivals, or under preemption."""

from __future__ import annotations

import pytest
from conftest import PROMPTS

from pagellm import SamplingParams
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
