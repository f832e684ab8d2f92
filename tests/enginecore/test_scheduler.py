"""The token-budget scheduler, driven without a model.

`FakeModelRunner` stands in for the executor: like `executor.model_runner.ModelRunner`
it rebuilds each request's tokens and progress from the `SchedulerOutput`s alone, and a
request samples one token exactly when this step's tokens bring its computed count level
with its token count (`InputPreparer.prepare`); a partial prompt chunk samples nothing. Sampled
tokens are `next_token(last token)` unless a test scripts them (to force EOS or a stop
token), so every expected value below is computed by hand.
"""

from __future__ import annotations

import ast
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pagellm.enginecore.kv_cache_manager import KVCacheManager
from pagellm.enginecore.request import Request, RequestStatus
from pagellm.enginecore.scheduler import Scheduler, SchedulerConfig
from pagellm.protocol.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    TokenLogprobs,
)
from pagellm.protocol.sampling_params import SamplingParams
from pagellm.protocol.scheduling import ModelRunnerOutput, SchedulerOutput

# Our code and torch alone: the floors leg skips it (.ci/run).
pytestmark = pytest.mark.own_code

EOS = 1000  # outside next_token's range [0, 1000): only scripted tokens are EOS


def next_token(last: int) -> int:
    return (last * 31 + 7) % 1000


def expected_outputs(prompt: Sequence[int], num_tokens: int) -> list[int]:
    tokens = [next_token(prompt[-1])]
    while len(tokens) < num_tokens:
        tokens.append(next_token(tokens[-1]))
    return tokens


# -- factories ---------------------------------------------------------------------------


def create_scheduler(max_num_seqs: int = 16, max_num_batched_tokens: int = 64,
                     num_blocks: int = 64, block_size: int = 4) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs,
                                     max_num_batched_tokens=max_num_batched_tokens),
                     KVCacheManager(num_blocks, block_size))


def create_requests(num_requests: int, prompt_len: int | Sequence[int] = 8, *,
                    max_tokens: int | Sequence[int] = 16, min_tokens: int = 0,
                    stop_token_ids: list[int] | None = None, ignore_eos: bool = False,
                    eos_token_id: int | None = EOS, id_prefix: str = "r") -> list[Request]:
    """Requests `{id_prefix}0`, `{id_prefix}1`, ... with distinct prompts."""
    lens = [prompt_len] * num_requests if isinstance(prompt_len, int) else list(prompt_len)
    maxes = [max_tokens] * num_requests if isinstance(max_tokens, int) else list(max_tokens)
    assert len(lens) == len(maxes) == num_requests
    requests = []
    for i, (n, max_n) in enumerate(zip(lens, maxes, strict=True)):
        params = SamplingParams(temperature=0.0, max_tokens=max_n, min_tokens=min_tokens,
                                stop_token_ids=stop_token_ids, ignore_eos=ignore_eos)
        prompt = [(97 * i + 13 * j + 1) % 1000 for j in range(n)]
        requests.append(Request(f"{id_prefix}{i}", prompt, params, eos_token_id,
                                arrival_time=float(i)))
    return requests


@dataclass
class _RunnerState:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class FakeModelRunner:
    """The model runner's bookkeeping without the model (see the module docstring)."""

    block_size: int
    script: dict[str, list[int]] = field(default_factory=dict)  # req_id -> tokens to sample
    states: dict[str, _RunnerState] = field(default_factory=dict)

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in [*so.finished_req_ids, *so.preempted_req_ids]:
            self.states.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.states[new.req_id] = _RunnerState(
                new.prompt_token_ids + new.output_token_ids, list(new.block_ids),
                new.num_computed_tokens)
        for req_id, new_block_ids, num_computed in cached_of(so):
            state = self.states[req_id]
            state.block_ids.extend(new_block_ids)
            state.num_computed_tokens = num_computed
        req_ids = list(so.scheduled_cached_reqs.req_ids)
        req_ids += [n.req_id for n in so.scheduled_new_reqs]
        assert sorted(req_ids) == sorted(so.num_scheduled_tokens)
        sampled: list[int] = []
        for req_id in req_ids:
            state = self.states[req_id]
            end = state.num_computed_tokens + so.num_scheduled_tokens[req_id]
            assert end <= len(state.token_ids), "scheduled tokens that do not exist"
            assert end <= len(state.block_ids) * self.block_size, "no KV slot for a token"
            state.num_computed_tokens = end
            if end == len(state.token_ids):  # caught up: sample the next token
                script = self.script.get(req_id)
                token = script.pop(0) if script else next_token(state.token_ids[-1])
                state.token_ids.append(token)
                sampled.append(token)
            else:
                sampled.append(-1)
        return ModelRunnerOutput(req_ids, sampled)


def create_runner(scheduler: Scheduler, script: dict[str, list[int]] | None = None,
                  ) -> FakeModelRunner:
    return FakeModelRunner(scheduler.kv_cache_manager.block_size, dict(script or {}))


def step(scheduler: Scheduler, runner: FakeModelRunner,
         ) -> tuple[SchedulerOutput, dict[str, EngineCoreOutput]]:
    """schedule -> execute -> update; the step's outputs keyed by request id."""
    so = scheduler.schedule()
    outputs = flat(scheduler.update_from_output(so, runner.execute_model(so)))
    return so, {out.request_id: out for out in outputs}


def cached_of(so: SchedulerOutput) -> list[tuple[str, list[int], int]]:
    """(req_id, new block ids, num_computed_tokens) of each cached request, in order."""
    c = so.scheduled_cached_reqs
    assert set(c.new_block_ids) <= set(c.req_ids) and all(c.new_block_ids.values())
    return [(r, c.new_block_ids.get(r, []), n)
            for r, n in zip(c.req_ids, c.num_computed_tokens, strict=True)]


