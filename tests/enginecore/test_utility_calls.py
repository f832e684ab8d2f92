"""Utility calls from one table (protocol/utility.py `SIGNATURES`): one row and one
`EngineCore` handler per `UtilityMethod`, data-parallel results merged as the row says,
and the engine's refusals and weight counts driven by the row."""

from __future__ import annotations

from typing import Any

import pytest

from pagellm.enginecore.core import Deferred, EngineCore
from pagellm.frontend.engine_client.core_client import UTILITY_TIMEOUT_S
from pagellm.frontend.engine_client.dp_routing import MERGERS, merge_results
from pagellm.frontend.llm import LLM
from pagellm.protocol.engine_args import EngineArgs
from pagellm.protocol.messages import EngineCoreRequest, FinishReason, UtilityMethod
from pagellm.protocol.sampling_params import SamplingParams
from pagellm.protocol.stats import EngineStats, StepTimings
from pagellm.protocol.utility import SIGNATURES, Merge, convert_args

M = UtilityMethod


@pytest.fixture
def core(model_dirs):
    engine = EngineCore(EngineArgs(model=str(model_dirs["llama"]), max_num_seqs=4,
                                   kv_cache_memory_bytes=8 * 2**20, enable_sleep_mode=True,
                                   worker_extension_cls="rl_extension.Probe"))
    yield engine
    engine.shutdown()


def call(core: EngineCore, method: UtilityMethod, *args: Any) -> Any:
    """As `InprocClient` does: step the engine until a deferred answer is ready."""
    result = core.call_utility(method, list(args))
    if isinstance(result, Deferred):
        for _ in range(200):
            if result.ready():
                break
            core.step()
        return result.finish()
    return result


def add(core: EngineCore, request_id: str, max_tokens: int = 4) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    core.add_request(EngineCoreRequest(request_id, [1, 2, 3, 4], params, None, 0.0))


def finished(core: EngineCore) -> dict[str, Any]:
    """Step until nothing is left to do: each finished request's last output, by id."""
    outputs: dict[str, Any] = {}
    for _ in range(100):
        for message in core.step().values():
            outputs |= {o.request_id: o for o in message.outputs if o.finished}
        if not core.has_work():
            break
    return outputs


# --- the table ----------------------------------------------------------------------


def test_every_utility_method_has_exactly_one_row():
    assert list(SIGNATURES) == list(UtilityMethod)  # each once, in the enum's order


def test_every_row_with_no_arguments_takes_an_empty_call_and_refuses_more():
    for method, row in SIGNATURES.items():
        if row.args == tuple[()]:
            assert convert_args(method, []) == ()
            with pytest.raises(ValueError, match=f"bad arguments for {method.name.lower()}"):
                convert_args(method, [1])


def test_the_engine_core_has_one_handler_per_utility_method(core):
    assert set(core._handlers) == set(UtilityMethod)
    assert all(callable(handler) for handler in core._handlers.values())


# --- merging data-parallel results ------------------------------------------------------


def stats(running: int, total: int, usage: float, schedule_s: float) -> EngineStats:
    return EngineStats(num_running_reqs=running, num_waiting_reqs=1, num_free_blocks=total // 2,
                       num_total_blocks=total, kv_cache_usage=usage, prefix_cache_queries=10,
                       prefix_cache_hits=running, num_preemptions=0, num_steps=5,
                       step_timings=StepTimings(schedule_s=schedule_s))


MERGE_CASES = [  # (method, each core's result, the merged result, worked out by hand)
    (M.RESET_PREFIX_CACHE, [True, True], True),
    (M.RESET_PREFIX_CACHE, [True, False], False),  # not reset everywhere
    (M.WAKE_UP, [False, True], False),  # not awake everywhere
    (M.IS_SLEEPING, [False, True], True),  # not every core serves
    (M.IS_PAUSED, [False, False], False),
    (M.COLLECTIVE_RPC, [[1, "a"], [{"b": 2}]], [1, "a", {"b": 2}]),  # per worker, rank order
    (M.UPDATE_WEIGHTS, [7, 3, 5], 3),  # what every core loaded
    (M.SLEEP, [None, None], None),
    (M.FINISH_WEIGHT_UPDATE, [None, None], None),
]


@pytest.mark.parametrize(("method", "results", "merged"), MERGE_CASES)
def test_results_merge_as_the_row_says(method, results, merged):
    assert merge_results(method, results) == merged
    assert type(merge_results(method, results)) is type(merged)


def test_stats_merge_sums_counts_and_weighs_usage_by_blocks():
    a, b = stats(1, 20, 0.5, 0.25), stats(3, 60, 0.25, 0.75)
    merged = merge_results(M.GET_STATS, [a, b])
    assert (merged.num_running_reqs, merged.num_waiting_reqs) == (4, 2)
    assert (merged.num_free_blocks, merged.num_total_blocks) == (40, 80)
    assert merged.kv_cache_usage == pytest.approx((0.5 * 20 + 0.25 * 60) / 80)  # 0.3125
    assert (merged.prefix_cache_hits, merged.num_steps) == (4, 10)
    assert merged.step_timings.schedule_s == pytest.approx(0.5)  # the mean
    assert merged.per_engine == [a, b]


def test_every_merge_kind_has_a_merger_and_a_worked_case():
    assert set(MERGERS) == set(Merge)
    covered = {SIGNATURES[method].merge for method, _, _ in MERGE_CASES} | {Merge.STATS}
    assert covered == set(Merge)


# --- what the engine core does as the row says -------------------------------------------


