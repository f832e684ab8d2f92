"""Logging for entry points: INFO lines such as the KV-cache size at start-up, and a
rate limit on repeated warnings (a flood of bad messages or connections must not turn
into a flood of log lines). Also the one start-up step every long-lived process of
ours takes once it is ready: `freeze_startup_heap`."""

from __future__ import annotations

import gc
import logging
import os
import sys
import threading
import time

logger = logging.getLogger("pagellm")

RATE_LIMIT_WINDOW_S = 5.0


class RateLimitFilter(logging.Filter):
    """Lets a WARNING-or-worse record through at most once per window per message
    template (`record.msg`, before its arguments are filled in); the next one that
    passes says how many were suppressed. INFO and below always pass."""

    def __init__(self, window_s: float = RATE_LIMIT_WINDOW_S) -> None:
        super().__init__()
        self.window_s = window_s
        self._lock = threading.Lock()
        self._last: dict[tuple[str, str], float] = {}
        self._suppressed: dict[tuple[str, str], int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        key = (record.name, str(record.msg))
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(key, -self.window_s) < self.window_s:
                self._suppressed[key] = self._suppressed.get(key, 0) + 1
                return False
            self._last[key] = now
            suppressed = self._suppressed.pop(key, 0)
            if len(self._last) > 10_000:  # templates are few; never grow without bound
                self._last.clear()
        if suppressed:
            record.msg = f"{record.msg} ({suppressed} similar message(s) suppressed)"
        return True


def rate_limit(*logger_names: str) -> None:
    """Put a RateLimitFilter on these loggers (once each)."""
    for name in logger_names:
        target = logging.getLogger(name)
        if not any(isinstance(f, RateLimitFilter) for f in target.filters):
            target.addFilter(RateLimitFilter())


def configure_logging() -> None:
    """INFO to stderr for the `pagellm` logger unless the application configured it
    already; PAGELLM_LOG_LEVEL=WARNING quiets it. Repeated warnings are rate-limited
    either way."""
    rate_limit("pagellm")
    if logger.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(os.environ.get("PAGELLM_LOG_LEVEL", "INFO").upper())
    logger.propagate = False


def freeze_startup_heap(process: str) -> None:
    """Collect, then move every object alive now into the collector's permanent
    generation. What a process holds once it has started (torch, transformers, the
    model, the server's framework: over 400 000 objects) lives as long as it does; left
    to the cyclic collector, each full collection walks it all and stops the process
    for 0.15-0.25 s (measured in the engine core's busy loop and in the server's event
    loop; a tensor-parallel step waits for its slowest rank). vLLM freezes its
    processes' start-up heaps for the same reason. Only for processes we own (engine
    core, tensor-parallel workers, server): in a user's process it would keep their
    garbage forever."""
    gc.collect()
    gc.freeze()
    logger.debug("%s: froze %d start-up objects", process, gc.get_freeze_count())
