"""executor/worker/extension.py: worker extensions built the way vLLM builds them, with
its keywords (verl's `__new__(cls, **kwargs)` reading `vllm_config`, an `__init__`
calling super), and OpenRLHF's `update_weight(name, torch.bfloat16, torch.Size, ...)`
whose dtype and shape cross collective_rpc as a torch.dtype and a torch.Size, both ways.
Engines run in their own process (and, at tensor_parallel_size=2, the workers in theirs).
References: the EngineArgs given and the model's config.json; the engine's own tokens
without an extension; a tensor built here. The extensions are
tests/support/vllm_style_extensions.py."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conftest import assert_no_leaks
from helpers import SUPPORT
from rl_helpers import greedy

from pagellm import LLM

# Our code and torch alone: the floors leg skips it (.ci/run).
pytestmark = pytest.mark.own_code

KV = 8 * 2**20
MAX_MODEL_LEN = 192


@pytest.mark.parametrize(("tp", "multiprocess"), [
    (1, True),  # the worker in the engine core's process, itself a child
    pytest.param(2, False, marks=pytest.mark.slow),  # each rank in a worker process
])
def test_a_verl_style_extension_is_built_with_vllms_keywords(model_dirs, monkeypatch, tp,
                                                              multiprocess):
    """Its __new__ sees a vllm_config describing this engine before the worker starts;
    its __init__ gets vLLM's keywords and, through super(), starts a worker that serves
    the same tokens as one without the extension."""
    monkeypatch.setenv("PYTHONPATH", str(SUPPORT))  # the engine's processes import it
    model_dir = model_dirs["qwen3"]
    # The reference's engine core runs in this process (no process of its own to start):
    # where the core runs changes none of its tokens.
    with LLM(str(model_dir), kv_cache_memory_bytes=KV, max_model_len=MAX_MODEL_LEN,
             dtype="float32", tensor_parallel_size=tp, multiprocess=False) as plain:
        reference = greedy(plain)
    with LLM(str(model_dir), worker_extension_cls="vllm_style_extensions.VerlStyle",
             kv_cache_memory_bytes=KV, max_model_len=MAX_MODEL_LEN, dtype="float32",
             tensor_parallel_size=tp, multiprocess=multiprocess) as llm:
        seen = llm.collective_rpc("construction")
        assert len(seen) == tp
        for rank, construction in enumerate(seen):
            assert construction["new"] == {
                "kwargs": ["distributed_init_method", "is_driver_worker", "local_rank", "rank",
                           "vllm_config"],
                "model": str(model_dir), "dtype": torch.float32,
                "max_model_len": MAX_MODEL_LEN, "tensor_parallel_size": tp,
                "world_size": tp, "parallel_rank": rank, "quant_config": None,
                "worker_started": False}
            assert construction["init"] == {"rank": rank, "local_rank": rank,
                                             "is_driver_worker": rank == 0,
                                             "distributed_init_method": None}
            assert construction["rank"] == rank
            assert construction["model_config_dtype"] is torch.float32
            assert construction["runner_config_is_the_workers"] is True
            assert construction["runner_model_dtype"] is torch.float32
            assert construction["speculative_config"] is None
        assert greedy(llm) == reference
        assert_no_leaks(llm)


def test_an_openrlhf_style_update_weight_gets_a_dtype_and_a_size(model_dirs, monkeypatch):
    """OpenRLHF's call, `collective_rpc("update_weight", args=(name, dtype, shape,
    empty_cache))`: the dtype arrives as a torch.dtype equal to the model's and the shape
    as a torch.Size (or a list) that torch.full takes; values come back with their types.
    A dtype other than the model's fails the extension's own check."""
    monkeypatch.setenv("PYTHONPATH", str(SUPPORT))
    model_dir = model_dirs["llama"]
    config = json.loads((model_dir / "config.json").read_text())
    embed_shape = torch.Size([config["vocab_size"], config["hidden_size"]])
    with LLM(str(model_dir), worker_extension_cls="vllm_style_extensions.OpenRLHFStyle",
             kv_cache_memory_bytes=KV, dtype="bfloat16") as llm:
        [echoed] = llm.collective_rpc("echo_types", args=(torch.bfloat16, torch.Size([2, 3])))
        assert echoed == {"dtype": torch.bfloat16, "shape": torch.Size([2, 3]),
                          "pair": [torch.bfloat16, torch.Size([2, 3])],
                          "arrived_as": ["dtype", "Size"]}
        assert type(echoed["dtype"]) is torch.dtype and type(echoed["shape"]) is torch.Size
        name = "model.embed_tokens.weight"
        for shape in (embed_shape, list(embed_shape)):
            assert llm.collective_rpc("update_weight", args=(
                name, torch.bfloat16, shape, False)) == [[name]]
        [rows] = llm.collective_rpc("embedding_rows", args=([0, 7],))
        assert torch.equal(rows, torch.full((2, config["hidden_size"]), 0.5,
                                            dtype=torch.bfloat16))
        with pytest.raises(RuntimeError, match=r"mismatch dtype: src torch\.float16, "
                                               r"dst torch\.bfloat16"):
            llm.collective_rpc("update_weight", args=(name, torch.float16, embed_shape))
        assert_no_leaks(llm)


REFUSED = {
    "ForgetsSuper": r"its __init__ did not start the worker \(call super\(\)\.__init__",
    "ReturnsSomethingElse": r"its __new__ returned 'object', not the worker",
}


def test_an_extension_whose_construction_ends_in_no_worker_is_refused_by_name(
        model_dirs, monkeypatch):
    """Each refused in its engine core's process, the error carried to the frontend.
    The engines start together (each in a process of its own: most of a start is that
    process importing torch, and the cores are shared)."""
    monkeypatch.setenv("PYTHONPATH", str(SUPPORT))

    def construct(name: str) -> None:
        llm = LLM(str(model_dirs["llama"]),
                  worker_extension_cls=f"vllm_style_extensions.{name}",
                  kv_cache_memory_bytes=KV)
        llm.shutdown()  # it was not refused: pytest.raises below fails

    with ThreadPoolExecutor(len(REFUSED)) as pool:
        attempts = {name: pool.submit(construct, name) for name in REFUSED}
    for name, why in REFUSED.items():
        with pytest.raises(ValueError, match=rf"'vllm_style_extensions\.{name}': {why}"):
            attempts[name].result()


def test_an_init_that_cannot_take_vllms_keywords_is_refused_before_any_worker_starts():
    from pagellm.executor.worker.extension import worker_class

    with pytest.raises(ValueError, match=r"'vllm_style_extensions\.TakesItsOwnArguments' has "
                                         r"an __init__ that cannot take vLLM's worker "
                                         r"keywords \(missing a required argument: "
                                         r"'config'\): it must be a mixin"):
        worker_class("vllm_style_extensions.TakesItsOwnArguments")
    assert worker_class("vllm_style_extensions.ReturnsSomethingElse")  # its signature is fine