def test_resume_is_refused_while_memory_sleeps_and_queries_still_answer(core):
    assert SIGNATURES[M.RESUME].refused_asleep
    call(core, M.SLEEP, 1, "abort")
    assert core.executor.sleeping == {"weights", "kv_cache"}
    with pytest.raises(RuntimeError, match=r"cannot resume: the engine is sleeping \(level 1: "
                                           r"kv_cache, weights freed\); call wake_up\(\) first"):
        call(core, M.RESUME)
    assert call(core, M.IS_PAUSED) is True  # refused: still paused
    assert call(core, M.IS_SLEEPING) is True
    assert call(core, M.WAKE_UP, None) is True
    assert call(core, M.IS_PAUSED) is False


def test_the_dispatcher_reads_the_refusal_from_the_row(core, monkeypatch):
    call(core, M.SLEEP, 1, "keep")
    assert call(core, M.IS_PAUSED) is True  # its row does not refuse it
    monkeypatch.setitem(SIGNATURES, M.IS_PAUSED,
                        SIGNATURES[M.IS_PAUSED]._replace(refused_asleep=True))
    with pytest.raises(RuntimeError, match="cannot is_paused: the engine is sleeping"):
        call(core, M.IS_PAUSED)
    assert call(core, M.WAKE_UP, None) is True
    assert call(core, M.IS_PAUSED) is False  # awake: the row refuses it no more


def test_requests_are_refused_while_paused_except_in_mode_keep(core):
    call(core, M.PAUSE, "abort")
    add(core, "refused")
    output = finished(core)["refused"]
    assert output.finish_reason == FinishReason.ERROR and output.unavailable
    assert output.error == ("request refused: the engine is paused (mode 'abort'); requests "
                            "are served again after resume_generation()")
    call(core, M.RESUME)
    call(core, M.PAUSE, "keep")
    add(core, "kept")
    assert not core.has_work() and core.scheduler.num_waiting == 1  # waits, unanswered
    call(core, M.RESUME)
    assert finished(core)["kept"].finish_reason == FinishReason.LENGTH


def test_a_pause_in_mode_wait_answers_once_its_requests_finish(core):
    add(core, "running", max_tokens=6)
    core.step()
    pending = core.call_utility(M.PAUSE, ["wait"])
    assert isinstance(pending, Deferred) and not pending.ready()
    outputs = finished(core)
    assert pending.ready() and pending.finish() is None
    assert outputs["running"].finish_reason == FinishReason.LENGTH


def test_a_pause_resumed_before_it_settled_fails_rather_than_report_a_pause(core):
    add(core, "running", max_tokens=6)
    core.step()
    pending = core.call_utility(M.PAUSE, ["wait"])
    call(core, M.RESUME)
    finished(core)
    assert pending.ready()
    with pytest.raises(RuntimeError, match=r"resumed .* before the pause settled"):
        pending.finish()


def test_weights_woken_empty_are_counted_and_loading_them_is_counted_again(core, model_dirs):
    """WAKE_UP may wake weights empty (always counted), COLLECTIVE_RPC may load them
    (counted while any is missing), as their rows say."""
    call(core, M.SLEEP, 2, "abort")
    assert call(core, M.WAKE_UP, None) is True
    missing, total = core.state.unloaded_weights
    assert missing == total > 0
    add(core, "refused")
    assert "discarded by sleep(level=2)" in finished(core)["refused"].error
    call(core, M.COLLECTIVE_RPC, "reload_from", [str(model_dirs["llama"])], {})
    assert core.state.unloaded_weights == (0, total)
    add(core, "served")
    assert finished(core)["served"].finish_reason == FinishReason.LENGTH


def test_a_weight_update_round_is_bracketed_and_keeps_its_version(core):
    with pytest.raises(RuntimeError, match="no weight update in progress"):
        call(core, M.FINISH_WEIGHT_UPDATE, "v1")
    call(core, M.START_WEIGHT_UPDATE)
    with pytest.raises(RuntimeError, match="already in progress"):
        call(core, M.START_WEIGHT_UPDATE)
    call(core, M.FINISH_WEIGHT_UPDATE, "v1")
    assert core.state.weight_version == "v1" and not core.state.updating


# --- how long the frontend waits -----------------------------------------------------


class RecordingClient:
    def __init__(self) -> None:
        self.timeouts: dict[UtilityMethod, float | None] = {}

    def call_utility(self, method: UtilityMethod, *args: Any,
                     timeout: float | None = UTILITY_TIMEOUT_S) -> Any:
        self.timeouts[method] = timeout
        return True

    def shutdown(self) -> None:
        pass


def test_llm_waits_without_timeout_exactly_for_the_rows_that_say_so():
    llm = LLM.__new__(LLM)
    llm.engine_core = client = RecordingClient()  # type: ignore[assignment]
    llm.sleep(1, "wait")
    llm.wake_up()
    llm.pause_generation("wait")
    llm.resume_generation()
    llm.is_paused()
    llm.init_weight_transfer_engine({"init_info": {}})
    llm.start_weight_update()
    llm.finish_weight_update()
    assert client.timeouts == {
        M.SLEEP: None, M.WAKE_UP: None, M.PAUSE: None, M.RESUME: UTILITY_TIMEOUT_S,
        M.IS_PAUSED: UTILITY_TIMEOUT_S, M.INIT_WEIGHT_TRANSFER_ENGINE: None,
        M.START_WEIGHT_UPDATE: UTILITY_TIMEOUT_S, M.FINISH_WEIGHT_UPDATE: UTILITY_TIMEOUT_S}
    assert {m for m, timeout in client.timeouts.items() if timeout is None} == {
        m for m in client.timeouts if SIGNATURES[m].no_timeout}