def flat(by_client: dict[int, EngineCoreOutputs]) -> list[EngineCoreOutput]:
    """The step's outputs, whichever clients they go to (plain tokens included)."""
    return [out for message in by_client.values() for out in message.all_outputs()]


def run_to_completion(scheduler: Scheduler, runner: FakeModelRunner,
                      max_steps: int = 1000) -> list[SchedulerOutput]:
    """Step until every request finished; then no block may still be held."""
    outputs = []
    while scheduler.has_unfinished_requests():
        assert len(outputs) < max_steps, "no progress"
        outputs.append(step(scheduler, runner)[0])
    assert_everything_free(scheduler)
    return outputs


def assert_everything_free(scheduler: Scheduler) -> None:
    kv = scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_total_blocks
    assert kv.req_to_blocks == {}
    assert scheduler.requests == {}
    assert not scheduler.waiting and not scheduler.running


def add(scheduler: Scheduler, requests: Sequence[Request]) -> None:
    for request in requests:
        scheduler.add_request(request)


# -- admission and the token budget ------------------------------------------------------


def test_scheduler_config_rejects_non_positive_limits():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=0)


def test_nothing_to_schedule_gives_an_empty_output():
    so = create_scheduler().schedule()
    assert so.is_empty
    assert so.num_scheduled_tokens == {} and so.scheduled_new_reqs == []


def test_new_prompts_are_scheduled_whole_with_fresh_blocks():
    scheduler = create_scheduler(block_size=4)
    requests = create_requests(3, [5, 4, 9])
    add(scheduler, requests)
    so = scheduler.schedule()
    assert so.num_scheduled_tokens == {"r0": 5, "r1": 4, "r2": 9}
    assert so.total_num_scheduled_tokens == 18
    assert [(n.req_id, n.block_ids, n.num_computed_tokens) for n in so.scheduled_new_reqs] == [
        ("r0", [0, 1], 0), ("r1", [2], 0), ("r2", [3, 4, 5], 0)]
    assert [n.prompt_token_ids for n in so.scheduled_new_reqs] == [
        r.prompt_token_ids for r in requests]
    assert [r.num_computed_tokens for r in requests] == [5, 4, 9]  # advanced by schedule()
    assert [r.status for r in requests] == [RequestStatus.RUNNING] * 3


def test_duplicate_request_id_is_rejected():
    scheduler = create_scheduler()
    (request,) = create_requests(1)
    scheduler.add_request(request)
    (duplicate,) = create_requests(1)
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(duplicate)
    assert list(scheduler.waiting) == [request]


def test_request_id_can_be_reused_after_the_request_finished():
    scheduler = create_scheduler()
    add(scheduler, create_requests(1, max_tokens=1))
    run_to_completion(scheduler, create_runner(scheduler))
    (again,) = create_requests(1, max_tokens=1)
    scheduler.add_request(again)
    assert scheduler.requests == {"r0": again}


def test_max_num_seqs_caps_running_requests():
    scheduler = create_scheduler(max_num_seqs=2)
    add(scheduler, create_requests(3, 4))
    so = scheduler.schedule()
    assert so.num_scheduled_tokens == {"r0": 4, "r1": 4}
    assert scheduler.num_running == 2
    assert [r.request_id for r in scheduler.waiting] == ["r2"]


def test_waiting_request_is_admitted_when_a_running_one_finishes():
    scheduler = create_scheduler(max_num_seqs=2)
    add(scheduler, create_requests(3, 4, max_tokens=[1, 3, 1]))
    runner = create_runner(scheduler)
    _, outputs = step(scheduler, runner)
    assert outputs["r0"].finish_reason == FinishReason.LENGTH
    so, _ = step(scheduler, runner)
    assert so.num_scheduled_tokens == {"r1": 1, "r2": 4}


def test_new_prompts_and_decode_tokens_share_a_step():
    scheduler = create_scheduler(max_num_batched_tokens=64)
    add(scheduler, create_requests(2, 6))
    runner = create_runner(scheduler)
    step(scheduler, runner)
    add(scheduler, create_requests(1, 10, id_prefix="late"))
    so, _ = step(scheduler, runner)
    assert so.num_scheduled_tokens == {"r0": 1, "r1": 1, "late0": 10}
    assert so.scheduled_cached_reqs.req_ids == ["r0", "r1"]
    assert [n.req_id for n in so.scheduled_new_reqs] == ["late0"]
    assert so.total_num_scheduled_tokens == 12


def test_running_requests_are_scheduled_in_admission_order():
    scheduler = create_scheduler()
    add(scheduler, create_requests(3, [9, 2, 5]))
    runner = create_runner(scheduler)
    step(scheduler, runner)
    so, _ = step(scheduler, runner)
    assert [(r, n) for r, _, n in cached_of(so)] == [("r0", 9), ("r1", 2), ("r2", 5)]


def test_decodes_are_scheduled_before_new_prompts():
    scheduler = create_scheduler(max_num_batched_tokens=8)
    add(scheduler, create_requests(2, 3))
    runner = create_runner(scheduler)
    step(scheduler, runner)
    add(scheduler, create_requests(1, 20, id_prefix="long"))
    so = scheduler.schedule()
    # The decodes take their token first; the prompt gets what is left of the budget.
    assert so.num_scheduled_tokens == {"r0": 1, "r1": 1, "long0": 6}


def test_decodes_use_the_budget_first_and_prompts_wait_when_none_is_left():
    scheduler = create_scheduler(max_num_batched_tokens=2)
    add(scheduler, create_requests(2, 1))
    runner = create_runner(scheduler)
    step(scheduler, runner)
    add(scheduler, create_requests(1, 1, id_prefix="new"))
    so, _ = step(scheduler, runner)
    assert so.num_scheduled_tokens == {"r0": 1, "r1": 1}
    assert [r.request_id for r in scheduler.waiting] == ["new0"]


