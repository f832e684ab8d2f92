"""`ServingState`: whether the engine core serves, and if not, why. It holds what vLLM's
RL controls set (docs/ARCHITECTURE.md, "Sleep, pause and weight updates"): a pause and
its mode, the sleep level, the checkpoint tensors still missing after a wake from level
2, and the weight-update round with the version it ended on.

State and the words for it only: `EngineCore` does each transition's work on the
scheduler and the executor, and asks this class whether to take requests and schedule.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

from pagellm.protocol.utility import PauseMode

logger = logging.getLogger("pagellm")


class ServingState:
    def __init__(self) -> None:
        # None while scheduling, else the PauseMode. Requests that arrive while paused in
        # mode "keep" join the scheduler's waiting queue, which is not scheduled until
        # resume; in the other modes they fail.
        self.paused: PauseMode | None = None
        self.sleep_level = 0  # the deepest since the last resume (0: a pause, or awake)
        self.updating = False  # between start_weight_update and finish_weight_update
        # (checkpoint tensors not loaded since a wake from sleep level 2, of how many):
        # while any is missing, requests are refused and none is scheduled.
        self.unloaded_weights = (0, 0)
        self.weight_version: str | None = None

    def refuses_requests(self) -> bool:
        """New requests fail now rather than wait (under pause mode "keep" they wait)."""
        return self.paused not in (None, "keep") or bool(self.unloaded_weights[0])

    def schedules(self) -> bool:
        return self.paused != "keep" and not self.unloaded_weights[0]

    def is_paused(self) -> bool:
        return self.paused is not None

    def pause(self, mode: PauseMode) -> None:
        self.paused = mode

    def resume(self) -> None:
        self.paused, self.sleep_level = None, 0

    def check_still_paused(self) -> None:
        """A pause (or sleep) in mode "wait" answers once its requests are done; if
        something resumed the engine before that, its caller must not hear "paused"."""
        if self.paused is None:
            raise RuntimeError("the engine was resumed (wake_up or resume_generation) "
                               "before the pause settled: it is not paused, nothing was "
                               "freed")

    def describe(self, asleep: Collection[str]) -> str:
        """What the engine does instead of serving, `asleep` naming the memory freed."""
        freed = ", ".join(sorted(asleep))
        if freed:
            return f"the engine is sleeping (level {self.sleep_level}: {freed} freed)"
        return f"the engine is paused (mode {self.paused!r})"

    def refusal(self, asleep: Collection[str]) -> str:
        """Why a new request is refused (`refuses_requests()`), and what serves again."""
        missing, total = self.unloaded_weights
        if missing and self.paused is None:
            return (f"request refused: the weights were discarded by sleep(level=2) and "
                    f"{missing} of {total} checkpoint tensors have not been loaded since; "
                    f"requests are served again once update_weights (or a worker "
                    f"extension's load_weights) has loaded them all")
        action = "wake_up()" if self.sleep_level or asleep else "resume_generation()"
        return (f"request refused: {self.describe(asleep)}; requests are served again "
                f"after {action}")

    def count_unloaded(self, unloaded: tuple[int, int]) -> None:
        """The executor's count after a call that may have loaded weights, or woken them
        empty; logged when it starts or stops refusing requests."""
        before = self.unloaded_weights[0]
        self.unloaded_weights = unloaded
        missing, total = unloaded
        if missing and not before:
            logger.warning("woke from sleep level 2 with no weights: requests are refused "
                           "until all %d checkpoint tensors are loaded (update_weights, or "
                           "an extension's load_weights)", total)
        elif before and not missing:
            logger.info("every weight loaded since the level-2 wake: serving again")

    def start_weight_update(self) -> None:
        if self.updating:
            raise RuntimeError("a weight update is already in progress")
        self.updating = True

    def finish_weight_update(self, weight_version: str | None) -> None:
        if not self.updating:
            raise RuntimeError("no weight update in progress: start_weight_update first")
        self.updating, self.weight_version = False, weight_version
