"""Lifelines: a pipe whose write end a parent holds and whose read end its child
watches. The kernel closes the write end however the parent dies (SIGKILL included), so
EOF on the read end is the one sure sign that the parent is gone."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


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


def die_with_parent() -> None:
    """Have the kernel SIGKILL this process when its parent exits (Linux's
    PR_SET_PDEATHSIG; elsewhere nothing). A stopped process (SIGSTOP) never reads its
    lifeline, and one was left behind by its engine core that way; SIGKILL reaches it.
    The kernel ties this to the thread that started the process, so only children
    started by a process's main thread may call it (tensor-parallel workers)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        pass