def test_long_prompt_is_chunked_while_decodes_continue_every_step():
    scheduler = create_scheduler(max_num_batched_tokens=8)
    add(scheduler, create_requests(1, 4, max_tokens=10))
    runner = create_runner(scheduler)
    step(scheduler, runner)
    add(scheduler, create_requests(1, 20, id_prefix="long"))
    scheduled = [step(scheduler, runner)[0].num_scheduled_tokens for _ in range(4)]
    assert scheduled == [
        {"r0": 1, "long0": 7},  # 7 of 20
        {"r0": 1, "long0": 7},  # 14 of 20
        {"r0": 1, "long0": 6},  # 20 of 20: samples
        {"r0": 1, "long0": 1},  # its first decode
    ]


def test_partial_prompt_chunks_sample_nothing():
    scheduler = create_scheduler(max_num_batched_tokens=8)
    (request,) = create_requests(1, 20)
    scheduler.add_request(request)
    runner = create_runner(scheduler)
    progress = []
    for _ in range(3):
        so, outputs = step(scheduler, runner)
        progress.append((so.num_scheduled_tokens["r0"], request.num_computed_tokens,
                         list(request.output_token_ids), "r0" in outputs))
    first = next_token(request.prompt_token_ids[-1])
    assert progress == [(8, 8, [], False), (8, 16, [], False), (4, 20, [first], True)]


def test_chunked_prompt_continues_as_a_cached_request_with_its_progress():
    scheduler = create_scheduler(max_num_batched_tokens=8, block_size=4)
    add(scheduler, create_requests(1, 20))
    runner = create_runner(scheduler)
    first, _ = step(scheduler, runner)
    second, _ = step(scheduler, runner)
    assert [(n.req_id, n.block_ids, n.num_computed_tokens)
            for n in first.scheduled_new_reqs] == [("r0", [0, 1], 0)]
    assert second.scheduled_new_reqs == []
    assert cached_of(second) == [("r0", [2, 3], 8)]


def test_waiting_requests_are_admitted_in_arrival_order():
    scheduler = create_scheduler(max_num_batched_tokens=6)
    add(scheduler, create_requests(3, [8, 1, 1]))
    # r1 and r2 would fit whole, but r0 came first: it is split and takes the budget.
    assert scheduler.schedule().num_scheduled_tokens == {"r0": 6}
    assert [r.request_id for r in scheduler.waiting] == ["r1", "r2"]


def test_total_num_scheduled_tokens_is_the_sum_over_requests():
    scheduler = create_scheduler(max_num_batched_tokens=16)
    add(scheduler, create_requests(4, [3, 5, 7, 9]))
    so = scheduler.schedule()
    assert so.num_scheduled_tokens == {"r0": 3, "r1": 5, "r2": 7, "r3": 1}
    assert so.total_num_scheduled_tokens == 16


def test_waiting_prompt_that_does_not_fit_the_cache_waits_without_preempting():
    scheduler = create_scheduler(num_blocks=3, block_size=4)
    add(scheduler, create_requests(1, 6, max_tokens=2))
    runner = create_runner(scheduler)
    step(scheduler, runner)  # r0 holds 2 of 3 blocks, enough for its 8 tokens
    add(scheduler, create_requests(1, 8, id_prefix="big"))
    so, _ = step(scheduler, runner)
    assert so.num_scheduled_tokens == {"r0": 1}
    assert so.preempted_req_ids == [] and scheduler.num_preemptions == 0
    assert [r.request_id for r in scheduler.waiting] == ["big0"]
    so, _ = step(scheduler, runner)  # r0 finished last step and freed its blocks
    assert so.num_scheduled_tokens == {"big0": 8}


# -- preemption ----------------------------------------------------------------------------

# block_size 4, 5 blocks. r0 (8 tokens) gets blocks 0-1, r1 (4) block 2, r2 (8) blocks 3-4.
# After step 1 each sampled a token: r0 and r2 need a third block, r1 a second one.


def _full_cache_scheduler(max_tokens: int = 4,
                          ) -> tuple[Scheduler, FakeModelRunner, list[Request]]:
    scheduler = create_scheduler(max_num_seqs=3, num_blocks=5, block_size=4)
    requests = create_requests(3, [8, 4, 8], max_tokens=max_tokens)
    add(scheduler, requests)
    runner = create_runner(scheduler)
    so, _ = step(scheduler, runner)
    assert so.num_scheduled_tokens == {"r0": 8, "r1": 4, "r2": 8}
    assert scheduler.kv_cache_manager.num_free_blocks == 0
    return scheduler, runner, requests


def test_block_shortage_preempts_the_most_recently_admitted_request():
    scheduler, runner, (r0, r1, r2) = _full_cache_scheduler()
    so, _ = step(scheduler, runner)
    assert so.preempted_req_ids == ["r2"]
    assert so.num_scheduled_tokens == {"r0": 1, "r1": 1}
    # r2's blocks 3, 4 went back as [4, 3]: r0 takes 4, r1 takes 3.
    assert [(r, b) for r, b, _ in cached_of(so)] == [("r0", [4]), ("r1", [3])]
    assert scheduler.running == [r0, r1]
    assert list(scheduler.waiting) == [r2]


def test_preempted_request_restarts_from_zero_and_keeps_its_outputs():
    scheduler, runner, (_, _, r2) = _full_cache_scheduler()
    outputs_before = list(r2.output_token_ids)
    step(scheduler, runner)
    assert r2.status == RequestStatus.PREEMPTED
    assert r2.num_computed_tokens == 0
    assert r2.output_token_ids == outputs_before == expected_outputs(r2.prompt_token_ids, 1)
    assert scheduler.num_preemptions == 1
    assert scheduler.kv_cache_manager.get_block_ids("r2") == []


