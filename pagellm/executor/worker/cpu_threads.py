"""How many threads a CPU step runs on, chosen by timing the steps themselves.

A step's ops parallelize over OpenMP threads, and between parallel regions the idle
threads spin (libgomp spins ~300,000 times before sleeping). That pays on a model
whose GEMMs are large enough to split (the SmolLM2-135M shape decodes 1.5x faster on
two cores than on one) and costs where they are not: a tiny model gains nothing from
the second thread (0.96x, engine alone), and with a frontend busy on 256 streams its
spinning takes the core the frontend needs, so the engine's steps and the frontend's
outputs both slow (BENCHMARKS.md, "Engine-core overhead"). Which case holds depends
on the model, the step's size and what else runs on the machine, so it is measured:
for each step size (tokens, by powers of two from 64; fewer are one size) the tuner
runs a few steps with every thread and a few with one, interleaved in blocks, and
keeps the faster (one thread when within 2%: it leaves the other cores to the
frontend). A clear winner (25%) is kept after one block of each, and every thread at
once when a step on one thread is already that much slower (the first of its block
only by more than a switch of thread counts can cost, `SWITCH_S`): a large model's
prompt steps then spend one step on one thread, not four (a fresh engine's second and
third batches of 48 prompts ran 1.45x slower). The choice is measured again every
`REFRESH_STEPS` steps of that size, as the load changes.

Trials cost: half their steps run on the slower count. So a choice also settles the
sizes it implies, which are then not tried: more tokens per step only make the
threads' share of work larger, so every thread for one size means every thread for
all larger ones, and one thread means one for all smaller ones.

Only the thread count of the steps changes, never what they compute: outputs may
differ in the last bits between thread counts as they do between batch shapes.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import torch

TRIAL_BLOCK = 4  # steps per block of one thread count; its first step is not timed
TRIAL_ROUNDS = 3  # blocks of each count per measurement, at most
TRIAL_STEPS = 2 * TRIAL_BLOCK * TRIAL_ROUNDS
CLEAR_WIN = 1.25  # after one block of each, a count this much faster is kept at once
ONE_THREAD_MARGIN = 1.02  # one thread wins unless every thread is >2% faster
REFRESH_STEPS = 2000  # steps of one size between measurements
MIN_SIZE_BITS = 6  # steps of under 64 tokens are one size (decodes of small batches)
SWITCH_S = 0.01  # the most a change of thread count adds to the step after it


def tunable_threads() -> bool:
    """More than one thread, and torch's OpenMP backend: its thread count may change
    between steps (the native backend's pool is fixed once parallel work has started,
    and warns at every attempt)."""
    return (torch.get_num_threads() > 1
            and "parallel backend: OpenMP" in torch.__config__.parallel_info())


@dataclass
class _Size:
    """One step size's measurement in progress, or its choice."""

    key: int  # its tokens' bit length
    trial_step: int = 0  # position in the interleaved trial schedule
    samples: dict[int, list[float]] = field(default_factory=dict)  # threads -> seconds
    choice: int | None = None
    steps_since_choice: int = 0


class ThreadTuner:
    def __init__(self, max_threads: int) -> None:
        self.max_threads = max_threads
        self._sizes: dict[int, _Size] = {}  # by num_tokens' bit length
        self._current: tuple[_Size, int, bool] | None = None  # (size, threads, timed)

    def threads_for(self, num_tokens: int) -> int:
        """The thread count for a step of `num_tokens` tokens; `record` its time."""
        size = self._size(max(num_tokens.bit_length(), MIN_SIZE_BITS))
        self._current = None
        if size.choice is None and size.trial_step % (2 * TRIAL_BLOCK) == 0 \
                and size.trial_step:
            self._maybe_decide(size)
        if size.choice is not None:
            size.steps_since_choice += 1
            if size.steps_since_choice <= REFRESH_STEPS:
                return size.choice
            size.choice, size.trial_step, size.samples = None, 0, {}
        block, offset = divmod(size.trial_step, TRIAL_BLOCK)
        threads = self.max_threads if block % 2 == 0 else 1
        self._current = (size, threads, offset != 0)
        size.trial_step += 1
        return threads

    def record(self, seconds: float) -> None:
        """The time of the step `threads_for` was last asked about (a step that failed
        is never recorded: its trial slot goes untimed)."""
        if self._current is not None:
            size, threads, timed = self._current
            self._current = None
            if timed:
                size.samples.setdefault(threads, []).append(seconds)
            every = size.samples.get(self.max_threads)
            slower = seconds - (0.0 if timed else SWITCH_S)
            if threads == 1 and every and slower >= CLEAR_WIN * statistics.median(every):
                self._choose(size, self.max_threads)

    def _size(self, key: int) -> _Size:
        size = self._sizes.get(key)
        if size is None:  # a new size: what the measured ones imply, if anything
            size = self._sizes[key] = _Size(key)
            if any(k < key and s.choice == self.max_threads for k, s in self._sizes.items()):
                size.choice = self.max_threads
            elif any(k > key and s.choice == 1 for k, s in self._sizes.items()):
                size.choice = 1
        return size

    def _maybe_decide(self, size: _Size) -> None:
        """After each round of the trial: decide if the samples do."""
        every, one = size.samples.get(self.max_threads), size.samples.get(1)
        done = size.trial_step >= TRIAL_STEPS
        if not (every and one):
            if done:  # nothing was timed: keep every thread
                self._choose(size, self.max_threads)
            return
        ratio = statistics.median(one) / statistics.median(every)  # > 1: every is faster
        if ratio >= CLEAR_WIN or (done and ratio > ONE_THREAD_MARGIN):
            self._choose(size, self.max_threads)
        elif ratio <= 1 / CLEAR_WIN or done:
            self._choose(size, 1)

    def _choose(self, size: _Size, threads: int) -> None:
        size.choice, size.steps_since_choice = threads, 0
        for k, other in self._sizes.items():  # the sizes it implies, unless measuring
            if other.choice is not None and ((threads == 1 and k < size.key) or (
                    threads == self.max_threads and k > size.key)):
                other.choice = threads
