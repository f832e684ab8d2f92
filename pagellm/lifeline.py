"""Lifelines: a pipe whose write end a parent holds and whose read end its child
watches. The kernel closes the write end however the parent dies (SIGKILL included), so
EOF on the read end is the one sure sign that the parent is gone."""

from __future__ import annotations

import os


def wait_for_eof(fd: int) -> None:
    """Block until the write end of pipe `fd` is closed everywhere."""
    while True:
        try:
            if not os.read(fd, 1):
                return
        except InterruptedError:
            continue
        except OSError:
            return
