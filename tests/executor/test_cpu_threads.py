"""The CPU thread tuner (executor/worker/cpu_threads.py), driven with step times given by
hand, and its use by the model runner."""

from __future__ import annotations

import torch

from pagellm.executor.worker.cpu_threads import (
    CLEAR_WIN,
    ONE_THREAD_MARGIN,
    REFRESH_STEPS,
    SWITCH_S,
    TRIAL_BLOCK,
    TRIAL_STEPS,
    ThreadTuner,
    tunable_threads,
)

ROUND = 2 * TRIAL_BLOCK  # one block of every thread, one of one thread


def run_steps(tuner: ThreadTuner, num_tokens: int, seconds: dict[int, float], steps: int
              ) -> list[int]:
    """Step `steps` times; a step on t threads takes seconds[t]. Returns each step's
    thread count."""
    used = []
    for _ in range(steps):
        threads = tuner.threads_for(num_tokens)
        tuner.record(seconds[threads])
        used.append(threads)
    return used


def test_a_close_trial_interleaves_blocks_for_every_round() -> None:
    """Every thread 10% faster: not clear after one round, so all rounds run; then
    every thread wins (beyond the 2% margin)."""
    tuner = ThreadTuner(4)
    used = run_steps(tuner, 256, {4: 1.0, 1: 1.1}, TRIAL_STEPS + 5)
    assert used == ([4] * TRIAL_BLOCK + [1] * TRIAL_BLOCK) * (TRIAL_STEPS // ROUND) + [4] * 5


def test_a_clear_winner_is_kept_after_one_round() -> None:
    """One thread clearly faster: kept after its block; clearly slower (by more than a
    switch costs): its block stops at its first step, every thread from then on."""
    for times, one_thread_steps, winner in (({2: 1.0, 1: CLEAR_WIN + SWITCH_S}, 1, 2),
                                            ({2: CLEAR_WIN, 1: 1.0}, TRIAL_BLOCK, 1)):
        tuner = ThreadTuner(2)
        used = run_steps(tuner, 256, times, TRIAL_BLOCK + one_thread_steps + 50)
        assert used == [2] * TRIAL_BLOCK + [1] * one_thread_steps + [winner] * 50


def test_a_slow_one_thread_step_settles_the_larger_sizes_too() -> None:
    """A large model's first prompt steps: one step on one thread (slower by far more
    than a switch costs), then every thread for that size and every larger one,
    untried."""
    tuner = ThreadTuner(2)
    used = run_steps(tuner, 1024, {2: 1.0, 1: 1.9}, TRIAL_BLOCK + 1 + 3)
    assert used == [2] * TRIAL_BLOCK + [1] + [2] * 3
    assert run_steps(tuner, 2048, {2: 1.0, 1: 1.9}, 5) == [2] * 5


def test_one_thread_when_as_fast_within_the_margin() -> None:
    """It leaves the other cores to the frontend."""
    for ratio, winner in ((ONE_THREAD_MARGIN * 0.999, 1), (ONE_THREAD_MARGIN * 1.01, 2)):
        tuner = ThreadTuner(2)
        used = run_steps(tuner, 256, {2: 1.0, 1: ratio}, TRIAL_STEPS + 5)
        assert used[TRIAL_STEPS:] == [winner] * 5


def test_the_first_step_of_each_block_is_not_counted() -> None:
    """The step right after a switch pays for it (threads waking or still spinning):
    its time must not decide. Here only those steps make one thread look slow, by what
    a switch can cost."""
    tuner = ThreadTuner(2)
    for i in range(ROUND):
        threads = tuner.threads_for(256)
        first_of_block = i % TRIAL_BLOCK == 0
        tuner.record(0.002 + 0.9 * SWITCH_S if first_of_block and threads == 1 else
                     {2: 0.002, 1: 0.001}[threads])
    assert tuner.threads_for(256) == 1


def test_a_choice_settles_the_sizes_it_implies() -> None:
    """Sizes are powers of two of tokens. One thread for 256..511 tokens means one for
    fewer; every thread for 8192.. means every thread for more; sizes in between are
    measured. Under 64 tokens is one size."""
    tuner = ThreadTuner(2)
    run_steps(tuner, 256, {2: 2.0, 1: 1.0}, ROUND)
    run_steps(tuner, 8192, {2: 1.0, 1: 2.0}, ROUND)
    assert run_steps(tuner, 300, {2: 2.0, 1: 1.0}, 3) == [1] * 3  # the same size
    assert run_steps(tuner, 9000, {2: 1.0, 1: 2.0}, 3) == [2] * 3
    assert run_steps(tuner, 100, {2: 1.0, 1: 2.0}, 3) == [1] * 3  # implied: no trial
    assert run_steps(tuner, 20000, {2: 2.0, 1: 1.0}, 3) == [2] * 3
    assert run_steps(tuner, 1024, {2: 1.0, 1: 2.0}, TRIAL_BLOCK + 2) == \
        [2] * TRIAL_BLOCK + [1] + [2]  # measured: its own trial (one thread cut short)
    # Every thread for 1024.. now implies it for 8192.. (already) but not below.
    assert run_steps(tuner, 300, {2: 1.0, 1: 2.0}, 1) == [1]
    tuner = ThreadTuner(2)
    run_steps(tuner, 1, {2: 1.0, 1: 2.0}, ROUND)
    assert run_steps(tuner, 63, {2: 2.0, 1: 1.0}, 1) == [2]  # one size: no trial
    assert run_steps(tuner, 64, {2: 2.0, 1: 1.0}, 1) == [2]  # implied


def test_measures_again_after_refresh_steps_and_follows_the_load() -> None:
    tuner = ThreadTuner(2)
    run_steps(tuner, 256, {2: 2.0, 1: 1.0}, ROUND)
    assert run_steps(tuner, 256, {2: 1.0, 1: 2.0}, REFRESH_STEPS) == [1] * REFRESH_STEPS
    # The machine changed (the frontend went quiet): the next trial finds it.
    used = run_steps(tuner, 256, {2: 1.0, 1: 2.0}, TRIAL_BLOCK + 1 + 5)
    assert used == [2] * TRIAL_BLOCK + [1] + [2] * 5


def test_steps_that_were_never_recorded_do_not_stall_the_trial() -> None:
    """A step that failed is never recorded; the trial still ends on schedule."""
    tuner = ThreadTuner(2)
    for i in range(ROUND):
        threads = tuner.threads_for(256)
        if i % 3:
            tuner.record({2: 2.0, 1: 1.0}[threads])
    assert run_steps(tuner, 256, {2: 2.0, 1: 1.0}, 3) == [1] * 3
    tuner = ThreadTuner(2)
    for _ in range(TRIAL_STEPS):
        tuner.threads_for(256)  # nothing recorded at all: keep every thread
    assert tuner.threads_for(256) == 2


def test_only_openmp_thread_counts_are_tuned(monkeypatch) -> None:
    """One thread has nothing to choose; torch's native backend fixes its pool once
    parallel work started (and warns at every change)."""
    info = "ATen/Parallel:\n\tat::get_num_threads() : 2\nATen parallel backend: {}\n"
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(torch.__config__, "parallel_info", lambda: info.format("OpenMP"))
    assert tunable_threads()
    monkeypatch.setattr(torch.__config__, "parallel_info",
                        lambda: info.format("native thread pool"))
    assert not tunable_threads()
    monkeypatch.setattr(torch.__config__, "parallel_info", lambda: info.format("OpenMP"))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert not tunable_threads()


def test_an_in_process_engine_leaves_its_hosts_thread_count_as_found(tmp_path, monkeypatch
                                                                     ) -> None:
    """The tuner's one-thread steps must not leak into the process that embeds the
    engine (an in-process LLM, a test), whose torch work goes on after each step."""
    set_calls: list[int] = []
    set_num_threads = torch.set_num_threads

    def spy(n: int) -> None:
        set_calls.append(n)
        set_num_threads(n)

    from pagellm.demo.model import ModelSpec, make_model
    from pagellm.enginecore.core import EngineCore
    from pagellm.protocol.engine_args import EngineArgs
    from pagellm.protocol.messages import EngineCoreRequest
    from pagellm.protocol.sampling_params import SamplingParams

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model = make_model(tmp_path / "m", ModelSpec(hidden_size=32, num_layers=1,
                                                     num_heads=2, num_kv_heads=1,
                                                     intermediate_size=64, vocab_size=512))
        core = EngineCore(EngineArgs(model=str(model), max_num_seqs=4,
                                     kv_cache_memory_bytes=2**22))
        try:
            tuner = core.executor.worker.model_runner.thread_tuner
            assert tuner is not None and tuner.max_threads == 2
            params = SamplingParams(temperature=0.0, max_tokens=TRIAL_STEPS + 8,
                                    ignore_eos=True)
            core.add_request(EngineCoreRequest("a", [1, 2, 3], params, None, 0.0))
            counts = set()
            monkeypatch.setattr(torch, "set_num_threads", spy)
            while core.has_work():
                core.step()
                counts.add(torch.get_num_threads())
            assert counts == {2}
            # The trial's one-thread steps ran (a whole block, or fewer where one came out
            # CLEAR_WIN slower on a loaded machine and ended the trial), and each step put
            # back what it found.
            assert len(set_calls) >= 2
            assert set_calls == [1, 2] * (len(set_calls) // 2)
        finally:
            core.shutdown()
    finally:
        torch.set_num_threads(before)