def test_preempted_request_goes_to_the_front_of_the_waiting_queue():
    scheduler, runner, _ = _full_cache_scheduler()
    add(scheduler, create_requests(1, 1, id_prefix="later"))
    step(scheduler, runner)
    assert [r.request_id for r in scheduler.waiting] == ["r2", "later0"]


def test_preempted_request_id_is_reported_in_one_scheduler_output_only():
    scheduler, runner, _ = _full_cache_scheduler()
    preempted = [step(scheduler, runner)[0].preempted_req_ids for _ in range(3)]
    assert preempted == [["r2"], [], []]


def test_resumed_request_is_sent_as_new_request_data_with_its_outputs():
    scheduler, runner, (_, _, r2) = _full_cache_scheduler(max_tokens=2)
    step(scheduler, runner)  # preempts r2; r0 and r1 sample their second, last token
    so = scheduler.schedule()
    assert [n.req_id for n in so.scheduled_new_reqs] == ["r2"]
    (resumed,) = so.scheduled_new_reqs
    assert resumed.prompt_token_ids == r2.prompt_token_ids
    assert resumed.output_token_ids == expected_outputs(r2.prompt_token_ids, 1)
    assert resumed.num_computed_tokens == 0
    assert so.num_scheduled_tokens == {"r2": 9}  # prompt and output, recomputed
    assert r2.status == RequestStatus.RUNNING


def test_resumed_request_finishes_with_exactly_max_tokens_outputs():
    scheduler, runner, requests = _full_cache_scheduler(max_tokens=4)
    steps = run_to_completion(scheduler, runner)
    assert [r for so in steps for r in so.preempted_req_ids] == ["r2"]
    for request in requests:
        assert request.output_token_ids == expected_outputs(request.prompt_token_ids, 4)
        assert request.finish_reason == FinishReason.LENGTH


def _self_preempting_scheduler() -> tuple[Scheduler, FakeModelRunner, list[Request]]:
    """block_size 4, 3 blocks, budget 5: r0 (4 tokens) gets block 0, r1 (4) is split 1 + 3
    into block 1, and r0's 5th token takes block 2. In step 3 r0 (context 6) fits its two
    blocks, but r1 (context 5) needs a second one and none is free."""
    scheduler = create_scheduler(max_num_batched_tokens=5, num_blocks=3, block_size=4)
    requests = create_requests(2, 4, max_tokens=4)
    add(scheduler, requests)
    runner = create_runner(scheduler)
    assert step(scheduler, runner)[0].num_scheduled_tokens == {"r0": 4, "r1": 1}
    assert step(scheduler, runner)[0].num_scheduled_tokens == {"r0": 1, "r1": 3}
    assert scheduler.kv_cache_manager.num_free_blocks == 0
    return scheduler, runner, requests


def test_the_newest_running_request_preempts_itself_when_it_needs_a_block():
    scheduler, runner, (r0, r1) = _self_preempting_scheduler()
    so, _ = step(scheduler, runner)
    assert so.preempted_req_ids == ["r1"]
    assert so.num_scheduled_tokens == {"r0": 1}
    assert (r1.status, r1.num_computed_tokens) == (RequestStatus.PREEMPTED, 0)
    assert scheduler.running == [r0]
    run_to_completion(scheduler, runner)
    assert r1.output_token_ids == expected_outputs(r1.prompt_token_ids, 4)


def test_no_request_is_admitted_in_a_step_that_preempted():
    scheduler, runner, (_, r1) = _self_preempting_scheduler()
    so, _ = step(scheduler, runner)
    assert so.scheduled_new_reqs == []
    # r1 would fit now (a 4-token chunk in the one free block, 4 tokens of budget left)
    # but must wait a step.
    assert so.total_num_scheduled_tokens == 1
    assert scheduler.kv_cache_manager.num_free_blocks == 1
    assert list(scheduler.waiting) == [r1]
    so, _ = step(scheduler, runner)
    assert so.num_scheduled_tokens == {"r0": 1, "r1": 4}
    assert [(n.req_id, n.output_token_ids) for n in so.scheduled_new_reqs] == [
        ("r1", expected_outputs(r1.prompt_token_ids, 1))]


def test_every_request_ends_with_its_own_tokens_after_preemptions():
    scheduler = create_scheduler(max_num_seqs=4, max_num_batched_tokens=16, num_blocks=8,
                                 block_size=4)
    requests = create_requests(6, [5, 9, 3, 12, 7, 1], max_tokens=[9, 4, 12, 6, 10, 15])
    add(scheduler, requests)
    run_to_completion(scheduler, create_runner(scheduler))
    assert scheduler.num_preemptions > 0
    assert [r.output_token_ids for r in requests] == [
        expected_outputs(r.prompt_token_ids, r.max_tokens) for r in requests]


# -- stop rules ----------------------------------------------------------------------------


def _run_one(request: Request, script: list[int], **scheduler_kwargs) -> list[EngineCoreOutput]:
    """Run one request to completion; its EngineCoreOutputs, one per step that sampled."""
    scheduler = create_scheduler(**scheduler_kwargs)
    scheduler.add_request(request)
    runner = create_runner(scheduler, {request.request_id: list(script)})
    outputs = []
    while scheduler.has_unfinished_requests():
        assert len(outputs) < 100
        outputs += step(scheduler, runner)[1].values()
    assert_everything_free(scheduler)
    return outputs


