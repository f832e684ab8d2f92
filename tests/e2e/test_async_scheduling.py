"""Asynchronous scheduling (issue 45): with `async_scheduling=True` the engine core
schedules step n+1 while step n runs on the executor's step thread, and takes step n's
tokens back afterwards (enginecore/core.py `EngineCore.step`; the scheduler counts the
tokens still out as `Request.num_output_placeholders`). It changes when the host learns
a token, never which token: every request gives the tokens, finish and stop reasons and
logprobs it gives without it, whatever else runs, and every block comes back (make_llm
checks). Steps whose scheduling needs the tokens in flight (proposals, grammars) and
every utility call wait for the step in flight first.

The model is the llama test shape with a small init (std 0.04), as in
test_speculative_decoding.py: seeded requests at low temperatures then sample
position-dependent features (penalties, min_tokens, bad words) often."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import PROMPTS
from token_equality import assert_same, looping_prompts, mixed_params, outputs

from pagellm import SamplingParams
from pagellm.demo.model import ModelSpec, make_model

pytestmark = pytest.mark.own_code

LOOPY = ModelSpec(arch="llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  intermediate_size=128, vocab_size=1024, init_std=0.04, seed=1)
KV = 8 * 2**20


@pytest.fixture(scope="module")
def loopy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("async") / "loopy", LOOPY)


def count_overlaps(llm: Any) -> list[int]:
    """Record, for each step the engine core submits, how many were in flight then:
    1 means it was scheduled before the step before it came back."""
    core = llm.engine_core.core
    executor = core.executor
    submit = executor.execute_model_async
    seen: list[int] = []

    def spy(scheduler_output: Any) -> Any:
        seen.append(len(core._in_flight))
        return submit(scheduler_output)

    executor.execute_model_async = spy
    return seen


def submit(llm: Any, request_id: str, prompt: str, params: SamplingParams) -> str:
    """Add a request to the in-process engine core directly; its engine-side id."""
    request = llm.input_processor.process_inputs(request_id, prompt, params
                                                 ).engine_requests[0]
    llm.engine_core.core.add_request(request)
    return str(request.request_id)


def test_every_sampling_feature_gives_the_tokens_it_gives_without(loopy, make_llm):
    """Seeds, penalties, min_tokens with stop ids, bad words, logit bias, allowed ids,
    top-k/p, min-p, n=2, logprobs and prompt logprobs: equal results, with the steps
    overlapped (most submitted while the one before was still out)."""
    params = mixed_params()
    params.append(SamplingParams(temperature=0.0, max_tokens=12, prompt_logprobs=2,
                                 logprobs=1))
    plain_llm = make_llm(loopy)
    prompts = looping_prompts(plain_llm, len(params) - 2)
    prompts += [prompts[0], {"prompt": PROMPTS[3]}]

    def run(llm: Any) -> list[Any]:
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [[(c.token_ids, c.finish_reason, c.stop_reason, c.text) for c in o.outputs]
                + [[sorted(d) for d in o.prompt_logprobs or [] if d]] for o in outs]

    llm = make_llm(loopy, async_scheduling=True)
    overlaps = count_overlaps(llm)
    assert_same(outputs(llm, prompts, params), outputs(plain_llm, prompts, params))
    assert run(llm) == run(plain_llm)
    assert max(overlaps) == 1 and sum(overlaps) > len(overlaps) // 2


def test_stop_tokens_max_tokens_and_stop_strings_end_where_they_do_without(loopy,
                                                                          make_llm):
    """A request that stops in step n had one more token computed for it in step n+1:
    it is dropped. Stop tokens taken from the plain run's own text (so they hit
    mid-text), every max_tokens from 1 to 20, and stop strings kept or not."""
    plain_llm = make_llm(loopy)
    llm = make_llm(loopy, async_scheduling=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    params = []
    for completions in outputs(plain_llm, PROMPTS[:4], greedy):
        params += [SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[t])
                   for t in completions[0][0][3:24:5]]
    params += [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
               for m in range(1, 21)]
    prompts = [PROMPTS[i % 4] for i in range(len(params))]
    plain = outputs(plain_llm, prompts, params)
    assert_same(outputs(llm, prompts, params), plain)
    assert sum(1 for c in plain if c[0][1] == "stop") >= 8
    cases = []
    for prompt, out in zip(PROMPTS[:4], plain_llm.generate(PROMPTS[:4], greedy,
                                                           use_tqdm=False), strict=True):
        text = out.outputs[0].text
        cases += [(prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                          stop=[text[i:i + 3]],
                                          include_stop_str_in_output=keep))
                  for i in range(4, len(text) - 3, 9) for keep in (False, True)]

    def texts(engine: Any) -> list[Any]:
        outs = engine.generate([p for p, _ in cases], [sp for _, sp in cases],
                               use_tqdm=False)
        return [(c.text, c.token_ids, c.finish_reason, c.stop_reason)
                for c in (o.outputs[0] for o in outs)]

    assert texts(llm) == texts(plain_llm)


def test_preemption_chunking_priorities_prefix_hits_and_aborts(loopy, make_llm):
    """A KV cache a few requests fill (preemptions while a step is out), a 24-token
    budget that splits prompts, priority scheduling, the prompts again (prefix-cache
    hits), and requests aborted while steps are in flight: the same tokens as without,
    and no block leaked."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = [p * 2 for p in PROMPTS]
    probe = make_llm(loopy, block_size=8).engine_core.core.executor.runner
    options = {"kv_cache_memory_bytes": 64 * probe.kv_cache_bytes_per_block(),
               "max_num_batched_tokens": 24, "max_model_len": 400, "block_size": 8,
               "scheduling_policy": "priority"}
    plain_llm = make_llm(loopy, **options)
    llm = make_llm(loopy, async_scheduling=True, **options)
    for _ in range(2):
        assert_same(outputs(llm, prompts, params), outputs(plain_llm, prompts, params))
    core = llm.engine_core.core
    assert core.scheduler.num_preemptions > 0
    assert core.scheduler.kv_cache_manager.prefix_cache_hits > 0
    ids = [submit(llm, f"abort-{i}", prompt, params) for i, prompt in enumerate(prompts[:4])]
    for _ in range(6):
        core.step()
    assert core._in_flight and all(i in core.scheduler.requests for i in ids)
    core.abort_requests(ids)
    while core.has_work():
        core.step()
    assert not core.scheduler.requests


