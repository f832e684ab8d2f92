"""Checks that run one subprocess and need no engine (mypy, compiling the kernels for
GPUs) start when collection ends, at the lowest CPU priority, and their tests wait for
the result.

The suite runs one test at a time, and most of them wait on engine processes or on
the network, so one of the two cores of CI is idle much of the time. These two checks
cost about 60 s of one core; run in the foreground, they are 60 s of the suite's 15
minutes. Niced to 19 they take only what the tests leave; their tests run last (the
sort is stable), so by then they have finished or the test waits for the rest: never
slower than before.

A job whose test is not selected (`-k`, `--deselect`) never starts; each is stopped,
with its children, when the session ends.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import psutil


class Job:
    """One check's process: `argv(dir)` gives its command line (None: cannot run here,
    which its test reports), `dir` a directory of its own for files it writes, kept
    until the session ends; `result()` waits for it and returns what it printed."""

    registry: ClassVar[list[Job]] = []

    def __init__(self, test: str, argv: Callable[[Path], list[str] | None],
                 cwd: Path | None = None, env: Callable[[Path], dict[str, str]] | None = None
                 ) -> None:
        self.test = test  # the name of the test function that awaits it
        self.argv, self.cwd, self.env = argv, cwd, env
        self.proc: subprocess.Popen[bytes] | None = None
        self.tmp: tempfile.TemporaryDirectory[str] | None = None
        Job.registry.append(self)

    @property
    def dir(self) -> Path:
        assert self.tmp is not None, "the job has not started"
        return Path(self.tmp.name)

    def start(self) -> None:
        if self.proc is not None:
            return
        self.tmp = self.tmp or tempfile.TemporaryDirectory(prefix="pagellm-job-")
        tmp = Path(self.tmp.name)
        argv = self.argv(tmp)
        if argv is None:
            return
        env = self.env(tmp) if self.env is not None else None
        with (tmp / "stdout").open("wb") as out, (tmp / "stderr").open("wb") as err:
            self.proc = subprocess.Popen(argv, cwd=self.cwd, env=env, stdout=out, stderr=err)
        with contextlib.suppress(OSError):  # its children (ptxas) inherit the priority
            os.setpriority(os.PRIO_PROCESS, self.proc.pid, 19)

    def result(self, timeout: float = 600) -> subprocess.CompletedProcess[str] | None:
        """Wait for the job (started now if collection did not); its exit status and
        output, or None where its command is not available."""
        self.start()
        if self.proc is None or self.tmp is None:
            return None
        self.proc.wait(timeout)
        tmp = Path(self.tmp.name)
        return subprocess.CompletedProcess(
            self.proc.args, self.proc.returncode, (tmp / "stdout").read_text(),
            (tmp / "stderr").read_text())

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                family = [psutil.Process(self.proc.pid),
                          *psutil.Process(self.proc.pid).children(recursive=True)]
            except psutil.NoSuchProcess:
                family = []
            for p in family:
                p.kill()
            psutil.wait_procs(family, timeout=10)
        if self.proc is not None:
            self.proc.wait()
        if self.tmp is not None:
            self.tmp.cleanup()
            self.tmp = None


def waiting_tests_last(items: list[Any]) -> None:
    """Reorder `items` (pytest's, in place) so the tests that wait for a job run after
    every other: their jobs get the whole suite to finish on the side."""
    waiting = {job.test for job in Job.registry}
    items.sort(key=lambda item: getattr(item, "originalname", item.name) in waiting)


def start_jobs_of(selected_names: set[str]) -> None:
    """Start the job of every selected test (called when collection ends)."""
    for job in Job.registry:
        if job.test in selected_names:
            job.start()


def stop_all() -> None:
    for job in Job.registry:
        job.stop()