def test_plain_tokens_travel_as_columns_and_first_last_and_logprob_tokens_in_full():
    """The first token carries the prefix-cache hit and the last the finish reason: both
    are EngineCoreOutputs; the tokens between are the message's two columns. A request
    with logprobs gets an output for every token (its logprobs ride on it)."""
    scheduler = create_scheduler()
    plain, with_logprobs = create_requests(2, 4, max_tokens=4, ignore_eos=True)
    add(scheduler, [plain, with_logprobs])
    runner = create_runner(scheduler)
    messages = []
    while scheduler.has_unfinished_requests():
        so = scheduler.schedule()
        runner_output = runner.execute_model(so)
        # The runner's logprobs for the request that asked (the scheduler passes them on).
        runner_output.logprobs = {with_logprobs.request_id: TokenLogprobs([1], [-0.5], [1])}
        messages.append(scheduler.update_from_output(so, runner_output)[0])
    assert len(messages) == 4
    for i, message in enumerate(messages):
        full = {o.request_id: o for o in message.outputs}
        assert full[with_logprobs.request_id].new_logprobs is not None
        if i in (0, 3):  # first and last: in full
            assert message.token_req_ids == [] and message.token_ids == []
            assert full[plain.request_id].new_token_ids == [plain.output_token_ids[i]]
        else:
            assert plain.request_id not in full
            assert message.token_req_ids == [plain.request_id]
            assert message.token_ids == [plain.output_token_ids[i]]
    assert messages[-1].outputs[0].finish_reason == FinishReason.LENGTH


def test_eos_finishes_with_stop_and_no_stop_reason():
    (request,) = create_requests(1, 4, max_tokens=10)
    outputs = _run_one(request, [5, 6, EOS, 7])
    assert [(o.new_token_ids, o.finish_reason, o.stop_reason) for o in outputs] == [
        ([5], None, None), ([6], None, None), ([EOS], FinishReason.STOP, None)]
    assert request.output_token_ids == [5, 6, EOS]
    assert request.status == RequestStatus.FINISHED


def test_ignore_eos_keeps_generating_past_eos():
    (request,) = create_requests(1, 4, max_tokens=3, ignore_eos=True)
    outputs = _run_one(request, [EOS, EOS, 7])
    assert request.output_token_ids == [EOS, EOS, 7]
    assert outputs[-1].finish_reason == FinishReason.LENGTH


def test_request_without_an_eos_token_only_stops_at_length():
    (request,) = create_requests(1, 4, max_tokens=3, eos_token_id=None)
    _run_one(request, [EOS, EOS, EOS])
    assert request.output_token_ids == [EOS, EOS, EOS]
    assert request.finish_reason == FinishReason.LENGTH


def test_stop_token_id_finishes_with_that_id_as_stop_reason():
    (request,) = create_requests(1, 4, max_tokens=10, stop_token_ids=[42, 43])
    outputs = _run_one(request, [5, 43, 42])
    assert (outputs[-1].finish_reason, outputs[-1].stop_reason) == (FinishReason.STOP, 43)
    assert (request.finish_reason, request.stop_reason) == (FinishReason.STOP, 43)
    assert request.output_token_ids == [5, 43]


def test_min_tokens_suppresses_eos_until_reached():
    (request,) = create_requests(1, 4, max_tokens=10, min_tokens=3)
    _run_one(request, [EOS, EOS, EOS, 9])
    assert request.output_token_ids == [EOS, EOS, EOS]
    assert request.finish_reason == FinishReason.STOP


def test_min_tokens_suppresses_stop_token_ids_until_reached():
    (request,) = create_requests(1, 4, max_tokens=10, min_tokens=3, stop_token_ids=[42])
    _run_one(request, [42, 42, 5, 42, 6])
    assert request.output_token_ids == [42, 42, 5, 42]
    assert (request.finish_reason, request.stop_reason) == (FinishReason.STOP, 42)


def test_max_tokens_finishes_with_length():
    (request,) = create_requests(1, 4, max_tokens=5)
    outputs = _run_one(request, [])
    assert request.output_token_ids == expected_outputs(request.prompt_token_ids, 5)
    assert [o.finish_reason for o in outputs] == [None] * 4 + [FinishReason.LENGTH]
    assert outputs[-1].stop_reason is None


def test_eos_as_the_last_allowed_token_reports_stop_not_length():
    (request,) = create_requests(1, 4, max_tokens=2)
    outputs = _run_one(request, [5, EOS])
    assert outputs[-1].finish_reason == FinishReason.STOP


# -- finishing and aborting -----------------------------------------------------------------


def test_finished_request_id_is_reported_once_in_finished_req_ids():
    scheduler = create_scheduler()
    add(scheduler, create_requests(2, 4, max_tokens=[1, 4]))
    runner = create_runner(scheduler)
    finished = [step(scheduler, runner)[0].finished_req_ids for _ in range(4)]
    assert finished == [[], ["r0"], [], []]  # r1 finished in the 4th step's update
    assert not scheduler.has_unfinished_requests()
    assert [scheduler.schedule().finished_req_ids for _ in range(2)] == [["r1"], []]


def test_finished_request_frees_its_blocks_in_the_step_it_finishes():
    scheduler = create_scheduler(num_blocks=8, block_size=4)
    add(scheduler, create_requests(2, [5, 9], max_tokens=[1, 4]))
    step(scheduler, create_runner(scheduler))
    assert scheduler.kv_cache_manager.get_block_ids("r0") == []
    assert scheduler.kv_cache_manager.num_free_blocks == 8 - 3  # r1's 9 tokens
    assert list(scheduler.requests) == ["r1"]


def test_abort_of_a_waiting_request_removes_it_and_reports_it_next_step():
    scheduler = create_scheduler(max_num_seqs=1)
    r0, r1 = create_requests(2, 4)
    add(scheduler, [r0, r1])
    runner = create_runner(scheduler)
    step(scheduler, runner)
    assert scheduler.finish_requests(["r1"], FinishReason.ABORT) == ["r1"]
    assert (r1.status, r1.finish_reason) == (RequestStatus.FINISHED, FinishReason.ABORT)
    assert list(scheduler.waiting) == [] and "r1" not in scheduler.requests
    so, _ = step(scheduler, runner)
    assert so.finished_req_ids == ["r1"]
    assert so.num_scheduled_tokens == {"r0": 1}