def test_proposals_grammars_and_utility_calls_wait_for_the_step_in_flight(loopy,
                                                                          make_llm):
    """n-gram proposals and a JSON schema need the last token to schedule the next step:
    such steps are not overlapped, and the tokens are those of the synchronous engine.
    A utility call made while a step is out (here reset_prefix_cache and
    collective_rpc) waits for it; its outputs go out with the next step."""
    from pagellm import StructuredOutputsParams
    from pagellm.protocol.messages import UtilityMethod

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
            "prompt_lookup_min": 1, "disable_by_batch_size": 1024}
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    llm = make_llm(loopy, async_scheduling=True, speculative_config=spec)
    assert_same(outputs(llm, PROMPTS[:4], greedy),
                outputs(make_llm(loopy, speculative_config=spec), PROMPTS[:4], greedy))
    assert llm.get_stats().spec_num_accepted_tokens > 10
    schema = {"type": "array", "items": {"type": "string", "enum": ["alpha", "beta"]},
              "minItems": 3, "maxItems": 6}
    params = [greedy, SamplingParams(temperature=0.0, max_tokens=40,
                                     structured_outputs=StructuredOutputsParams(json=schema)),
              greedy]
    llm = make_llm(loopy, async_scheduling=True, worker_extension_cls="rl_extension.Probe")
    plain_llm = make_llm(loopy)
    assert_same(outputs(llm, PROMPTS[:3], params), outputs(plain_llm, PROMPTS[:3], params))
    core = llm.engine_core.core
    ids = [submit(llm, f"u-{i}", prompt, greedy) for i, prompt in enumerate(PROMPTS[:3])]
    tokens: dict[str, list[int]] = {}

    def collect(by_client: dict[int, Any]) -> None:
        for message in by_client.values():
            for out in message.all_outputs():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)

    for _ in range(4):
        collect(core.step())
    assert core._in_flight
    # (False, as in vLLM: running requests hold blocks.)
    assert core.call_utility(UtilityMethod.RESET_PREFIX_CACHE, [False, False]) is False
    assert not core._in_flight
    (checksum,) = core.call_utility(UtilityMethod.COLLECTIVE_RPC, ["weight_checksum", [], {}])
    assert isinstance(checksum, float)
    while core.has_work():
        collect(core.step())
    expected = outputs(plain_llm, PROMPTS[:3], greedy)
    assert [tokens[i] for i in ids] == [e[0][0] for e in expected]


