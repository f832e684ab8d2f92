"""The fused CPU decode step (executor/worker/cpu_decode.py) end to end: an engine whose
decode steps run in one C++ call gives what the same engine gives through the
decoder's torch ops (`PAGELLM_CPU_DECODE=0`), with every sampling feature, n > 1,
prompt logprobs, preemption and asynchronous scheduling in play, and leaks no block
(make_llm checks). Greedy equality with transformers runs through it already
(test_correctness.py: fp32 on the CPU is the fused step's case)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import PROMPTS
from token_equality import assert_same, looping_prompts, mixed_params, outputs

from pagellm import SamplingParams
from pagellm.demo.model import ModelSpec, make_model
from pagellm.executor.worker.cpu_decode import DENSE_ROWS

pytestmark = pytest.mark.own_code

# Small init (as test_async_scheduling.py's): low-temperature seeded requests sample
# the position-dependent features often. Qwen2 has qkv biases and one KV head.
SPECS = {"llama": ModelSpec(arch="llama", hidden_size=64, num_layers=2, num_heads=4,
                            num_kv_heads=2, intermediate_size=128, vocab_size=1024,
                            init_std=0.04, seed=1),
         "qwen3": ModelSpec(arch="qwen3", hidden_size=64, num_layers=2, num_heads=4,
                            num_kv_heads=2, head_dim=32, intermediate_size=128,
                            vocab_size=1024, init_std=0.04, seed=3)}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fused")
    return {name: make_model(root / name, spec) for name, spec in SPECS.items()}


def torch_ops(make_llm: Any, monkeypatch: pytest.MonkeyPatch, model: Path,
              **kwargs: Any) -> Any:
    """An engine whose decode steps take the decoder's torch ops."""
    with monkeypatch.context() as m:
        m.setenv("PAGELLM_CPU_DECODE", "0")
        llm = make_llm(model, **kwargs)
    assert llm.engine_core.core.executor.runner.cpu_decode is None
    return llm


@pytest.mark.parametrize("name", list(SPECS))
def test_every_sampling_feature_gives_what_the_torch_ops_give(models, make_llm, monkeypatch,
                                                            name):
    """Seeds, penalties, min_tokens with stop ids, bad words, logit bias, allowed ids,
    top-k/p, min-p, n=2, logprobs (within 1e-4) and prompt logprobs. At most 4
    sequences a step: every decode step of a dense model is the fused step's."""
    fused = make_llm(models[name], max_num_seqs=DENSE_ROWS)
    assert fused.engine_core.core.executor.runner.cpu_decode is not None
    plain = torch_ops(make_llm, monkeypatch, models[name], max_num_seqs=DENSE_ROWS)
    params = mixed_params()
    params.append(SamplingParams(temperature=0.0, max_tokens=12, prompt_logprobs=2,
                                 logprobs=1))
    prompts = looping_prompts(plain, len(params) - 2)
    prompts += [prompts[0], {"prompt": PROMPTS[3]}]
    assert_same(outputs(fused, prompts, params), outputs(plain, prompts, params))


def test_preemption_and_async_scheduling_change_nothing(models, make_llm, monkeypatch):
    """A KV cache too small for the batch (requests preempted and recomputed) and
    steps scheduled ahead: the same greedy tokens and logprobs as the torch ops."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)
    prompts = PROMPTS[:8]
    probe = make_llm(models["llama"], block_size=8)
    per_block = probe.engine_core.core.executor.runner.kv_cache_bytes_per_block()
    tight = {"kv_cache_memory_bytes": 32 * per_block, "block_size": 8, "max_model_len": 256}
    plain = torch_ops(make_llm, monkeypatch, models["llama"], **tight)
    expected = outputs(plain, prompts, params)
    fused = make_llm(models["llama"], async_scheduling=True, **tight)
    assert_same(outputs(fused, prompts, params), expected)
    assert fused.get_stats().num_preemptions > 0
