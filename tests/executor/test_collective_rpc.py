"""executor/worker/extension.py: collective_rpc calls a worker extension's methods by
name on every worker, with the engine in process or in its own, as RL frameworks use it
(TRL and OpenRLHF load weights one tensor at a time through it, as with vLLM); unknown
or private methods, failures, timeouts and arguments the wire cannot carry are errors
for the caller alone. References: the checkpoint's own tensors, and transformers on the
weights pushed. The extension is tests/support/rl_extension.py."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_no_leaks
from helpers import SUPPORT
from rl_helpers import GREEDY, PROMPTS, checkpoint, greedy, hf_greedy, hf_model, perturbed

from pagellm import LLM


@pytest.mark.parametrize("multiprocess", [False, True])
def test_collective_rpc_calls_extension_methods_by_name(model_dirs, monkeypatch,
                                                        multiprocess):
    monkeypatch.setenv("PYTHONPATH", str(SUPPORT))  # the engine process imports rl_extension
    model_dir = model_dirs["llama"]
    weights = checkpoint(model_dir)
    with LLM(str(model_dir), worker_extension_cls="rl_extension.Probe",
             weight_transfer_config={"backend": "ipc"}, kv_cache_memory_bytes=8 * 2**20,
             multiprocess=multiprocess) as llm:
        [checksum] = llm.collective_rpc("weight_checksum")
        expected = float(sum(t.double().sum() for t in weights.values()))
        assert abs(checksum - expected) < 1e-6 * max(1.0, abs(expected))
        [rows] = llm.collective_rpc("embedding_rows", args=(torch.tensor([3, 5]),))
        assert torch.equal(rows, weights["model.embed_tokens.weight"][[3, 5]])
        assert llm.collective_rpc("describe", args=("x",), kwargs={"scale": 2.5}) == [
            {"prefix": "x", "scale": 2.5, "rank": 0}]
        with pytest.raises(RuntimeError, match=r"collective_rpc.*unknown method '_private'"):
            llm.collective_rpc("_private")
        with pytest.raises(RuntimeError, match="probe failed on purpose"):
            llm.collective_rpc("fail")
        # What the wire cannot carry is refused in-process too (it used to pass there).
        with pytest.raises(TypeError, match="Encoding objects of type object"):
            llm.collective_rpc("describe", args=(object(),))
        if multiprocess:  # a timeout is an error for the caller; the engine goes on
            with pytest.raises(TimeoutError, match=r"collective_rpc timed out after 0\.5 s"):
                llm.collective_rpc("nap", timeout=0.5, args=(2.0,))
        assert greedy(llm, PROMPTS[:1])
        assert_no_leaks(llm)


def test_an_extension_loads_weights_one_tensor_at_a_time_as_with_vllm(model_dirs,
                                                                    monkeypatch):
    """RL frameworks' worker extensions (TRL, OpenRLHF) call
    `self.model_runner.model.load_weights(weights=[(name, tensor)])` per tensor, as
    vLLM's models allow: every tensor pushed that way, the engine gives transformers'
    tokens on the new weights (q/k/v and gate/up land in their merged parameters). A name
    the model lacks fails the call, naming it."""
    monkeypatch.setenv("PYTHONPATH", str(SUPPORT))
    model_dir = model_dirs["qwen2"]
    weights = perturbed(model_dir, seed=11)
    with LLM(str(model_dir), worker_extension_cls="rl_extension.Probe",
             kv_cache_memory_bytes=8 * 2**20) as llm:
        greedy(llm)  # fills the prefix cache with the old weights' KV
        for name, tensor in weights.items():
            assert llm.collective_rpc("load_named", args=(name, tensor)) == [[name]]
        assert llm.reset_prefix_cache()
        reference = hf_model(model_dir, weights)
        out = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in out] == [
            hf_greedy(reference, o.prompt_token_ids, 10) for o in out]
        with pytest.raises(RuntimeError, match=r"no such weight in the model: "
                                               r"\['model\.nope\.weight'\]"):
            llm.collective_rpc("load_named", args=("model.nope.weight", torch.zeros(2)))
        assert_no_leaks(llm)


def test_collective_rpc_without_an_extension_and_a_bad_extension(model_dirs):
    with LLM(str(model_dirs["llama"]), kv_cache_memory_bytes=8 * 2**20,
             multiprocess=False) as llm, \
            pytest.raises(RuntimeError, match="set worker_extension_cls"):
        llm.collective_rpc("weight_checksum")
    with pytest.raises(ValueError, match="cannot be imported"):
        LLM(str(model_dirs["llama"]), worker_extension_cls="no_such_module.Class",
            kv_cache_memory_bytes=8 * 2**20, multiprocess=False)
