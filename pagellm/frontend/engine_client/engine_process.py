"""Launch an engine core as a child process, and know why it died.

The child is `python -m pagellm.enginecore` (the standalone engine's own entry point) on an
ipc:// address in a private temporary directory, so no `if __name__ == "__main__"`
guard is needed in user scripts. Two pipes tie it to us: a status pipe, on which it
writes why it could not start, and a lifeline, whose end of file tells it that we are
gone (no orphans even if we are SIGKILLed).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence

import msgspec

from pagellm.protocol.engine_args import RAY_PLACEMENT_GROUP_ENV, EngineArgs, usable_cpus
from pagellm.protocol.messages import READY, StartupFailure

# Start-up failures re-raised in the frontend with their own type (a bad option is a
# ValueError whether the engine core runs here or in a child process).
_ERROR_TYPES: dict[str, type[Exception]] = {
    e.__name__: e for e in (ValueError, TypeError, FileNotFoundError, MemoryError,
                            RuntimeError, NotADirectoryError, PermissionError)}


class EngineStartupError(RuntimeError):
    """Carries the child's failure until it is re-raised with its own type."""

    def __init__(self, message: str, error_type: str) -> None:
        super().__init__(message)
        self.error_type = error_type

    def reraise(self) -> Exception:
        return _ERROR_TYPES.get(self.error_type, RuntimeError)(
            f"engine core failed to start: {self}")


class EngineProcess:
    def __init__(self, args: EngineArgs, address: str | None = None, num_local: int = 1,
                 extra_args: Sequence[str] = ()) -> None:
        """`address`: where it binds (default: ipc:// in a private directory; a headless
        data-parallel node gives tcp://, and its CURVE flags in `extra_args`).
        `num_local` engine cores share this host's CPUs (each takes its own GPUs by its
        data-parallel rank: `executor.worker.device_for`)."""
        self.tmpdir = tempfile.mkdtemp(prefix="pagellm-")
        self.address = address or f"ipc://{self.tmpdir}/engine"
        status_read, status_write = os.pipe()
        lifeline_read, lifeline_write = os.pipe()
        self._lifeline_write: int | None = lifeline_write
        env = dict(os.environ)
        # Every core to the engine (data-parallel engine cores share them): the frontend
        # sleeps in a poll while the engine steps and detokenizes in the gaps, and on two
        # cores the engine's second thread is worth 1.6x its throughput where leaving a
        # core to the frontend gained nothing (BENCHMARKS.md). An explicit
        # OMP_NUM_THREADS (even empty: torch's own default) wins.
        env.setdefault("OMP_NUM_THREADS",
                       str(max(1, usable_cpus() // max(1, num_local))))
        if args.distributed_executor_backend == "ray":
            env.update(ray_context())
        # No drain on SIGTERM: we only stop it once we no longer want its outputs.
        cmd = [sys.executable, "-m", "pagellm.enginecore", *args.to_cli_args(),
               "--address", self.address, "--shutdown-timeout", "0",
               "--status-fd", str(status_write), "--lifeline-fd", str(lifeline_read),
               *extra_args]
        try:
            self.proc = subprocess.Popen(cmd, pass_fds=(status_write, lifeline_read),
                                         env=env)
        except BaseException:  # no child (no interpreter, no fds left): nothing stays
            for fd in (status_read, status_write, lifeline_read, lifeline_write):
                os.close(fd)
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            raise
        os.close(status_write)
        os.close(lifeline_read)
        fcntl.fcntl(status_read, fcntl.F_SETFL, os.O_NONBLOCK)
        self._status_read: int | None = status_read
        self._fd_lock = threading.Lock()  # exit_cause (a watcher thread) vs terminate
        self._failure: EngineStartupError | None = None
        self._status = b""  # what the child wrote on its status pipe so far
        self.pid = self.proc.pid

    def exit_cause(self) -> str | None:
        """None while the process runs; afterwards why it stopped, in words."""
        failure = self.startup_failure()
        if failure is not None:
            return f"{failure.error_type}: {failure}"
        code = self.proc.poll()
        if code is None:
            return None
        if code < 0:
            return f"engine core process (pid {self.pid}) was killed by " \
                   f"{signal.Signals(-code).name}"
        return f"engine core process (pid {self.pid}) exited with code {code}"

    def check_starting(self, label: str = "engine core") -> None:
        """Raise why the process failed to start, if it has: the error its start-up
        raised (the same type, from its status pipe), else how it exited. The one
        check for everyone who waits on a start-up (an `MPClient`, the DP client, a
        headless DP node)."""
        failure = self.startup_failure()
        if failure is not None:
            raise failure.reraise()
        cause = self.exit_cause()
        if cause is not None:
            raise RuntimeError(f"{label} failed to start: {cause}")

    def ready(self) -> bool:
        """Whether the child has said it serves (READY on its status pipe): it binds
        its address before it loads, so a connection accepted there says nothing yet."""
        self._read_status()
        return self._status.startswith(READY)

    def startup_failure(self) -> EngineStartupError | None:
        """What the child wrote on its status pipe once it exited, if anything."""
        if self.proc.poll() is None:
            return None
        if self._failure is not None:
            return self._failure
        self._read_status()
        if self._status and not self._status.startswith(READY):
            with contextlib.suppress(msgspec.DecodeError):
                status = msgspec.msgpack.decode(self._status, type=StartupFailure)
                self._failure = EngineStartupError(status.message, status.error_type)
        return self._failure

    def _read_status(self) -> None:
        """Add what the status pipe holds now to `_status` (non-blocking)."""
        with self._fd_lock:
            if self._status_read is not None:
                with contextlib.suppress(OSError):
                    while chunk := os.read(self._status_read, 1 << 16):
                        self._status += chunk

    def wait_exit(self) -> None:
        """Block until the process has exited, without reaping it.

        Not `Popen.wait()`: that holds the Popen's wait lock while blocked, and a daemon
        thread frozen in it at interpreter exit would deadlock our own `terminate()`.
        """
        if hasattr(os, "pidfd_open"):
            with contextlib.suppress(OSError):
                pidfd = os.pidfd_open(self.pid)
                try:
                    select.select([pidfd], [], [])
                finally:
                    os.close(pidfd)
        while self.proc.poll() is None:  # reaps without blocking on the wait lock
            time.sleep(0.01)

    def remove_socket_dir(self) -> None:
        """Once connected, the socket files are not needed: remove them, so that nothing
        stays in /tmp even if this process and the engine are both killed."""
        shutil.rmtree(self.tmpdir, ignore_errors=True)

    def terminate(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `timeout_s`; reap; remove the temporary files."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        with self._fd_lock:
            for fd in (self._status_read, self._lifeline_write):
                if fd is not None:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            self._status_read = self._lifeline_write = None
        shutil.rmtree(self.tmpdir, ignore_errors=True)


def ray_context() -> dict[str, str]:
    """What an engine core with Ray workers needs from this process, if it runs inside
    Ray (an OpenRLHF or verl actor): the cluster's address and the placement group it
    was started in, which the engine-core process, no Ray worker itself, cannot see.
    Ray is only looked at when this process already imported and initialized it."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return {}
    context = {"RAY_ADDRESS": os.environ.get("RAY_ADDRESS")
               or ray.get_runtime_context().gcs_address}
    group = ray.util.get_current_placement_group()
    if group is not None:
        context[RAY_PLACEMENT_GROUP_ENV] = group.id.hex()
    return context