def test_abort_of_a_running_request_frees_its_blocks():
    scheduler = create_scheduler(num_blocks=8, block_size=4)
    r0, r1 = create_requests(2, [9, 4])
    add(scheduler, [r0, r1])
    runner = create_runner(scheduler)
    step(scheduler, runner)
    assert scheduler.finish_requests(["r0"], FinishReason.ABORT) == ["r0"]
    assert scheduler.running == [r1]
    assert scheduler.kv_cache_manager.num_free_blocks == 8 - 1
    so, _ = step(scheduler, runner)
    assert so.finished_req_ids == ["r0"]
    assert so.num_scheduled_tokens == {"r1": 1}


def test_abort_of_a_preempted_request_removes_it_from_waiting():
    scheduler, runner, (_, _, r2) = _full_cache_scheduler()
    step(scheduler, runner)
    assert r2.status == RequestStatus.PREEMPTED
    assert scheduler.finish_requests(["r2"], FinishReason.ABORT) == ["r2"]
    assert r2.finish_reason == FinishReason.ABORT
    assert list(scheduler.waiting) == []
    so, _ = step(scheduler, runner)
    assert so.finished_req_ids == ["r2"]
    run_to_completion(scheduler, runner)


def test_abort_of_an_unknown_request_is_ignored():
    scheduler = create_scheduler()
    add(scheduler, create_requests(1))
    assert scheduler.finish_requests(["nope"], FinishReason.ABORT) == []
    assert list(scheduler.requests) == ["r0"]
    assert scheduler.schedule().finished_req_ids == []


def test_abort_between_schedule_and_update_drops_the_sampled_token():
    scheduler = create_scheduler()
    r0, r1 = create_requests(2, 4)
    add(scheduler, [r0, r1])
    runner = create_runner(scheduler)
    so = scheduler.schedule()
    runner_output = runner.execute_model(so)
    scheduler.finish_requests(["r0"], FinishReason.ABORT)
    outputs = flat(scheduler.update_from_output(so, runner_output))
    assert [o.request_id for o in outputs] == ["r1"]
    assert r0.output_token_ids == []
    scheduler.finish_requests(["r1"], FinishReason.ABORT)
    assert_everything_free(scheduler)
    assert scheduler.schedule().finished_req_ids == ["r0", "r1"]


def test_abort_of_every_request_leaves_every_block_free():
    scheduler, runner, _ = _full_cache_scheduler()
    step(scheduler, runner)  # r0, r1 running; r2 preempted and waiting
    add(scheduler, create_requests(1, 3, id_prefix="new"))
    aborted = scheduler.finish_requests(["r2", "r0", "new0", "r1"], FinishReason.ABORT)
    assert aborted == ["r2", "r0", "new0", "r1"]
    assert_everything_free(scheduler)


# -- a long randomized run ----------------------------------------------------------------

# Both caches hold 96 slots of 4 tokens, enough for any one request at max_model_len (as the
# executor guarantees) but far from all of them: preemption is routine.
RANDOM_CONFIGS = {
    "roomy_budget": {"max_num_seqs": 6, "max_num_batched_tokens": 32, "max_model_len": 96,
                     "num_blocks": 24, "block_size": 4},
    "tight_budget": {"max_num_seqs": 8, "max_num_batched_tokens": 6, "max_model_len": 96,
                     "num_blocks": 24, "block_size": 4},
}


@dataclass
class Trace:
    config: dict[str, int]
    scheduler: Scheduler
    requests: list[Request]
    steps: list[SchedulerOutput] = field(default_factory=list)
    running_after_schedule: list[list[str]] = field(default_factory=list)
    held_blocks: list[list[int]] = field(default_factory=list)  # every request's, per step
    free_blocks: list[int] = field(default_factory=list)
    streamed: dict[str, list[int]] = field(default_factory=dict)
    finish_reasons: dict[str, FinishReason | None] = field(default_factory=dict)
    flush: SchedulerOutput | None = None  # one more schedule() after the last request


def random_run(config: dict[str, int], seed: int, num_requests: int = 50) -> Trace:
    """Random prompt lengths, max_tokens and arrivals (0-2 new requests a step)."""
    rng = random.Random(seed)
    lens = [rng.randint(1, 60) for _ in range(num_requests)]
    maxes = [rng.randint(1, min(36, config["max_model_len"] - n)) for n in lens]
    scheduler = create_scheduler(**{k: v for k, v in config.items() if k != "max_model_len"})
    trace = Trace(config, scheduler, create_requests(num_requests, lens, max_tokens=maxes))
    pending = list(trace.requests)
    runner = create_runner(scheduler)
    kv = scheduler.kv_cache_manager
    while pending or scheduler.has_unfinished_requests():
        assert len(trace.steps) < 5000, "no progress"
        for _ in range(rng.choice([0, 0, 1, 2])):
            if pending:
                scheduler.add_request(pending.pop(0))
        so = scheduler.schedule()
        trace.steps.append(so)
        trace.running_after_schedule.append([r.request_id for r in scheduler.running])
        trace.held_blocks.append([b for blocks in kv.req_to_blocks.values() for b in blocks])
        trace.free_blocks.append(kv.num_free_blocks)
        for out in flat(scheduler.update_from_output(so, runner.execute_model(so))):
            trace.streamed.setdefault(out.request_id, []).extend(out.new_token_ids)
            trace.finish_reasons[out.request_id] = out.finish_reason
    trace.flush = scheduler.schedule()
    return trace


