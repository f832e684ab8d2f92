"""executor/worker/memory.py: sleep and wake. Level 1 offloads the weights (to one host
buffer of exactly their bytes) and frees the KV cache; level 2 discards the weights
too, so requests are refused until every checkpoint tensor has been loaded again;
asleep, requests fail naming the state. The memory goes back to the system, fifty
cycles leak nothing, and the packed bf16 copies of the weights (executor/model/
linear.py) follow every change. References: the engine's own tokens before sleeping,
transformers on pushed weights, a fresh engine on the same weights, and the engine
process's RSS measured from outside."""

from __future__ import annotations

import dataclasses
import itertools
import time

import pytest
import torch
from conftest import assert_no_leaks
from helpers import SUPPORT
from rl_helpers import (
    GREEDY,
    PROMPTS,
    checkpoint,
    greedy,
    hf_greedy,
    hf_model,
    leftover_buffers,
    parameter_count,
    perturbed,
    rss,
)

from pagellm import LLM, SamplingParams
from pagellm.executor.model.loader import safetensors_files

# Our code and torch alone: the floors leg skips it (.ci/run).
pytestmark = pytest.mark.own_code


def test_level_1_wakes_to_the_same_tokens_and_level_2_to_the_pushed_weights(model_dirs):
    model_dir = model_dirs["qwen2"]
    with LLM(str(model_dir), enable_sleep_mode=True, weight_transfer_config={"backend": "ipc"},
             kv_cache_memory_bytes=8 * 2**20) as llm:
        before = greedy(llm)
        llm.sleep(level=1)
        assert llm.is_sleeping()
        assert llm.wake_up() is True and not llm.is_sleeping()
        assert greedy(llm) == before
        llm.sleep(level=2)
        assert llm.wake_up(tags=["weights"]) is False  # the KV cache still sleeps
        assert llm.is_sleeping()
        new = perturbed(model_dir, seed=3)
        llm.update_weights(new.items())
        assert llm.wake_up(tags=["kv_cache"]) is True
        reference = hf_model(model_dir, new)
        out = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in out] == [
            hf_greedy(reference, o.prompt_token_ids, 10) for o in out]
        assert_no_leaks(llm)


def test_a_level_2_wake_refuses_requests_until_every_weight_is_loaded(model_dirs):
    """Issue 37, item 7: woken from level 2 with no weights loaded, the engine served
    garbage. Requests are refused (naming the state) while any checkpoint tensor has not
    been loaded since, a partial update included; the full update serves transformers'
    tokens on the new weights."""
    model_dir = model_dirs["llama"]
    new = perturbed(model_dir, seed=5)
    names = sorted(new)
    with LLM(str(model_dir), enable_sleep_mode=True, weight_transfer_config={"backend": "ipc"},
             kv_cache_memory_bytes=8 * 2**20) as llm:
        greedy(llm)
        llm.sleep(level=2)
        assert llm.wake_up() is True and not llm.is_sleeping()
        with pytest.raises(ValueError, match=rf"discarded by sleep\(level=2\) and "
                                             rf"{len(names)} of {len(names)} checkpoint"):
            llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
        half = names[: len(names) // 2]
        llm.update_weights([(n, new[n]) for n in half])
        with pytest.raises(ValueError, match=rf"{len(names) - len(half)} of {len(names)} "
                                             "checkpoint tensors have not been loaded"):
            llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
        llm.update_weights([(n, new[n]) for n in names[len(half):]])
        reference = hf_model(model_dir, new)
        out = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in out] == [
            hf_greedy(reference, o.prompt_token_ids, 10) for o in out]
        assert_no_leaks(llm)


def test_an_in_process_models_own_load_weights_after_a_level_2_wake_serves_again(
        model_dirs):
    """vLLM's in-process path (VLLM_ENABLE_V1_MULTIPROCESSING=0: multiprocess=False):
    woken from level 2, a script loads the weights straight into the model
    (`llm_engine...model_runner.model.load_weights`, as TRL's colocate mode does), which
    no utility call sees; the next request counts them again and is served the new
    weights' tokens, where it was refused as if nothing had been loaded."""
    model_dir = model_dirs["llama"]
    new = perturbed(model_dir, seed=6)
    with LLM(str(model_dir), enable_sleep_mode=True, multiprocess=False,
             kv_cache_memory_bytes=8 * 2**20) as llm:
        llm.sleep(level=2)
        llm.wake_up()
        model = llm.llm_engine.model_executor.driver_worker.model_runner.model
        model.load_weights(list(new.items()))
        out = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        reference = hf_model(model_dir, new)
        assert [o.outputs[0].token_ids for o in out] == [
            hf_greedy(reference, o.prompt_token_ids, 10) for o in out]
        assert_no_leaks(llm)


