"""A step that fails (issue 12): an exception inside the step fails that step's
requests alone (executor/worker/worker.py raises StepFailed; enginecore/core.py fails
the requests and keeps the blocks computed in that step out of the prefix cache), and
the engine serves the next ones; a device fault (executor's is_device_fault) is not a
StepFailed: it ends the engine. References: transformers' greedy tokens for the next
requests, and every KV block free again."""

from __future__ import annotations

import pytest
from conftest import PROMPTS, assert_no_leaks
from helpers import request

from pagellm import SamplingParams


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(model_dirs, make_llm,
                                                                hf_reference, monkeypatch):
    """The safety net under validation: an exception inside the step fails the step's
    requests (an error output each) and the engine serves the next ones correctly;
    blocks computed in the failed step are not reused from the prefix cache."""
    from pagellm.executor.worker.input_batch import InputBatch

    llm = make_llm(model_dirs["llama"])
    real = InputBatch._set_sampling

    def poisoned(self, row, params, eos_token_id):
        if params.min_p == 0.125:  # the marked request
            raise IndexError("injected bad value")
        return real(self, row, params, eos_token_id)

    monkeypatch.setattr(InputBatch, "_set_sampling", poisoned)
    prompt = PROMPTS[4]  # long: its prompt blocks are registered in the failed step
    with pytest.raises(ValueError, match="the engine step failed: IndexError: injected"):
        llm.generate(prompt, SamplingParams(min_p=0.125, max_tokens=5), use_tqdm=False)
    assert_no_leaks(llm)
    out = llm.generate([prompt, PROMPTS[1]], SamplingParams(temperature=0, max_tokens=10),
                       use_tqdm=False)
    for text, o in zip([prompt, PROMPTS[1]], out, strict=True):
        assert o.outputs[0].token_ids == hf_reference("llama", llm.tokenizer.encode(text), 10)


def test_device_faults_are_fatal_and_other_failures_are_not(model_dirs, make_llm,
                                                           monkeypatch):
    import torch

    from pagellm.executor.executor import StepFailed, is_device_fault

    assert is_device_fault(RuntimeError("CUDA error: an illegal memory access was "
                                        "encountered"))
    assert not is_device_fault(torch.cuda.OutOfMemoryError("CUDA out of memory"))
    assert not is_device_fault(ValueError("bad"))
    llm = make_llm(model_dirs["llama"])
    core = llm.engine_core.core
    runner = core.executor.runner

    def fault(_):
        raise RuntimeError("CUDA error: device-side assert triggered")

    monkeypatch.setattr(runner, "execute_model", fault)
    core.add_request(request("x", [1, 2, 3]))
    with pytest.raises(RuntimeError, match="device-side assert") as info:
        core.step()
    assert not isinstance(info.value, StepFailed)
    monkeypatch.undo()
    core.abort_requests(["x"])
    core.step()