@pytest.fixture(scope="module", params=[(name, seed) for name in RANDOM_CONFIGS
                                        for seed in (0, 1)],
                ids=lambda p: f"{p[0]}-seed{p[1]}")
def trace(request: pytest.FixtureRequest) -> Trace:
    name, seed = request.param
    return random_run(RANDOM_CONFIGS[name], seed)


def test_random_run_preempts_and_chunks_so_the_checks_below_mean_something(trace):
    assert trace.scheduler.num_preemptions >= 5
    budget = trace.config["max_num_batched_tokens"]
    assert sum(so.total_num_scheduled_tokens == budget for so in trace.steps) >= 10
    assert any(so.scheduled_new_reqs and so.scheduled_cached_reqs.req_ids
               for so in trace.steps)
    assert any(so.preempted_req_ids for so in trace.steps)


def test_token_budget_holds_every_step_under_random_load(trace):
    for so in trace.steps:
        assert so.total_num_scheduled_tokens <= trace.config["max_num_batched_tokens"]
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        assert all(n >= 1 for n in so.num_scheduled_tokens.values())


def test_max_num_seqs_holds_every_step_under_random_load(trace):
    for so, running in zip(trace.steps, trace.running_after_schedule, strict=True):
        assert len(running) <= trace.config["max_num_seqs"]
        assert len(so.num_scheduled_tokens) <= trace.config["max_num_seqs"]


def test_every_running_request_is_scheduled_every_step_under_random_load(trace):
    # Running requests are served before any admission and only the newest can be
    # mid-prompt, so nothing running ever goes a step without tokens, even when the
    # budget is smaller than max_num_seqs.
    for so, running in zip(trace.steps, trace.running_after_schedule, strict=True):
        assert sorted(running) == sorted(so.num_scheduled_tokens)


def test_blocks_are_never_shared_or_lost_under_random_load(trace):
    total = trace.config["num_blocks"]
    for held, free in zip(trace.held_blocks, trace.free_blocks, strict=True):
        assert len(held) == len(set(held))
        assert len(held) + free == total


def test_random_run_streams_exactly_max_tokens_correct_outputs_per_request(trace):
    for request in trace.requests:
        expected = expected_outputs(request.prompt_token_ids, request.max_tokens)
        assert trace.streamed[request.request_id] == expected
        assert request.output_token_ids == expected
        assert trace.finish_reasons[request.request_id] == FinishReason.LENGTH


def test_random_run_reports_every_request_finished_exactly_once(trace):
    assert trace.flush is not None and trace.flush.is_empty
    finished = [rid for so in [*trace.steps, trace.flush] for rid in so.finished_req_ids]
    assert sorted(finished) == sorted(r.request_id for r in trace.requests)


def test_random_run_leaves_every_block_free_and_no_request_behind(trace):
    assert_everything_free(trace.scheduler)


# -- the pure-Python promise -----------------------------------------------------------------


@pytest.mark.parametrize("module", ["block_pool", "kv_cache_manager", "request", "scheduler"])
def test_scheduler_and_block_manager_modules_do_not_import_torch(module):
    source = Path(__file__).resolve().parents[2] / "pagellm" / "enginecore" / f"{module}.py"
    imported = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert not imported & {"torch", "executor", "kernels", "triton"}


def test_a_step_runs_at_most_max_loras_adapters_and_the_others_keep_their_place():
    """Issue 42: max_loras=2 device slots. Requests of adapters 1, 2, 3, 1 and one of the
    base model arrive in that order: the first step admits adapters 1 and 2, the base
    request and the second request of adapter 1 (already running), and holds adapter
    3's back (the slots are taken) without losing its place; it runs once an adapter's
    requests finish. Every step's adapters fit the slots, and every request completes
    with its tokens."""
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64,
                                          max_loras=2), KVCacheManager(64, 4))
    runner = FakeModelRunner(4)
    requests = create_requests(5, 4, max_tokens=[3, 6, 3, 3, 3])
    for request, lora_id in zip(requests, [1, 2, 3, 1, 0], strict=True):
        if lora_id:
            request.rehash((lora_id, 0))
    add(scheduler, requests)
    first, _ = step(scheduler, runner)
    assert [n.req_id for n in first.scheduled_new_reqs] == ["r0", "r1", "r3", "r4"]
    assert [n.lora_int_id for n in first.scheduled_new_reqs] == [1, 2, 1, 0]
    assert [r.request_id for r in scheduler.waiting] == ["r2"]
    steps = [first, *run_to_completion(scheduler, runner)]
    lora_of = dict(zip([r.request_id for r in requests], [1, 2, 3, 1, 0], strict=True))
    for so in steps:
        assert len({lora_of[r] for r in so.num_scheduled_tokens} - {0}) <= 2
    admitted = next(i for i, so in enumerate(steps)
                    if any(n.req_id == "r2" for n in so.scheduled_new_reqs))
    assert admitted > 1
    assert all(r.output_token_ids == expected_outputs(r.prompt_token_ids, r.max_tokens)
               for r in requests)


# -- asynchronous scheduling (issue 45): step n+1 is scheduled before n's tokens are back