def test_asleep_requests_fail_naming_the_state_and_waking_twice_is_harmless(model_dirs):
    with LLM(str(model_dirs["llama"]), enable_sleep_mode=True,
             kv_cache_memory_bytes=8 * 2**20) as llm:
        before = greedy(llm)
        llm.sleep(level=1)
        llm.sleep(level=1)  # twice: a no-op (frameworks call worker-level sleep directly)
        with pytest.raises(ValueError, match=r"sleeping \(level 1.*wake_up\(\)"):
            llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
        with pytest.raises(RuntimeError, match="call wake_up"):
            llm.resume_generation()
        assert llm.wake_up(["kv_cache"]) is False
        assert llm.wake_up(["kv_cache"]) is False  # already awake: nothing changes
        assert llm.wake_up(["weights"]) is True
        assert llm.wake_up() is True
        assert greedy(llm) == before
        llm.sleep(level=0)  # scheduling only
        assert llm.is_sleeping() and llm.is_paused()
        assert llm.wake_up(["scheduling"]) is True
        assert greedy(llm) == before
        assert_no_leaks(llm)


def test_sleep_levels_need_enable_sleep_mode_and_bad_arguments_name_the_call(model_dirs):
    with LLM(str(model_dirs["llama"]), kv_cache_memory_bytes=8 * 2**20,
             multiprocess=False) as llm:
        with pytest.raises(RuntimeError, match="enable_sleep_mode=True"):
            llm.sleep(level=1)
        assert not llm.is_sleeping()
        with pytest.raises(RuntimeError, match="bad arguments for sleep"):
            llm.sleep(level=3)
        with pytest.raises(RuntimeError, match="bad arguments for wake_up"):
            llm.wake_up(tags=["everything"])
        with pytest.raises(RuntimeError, match="bad arguments for pause"):
            llm.pause_generation(mode="later")
        assert greedy(llm, PROMPTS[:1])


def test_the_weight_backup_is_one_buffer_of_exactly_the_weights_bytes():
    """A level-1 backup on CUDA is one host buffer, pinned as a whole (torch's pinned
    allocator would round each parameter up to a power of two): every parameter has an
    aligned view of its own in it, none overlapping, and the buffer is no larger than
    their bytes plus alignment."""
    from pagellm.executor.worker.memory import host_views
    from pagellm.weights.shm import ALIGN

    params = [(f"p{i}", torch.nn.Parameter(torch.randn(*shape).to(dtype)))
              for i, (shape, dtype) in enumerate([((3, 5), torch.float32),
                                                  ((7,), torch.bfloat16),
                                                  ((0, 4), torch.float16),
                                                  ((33, 3), torch.float32)])]
    buffer, views = host_views(params)
    nbytes = [p.numel() * p.element_size() for _, p in params]
    assert sum(nbytes) <= buffer.numel() < sum(nbytes) + len(params) * ALIGN
    spans = []
    for (name, p), size in zip(params, nbytes, strict=True):
        view = views[name]
        assert view.shape == p.shape and view.dtype == p.dtype
        start = view.data_ptr() - buffer.data_ptr()
        assert start % ALIGN == 0 and start + size <= buffer.numel()
        spans.append((start, start + size))
        view.copy_(p.data)
    spans.sort()
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    for name, p in params:
        assert torch.equal(views[name], p.data)


def test_sleeping_gives_the_memory_back_to_the_system(big_config):
    """RSS of the engine process, measured from outside: level 1 frees the KV cache
    (the part that was written), level 2 also the ~80 MB of weights."""
    with LLM(str(big_config), load_format="dummy", skip_tokenizer_init=True,
             enable_sleep_mode=True, kv_cache_memory_bytes=64 * 2**20, max_model_len=1024,
             max_num_batched_tokens=4096) as llm:
        bytes_per_token = 4 * 2 * 2 * 64 * 4  # layers x K|V x kv_heads x head_dim x fp32
        # Write ~45 MiB of KV: 11 distinct prompts of 1000 tokens (freed blocks go to the
        # back of the free queue, so each prompt writes blocks no other one wrote).
        prompts = [{"prompt_token_ids": [(7 * i + j) % 8000 + 1 for j in range(1000)]}
                   for i in range(11)]
        llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
        written = 11 * 1000 * bytes_per_token
        weights = parameter_count(big_config) * 4  # fp32
        time.sleep(0.2)
        awake = rss(llm)
        llm.sleep(level=1)
        level1 = rss(llm)
        assert awake - level1 > 0.8 * written, (awake, level1, written)
        llm.wake_up()
        llm.sleep(level=2)
        level2 = rss(llm)
        assert awake - level2 > 0.8 * (written + weights), (awake, level2, written + weights)
        assert llm.wake_up() is True  # fresh, unwritten memory: the RSS grows as it is used