def test_a_failed_step_fails_its_requests_alone(loopy, make_llm, monkeypatch):
    """An exception inside a step in flight fails that step's requests (an error output
    each), the step after it comes back before the runner is told which requests to
    keep, and the engine serves the next requests with their usual tokens."""
    from pagellm.executor.worker.input_batch import InputBatch

    llm = make_llm(loopy, async_scheduling=True)
    real = InputBatch._set_sampling

    def poisoned(self: Any, row: int, params: Any, eos_token_id: Any) -> Any:
        if params.min_p == 0.125:  # the marked request
            raise IndexError("injected bad value")
        return real(self, row, params, eos_token_id)

    monkeypatch.setattr(InputBatch, "_set_sampling", poisoned)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    core = llm.engine_core.core
    for i, prompt in enumerate(PROMPTS[:2]):  # running when the bad one arrives
        submit(llm, f"ok-{i}", prompt, greedy)
    core.step()
    bad = submit(llm, "bad", PROMPTS[2], SamplingParams(min_p=0.125, max_tokens=5))
    retained: list[int] = []  # steps in flight when the runner is told what to keep
    retain = core.executor.retain_requests
    core.executor.retain_requests = lambda ids: (retained.append(len(core._in_flight)),
                                                 retain(ids))[1]
    errors = {}
    while core.has_work():
        for message in core.step().values():
            for out in message.all_outputs():
                if out.error is not None:
                    errors[out.request_id] = out.error
    assert "injected bad value" in errors[bad]
    assert not core._in_flight and not core.scheduler.requests
    assert retained and not any(retained)  # never beside a step (one call at a time)
    monkeypatch.setattr(InputBatch, "_set_sampling", real)
    assert_same(outputs(llm, PROMPTS[:4], greedy), outputs(make_llm(loopy), PROMPTS[:4],
                                                            greedy))


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2, "multiprocess": False},
                                    {"data_parallel_size": 2}], ids=["tp2", "dp2"])
def test_tensor_and_data_parallel(loopy, layout):
    """Two tensor-parallel workers in their processes (the step thread talks to them
    while the engine core schedules), and two data-parallel engine cores in theirs (each
    busy loop steps while its step is out): the tokens of one synchronous in-process
    engine."""
    from pagellm import LLM

    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.5, seed=7, max_tokens=24, logprobs=2)] * 2
    with LLM(str(loopy), kv_cache_memory_bytes=KV, async_scheduling=True, **layout) as llm:
        got = outputs(llm, PROMPTS[:4], params)
    with LLM(str(loopy), kv_cache_memory_bytes=KV, multiprocess=False) as llm:
        assert_same(got, outputs(llm, PROMPTS[:4], params))


def test_lora_adapters_sleep_and_weight_updates_between_rounds(loopy, make_llm, tmp_path):
    """An RL round with adapters: requests of two LoRA adapters (loaded when their first
    request arrives, which waits for the step in flight) and of the base model, then
    sleep, wake and a weight update (the model's down projections scaled), then the same
    requests again: the synchronous engine's tokens in both rounds, and the update
    changed them."""
    from peft_adapters import make_adapter
    from safetensors.torch import load_file

    from pagellm import LoRARequest
    from pagellm.executor.model.loader import safetensors_files

    adapters = [LoRARequest(name, i + 1, str(make_adapter(loopy, tmp_path / name, targets,
                                                          8, seed=i + 3)))
                for i, (name, targets) in enumerate([("qv", ["q_proj", "v_proj"]),
                                                     ("mlp", ["gate_proj", "down_proj"])])]
    weights = {}
    for file in safetensors_files(loopy):
        weights.update(load_file(str(file)))
    updated = {k: v * 1.5 for k, v in weights.items() if "down_proj" in k}
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    options = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8,
               "enable_sleep_mode": True, "weight_transfer_config": {"backend": "ipc"}}

    def rounds(llm: Any) -> list[list[list[int]]]:
        results = []
        for _ in range(2):
            outs = llm.generate(PROMPTS[:6], greedy, use_tqdm=False,
                                lora_request=[adapters[0], adapters[1], None] * 2)
            results.append([o.outputs[0].token_ids for o in outs])
            llm.sleep(level=1)
            llm.wake_up()
            assert llm.update_weights(updated.items()) == len(updated)
        return results

    got = rounds(make_llm(loopy, async_scheduling=True, **options))
    assert got == rounds(make_llm(loopy, **options))
    assert got[0] != got[1]