def run_async(scheduler: Scheduler, runner: FakeModelRunner, max_steps: int = 1000
              ) -> tuple[list[SchedulerOutput], dict[str, list[EngineCoreOutput]]]:
    """EngineCore.step's loop with async_scheduling: each step is scheduled and run
    before the one before it is taken back (`update_from_output`), unless it is empty.
    The fake runner, like the real one, has every token it sampled when it runs the
    next step. Returns the steps, and each request's outputs in order."""
    steps: list[SchedulerOutput] = []
    outputs: dict[str, list[EngineCoreOutput]] = {}
    in_flight: list[tuple[SchedulerOutput, ModelRunnerOutput]] = []
    while scheduler.has_unfinished_requests() or in_flight:
        assert len(steps) < max_steps, "no progress"
        overlapped = False
        if scheduler.has_unfinished_requests() or scheduler.has_finished_requests():
            so = scheduler.schedule()
            steps.append(so)
            in_flight.append((so, runner.execute_model(so)))
            overlapped = not so.is_empty
        while len(in_flight) > overlapped:
            for out in flat(scheduler.update_from_output(*in_flight.pop(0))):
                outputs.setdefault(out.request_id, []).append(out)
    return steps, outputs


def _tokens_and_finish(outputs: list[EngineCoreOutput]) -> tuple[list[int], FinishReason]:
    assert all(o.finish_reason is None for o in outputs[:-1])
    finish = outputs[-1].finish_reason
    assert finish is not None
    return [t for o in outputs for t in o.new_token_ids], finish


def test_async_steps_give_every_request_the_tokens_and_finish_of_sync_steps():
    """Prompts chunked over steps, max_tokens from 1, EOS and stop tokens scripted at
    various points, more requests than seats: each request's tokens and finish reason
    are the synchronous loop's, and the steps did overlap (a request scheduled again
    while its last token was still out: two placeholders)."""
    def build() -> tuple[Scheduler, FakeModelRunner]:
        scheduler = create_scheduler(max_num_seqs=6, max_num_batched_tokens=24,
                                     num_blocks=64, block_size=4)
        requests = create_requests(12, [3, 30, 8, 17, 1, 9, 40, 5, 12, 2, 26, 7],
                                   max_tokens=[1, 2, 5, 9, 16, 7, 3, 12, 4, 20, 6, 11],
                                   stop_token_ids=[555])
        add(scheduler, requests)
        script = {"r2": [3, 4, EOS], "r7": [1, 2, 3, 555], "r9": [9, EOS]}
        return scheduler, create_runner(scheduler, script)

    scheduler, runner = build()
    synchronous: dict[str, list[EngineCoreOutput]] = {}
    while scheduler.has_unfinished_requests():
        for request_id, out in step(scheduler, runner)[1].items():
            synchronous.setdefault(request_id, []).append(out)
    scheduler, runner = build()
    seen: list[int] = []
    original = scheduler._schedule_running

    def spy(*args, **kwargs):  # placeholders of the running requests as scheduled
        result = original(*args, **kwargs)
        seen.extend(r.num_output_placeholders for r in scheduler.running)
        return result

    scheduler._schedule_running = spy  # type: ignore[method-assign]
    _, asynchronous = run_async(scheduler, runner)
    assert_everything_free(scheduler)
    assert {r: _tokens_and_finish(o) for r, o in asynchronous.items()} == \
        {r: _tokens_and_finish(o) for r, o in synchronous.items()}
    assert len(synchronous) == 12 and max(seen) == 2


def test_a_request_stopped_by_the_step_in_flight_gets_nothing_from_the_next():
    """r0 samples EOS in step 2; step 3, scheduled before step 2 came back, computed one
    more token for it. That token is dropped: r0 ends with its two tokens, its blocks
    free, and the runner is told to forget it."""
    scheduler = create_scheduler()
    (r0,) = create_requests(1, 8)
    add(scheduler, [r0])
    runner = create_runner(scheduler, {"r0": [5, EOS]})
    steps, outputs = run_async(scheduler, runner)
    assert [list(so.num_scheduled_tokens.items()) for so in steps[:3]] == \
        [[("r0", 8)], [("r0", 1)], [("r0", 1)]]
    assert _tokens_and_finish(outputs["r0"]) == ([5, EOS], FinishReason.STOP)
    assert r0.output_token_ids == [5, EOS]
    assert any("r0" in so.finished_req_ids for so in steps)
    assert_everything_free(scheduler)


def test_a_request_whose_last_token_is_in_flight_is_not_scheduled_again():
    """max_tokens=3: the prompt step and two decode steps sample its three tokens; with
    the third still out, the request waits instead of computing a token past its end."""
    scheduler = create_scheduler()
    (r0,) = create_requests(1, 8, max_tokens=3)
    add(scheduler, [r0])
    steps, outputs = run_async(scheduler, create_runner(scheduler))
    assert sum("r0" in so.num_scheduled_tokens for so in steps) == 3
    assert _tokens_and_finish(outputs["r0"]) == (
        expected_outputs(r0.prompt_token_ids, 3), FinishReason.LENGTH)
    assert_everything_free(scheduler)


def test_a_request_preempted_with_a_token_in_flight_that_ends_it_leaves_the_queue():
    """Three 7-token prompts fill the six blocks. Step 2 (scheduled before step 1 came
    back) computes position 7 of each; step 3 needs new blocks, so r2 is preempted while
    step 2's token for it is still out. That token is r2's last (max_tokens=2): r2
    finishes from the waiting queue, which it leaves, and is never admitted again."""
    scheduler = create_scheduler(max_num_seqs=3, num_blocks=6, block_size=4)
    requests = create_requests(3, 7, max_tokens=[8, 8, 2])
    add(scheduler, requests)
    steps, outputs = run_async(scheduler, create_runner(scheduler))
    assert steps[2].preempted_req_ids == ["r2"]
    assert "r2" in steps[1].num_scheduled_tokens
    assert _tokens_and_finish(outputs["r2"]) == (
        expected_outputs(requests[2].prompt_token_ids, 2), FinishReason.LENGTH)
    assert not any(n.req_id == "r2" for so in steps[1:] for n in so.scheduled_new_reqs)
    for request in requests:
        assert request.output_token_ids == expected_outputs(request.prompt_token_ids,
                                                            request.max_tokens)
    assert_everything_free(scheduler)