@pytest.mark.slow
def test_fifty_cycles_of_sleep_update_wake_leak_nothing(model_dirs):
    model_dir = model_dirs["llama"]
    weights = [perturbed(model_dir, seed=s) for s in range(2)]
    with LLM(str(model_dir), enable_sleep_mode=True, weight_transfer_config={"backend": "ipc"},
             kv_cache_memory_bytes=8 * 2**20) as llm:
        results = []
        for cycle in range(50):
            results.append(greedy(llm, PROMPTS[:2]))
            llm.sleep(level=2 if cycle % 2 else 1)
            llm.wake_up(["weights"])
            llm.update_weights(weights[cycle % 2].items())
            assert llm.wake_up() is True
            if cycle == 4:
                baseline = rss(llm)
            assert_no_leaks(llm)
        assert rss(llm) - baseline < 16 * 2**20  # no growth cycle over cycle
        # Same weights, same tokens, whichever path (level 1 or 2) led there.
        assert all(r == results[1] for r in results[1::2])
        assert all(r == results[2] for r in results[2::2])
        assert not leftover_buffers()


def test_packed_bf16_weights_follow_extension_writes_sleep_and_updates(model_dirs, tmp_path,
                                                                        monkeypatch):
    """On CPUs with AMX a bf16 engine multiplies oneDNN's packed copies of its weights
    (cpu_linear); every way the weights change must reach those copies: an extension
    writing through `.data` (no version counter sees it), a level-2 sleep refilled by an
    update, an update. Forced on any CPU here, with the engine in this process. The
    reference for each set of weights is a fresh packed engine started from them: the
    same code on the same weights gives the same tokens and the same logprobs."""
    import shutil

    from safetensors.torch import save_file

    from pagellm.executor.model import linear as cpu_linear

    if cpu_linear.REORDER_WEIGHT is None:
        pytest.skip("this torch has no oneDNN packed weights")
    monkeypatch.setattr(cpu_linear, "THIS_CPU",
                        dataclasses.replace(cpu_linear.THIS_CPU, packed_bf16=True))
    monkeypatch.setenv("PYTHONPATH", str(SUPPORT))
    model_dir = model_dirs["llama"]
    old, new = checkpoint(model_dir), perturbed(model_dir, seed=5)
    new_dir = tmp_path / "new"
    shutil.copytree(model_dir, new_dir)
    for f in safetensors_files(new_dir):
        f.unlink()
    save_file(new, new_dir / "model.safetensors")
    params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=0)
    common = dict(dtype="bfloat16", kv_cache_memory_bytes=8 * 2**20, multiprocess=False)

    def run(llm: LLM) -> list[tuple[list[int], float | None]]:
        llm.reset_prefix_cache()  # the same computation as a fresh engine's
        return [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob)
                for o in llm.generate(PROMPTS, params, use_tqdm=False)]

    with LLM(str(new_dir), **common) as llm:
        on_new = run(llm)
    with LLM(str(model_dir), worker_extension_cls="rl_extension.Probe",
             weight_transfer_config={"backend": "ipc"}, enable_sleep_mode=True,
             **common) as llm:
        assert len(cpu_linear.PACKED_WEIGHTS) > 0  # at load, before the KV cache is sized
        on_old = run(llm)
        assert on_old != on_new  # the two weight sets are told apart
        assert llm.collective_rpc("load_unseen", args=(new,)) == [len(new)]
        assert run(llm) == on_new
        llm.sleep(level=2)
        assert len(cpu_linear.PACKED_WEIGHTS) == 0  # freed with the weights
        llm.wake_up(tags=["weights"])
        llm.update_weights(old.items())
        llm.wake_up(tags=["kv_cache"])
        assert run(llm) == on_old
        llm.update_weights(new.items())
        assert run(llm) == on_new
        assert len(cpu_linear.PACKED_WEIGHTS) > 0  # packed again by the steps
        assert_no_leaks(llm)
