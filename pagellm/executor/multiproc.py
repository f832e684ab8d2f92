"""Tensor parallelism across processes: one worker process per rank.

    engine-core process                            worker processes, ranks 0..N-1
    MultiprocExecutor                              (python -m pagellm.executor.worker_proc)
      XPUB ── [seq, method, msgpack args] ───▶ SUB   every rank gets every call once
      PULL ◀── [reply header, msgpack result] ── PUSH  every rank answers every call
      TCPStore: torch.distributed's rendezvous ◀─ every rank: the broadcast and reply
                                                  endpoints, then the ranks' own gloo
                                                  (CPU) / NCCL (CUDA) process group

The engine core is not a rank: it sends each step's `SchedulerOutput` once, encoded
once (msgspec, no pickle), and takes rank 0's `ModelRunnerOutput`. The ranks exchange
activations among themselves (executor/model/parallel.py). Workers on this node are children
of the engine core, each holding a lifeline pipe whose end of file (our exit, however
abrupt) makes it exit. Workers on other nodes (`--nnodes`, launched by `python -m
pagellm.enginecore --headless` there) find the engine core through the store at
--master-addr:--master-port and exit when its broadcast socket disconnects. A dead rank
is an error naming it: during a call at once, between calls from a watcher thread
(`on_failure`), so the engine core stops within a poll interval either way.

Multi-node traffic (the store, these sockets, gloo/NCCL) is unauthenticated, as
torch.distributed's is: run it on a trusted network.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import psutil
import zmq

from pagellm.executor.executor import Executor
from pagellm.executor.worker.worker import StepFailed
from pagellm.protocol.engine_args import EngineArgs, usable_cpus
from pagellm.protocol.lora import LoRARequest
from pagellm.protocol.scheduling import ModelRunnerOutput, SchedulerOutput
from pagellm.protocol.utility import WeightUpdate

logger = logging.getLogger("pagellm")

STARTUP_TIMEOUT_S = 600.0  # loading weights; other nodes' workers joining
GROUP_TIMEOUT_S = 600.0  # a collective that waits longer than this fails
ERROR_GRACE_S = 2.0  # after one rank failed a call, how long the others may take
SHUTDOWN_WAIT_S = 5.0  # then SIGKILL
_POLL_MS = 100  # how often a waiting executor looks at its workers' health

# Worker methods the executor calls, with their argument tuples (decoded typed).
CALL_TYPES: dict[str, Any] = {
    "execute_model": tuple[SchedulerOutput],
    "kv_cache_budget": tuple[()],
    "initialize_kv_cache": tuple[int],
    "sleep": tuple[int],
    "wake_up": tuple[list[str]],
    "update_weights": tuple[WeightUpdate],
    "init_weight_transfer_engine": tuple[dict[str, Any]],
    "weight_transfer_joined": tuple[()],
    "unloaded_weights": tuple[()],
    "abandon_weight_transfer": tuple[()],
    "collective_rpc": tuple[str, list[Any], dict[str, Any]],
    "retain_requests": tuple[list[str]],
    "add_lora": tuple[LoRARequest, dict[str, Any] | None, WeightUpdate | None],
    "remove_lora": tuple[int],
    "list_loras": tuple[()],
    "shutdown": tuple[()],
}
_RESULT_DECODERS = {m: msgspec.msgpack.Decoder(t) for m, t in (
    ("execute_model", ModelRunnerOutput), ("kv_cache_budget", tuple[int, str, int]))}
_ANY_DECODER = msgspec.msgpack.Decoder()
# Errors re-raised with their own type on the engine core's side.
_ERROR_TYPES: dict[str, type[Exception]] = {
    e.__name__: e for e in (ValueError, TypeError, FileNotFoundError, MemoryError,
                            RuntimeError, StepFailed)}
SEQ = struct.Struct("<Q")


class Reply(msgspec.Struct, array_like=True):
    """A worker's answer to call `seq` (0: its start-up); no error_type means success,
    and the result follows in the next frame."""

    seq: int
    rank: int
    error_type: str | None = None
    message: str = ""


class WorkerDied(RuntimeError):
    """A tensor-parallel worker died or stopped answering: the engine cannot go on."""


class MultiprocExecutor(Executor):
    """Workers in processes of their own, one per tensor-parallel rank."""

    def __init__(self, args: EngineArgs, on_failure: Callable[[str], None] | None = None
                 ) -> None:
        self._on_failure = on_failure
        self._procs: dict[int, subprocess.Popen[bytes]] = {}  # rank -> local worker
        self._lifelines: list[int] = []
        self._seq = 0
        self._failure: str | None = None
        self._stop_watch = threading.Event()
        self._watcher: threading.Thread | None = None
        self._tmpdir = tempfile.mkdtemp(prefix="pagellm-tp-")
        self._ctx = zmq.Context()
        self._ctx.setsockopt(zmq.LINGER, 0)
        try:
            super().__init__(args)
        except BaseException:
            self._stop_workers()
            raise

    # -- start-up --------------------------------------------------------------------

    def _start_workers(self, args: EngineArgs) -> None:
        import torch.distributed as dist

        self.world_size = args.tensor_parallel_size
        host, multinode = self._rendezvous_host(args)
        self._store = dist.TCPStore(host, args.master_port if args.nnodes > 1 else 0,
                                    is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S))
        self._calls = self._ctx.socket(zmq.XPUB)
        self._calls.setsockopt(zmq.XPUB_VERBOSE, 1)  # one message per subscriber
        self._calls.setsockopt(zmq.SNDHWM, 0)
        self._replies = self._ctx.socket(zmq.PULL)
        endpoints = []
        for sock, name in ((self._calls, "calls"), (self._replies, "replies")):
            if multinode:
                port = sock.bind_to_random_port(f"tcp://{host}")
                endpoints.append(f"tcp://{host}:{port}")
            else:
                endpoints.append(f"ipc://{self._tmpdir}/{name}")
                sock.bind(endpoints[-1])
        self._store.set("pagellm/calls", endpoints[0])
        self._store.set("pagellm/replies", endpoints[1])
        self._disconnects = self._replies.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        started = self._launch(args, host, self._store.port)
        self._wait_ready()
        self._remove_socket_dir()
        self._watcher = threading.Thread(target=self._watch, name="tp-watcher", daemon=True)
        self._watcher.start()
        logger.info("tensor parallel: %d workers ready (%s)", self.world_size, started)

    def _rendezvous_host(self, args: EngineArgs) -> tuple[str, bool]:
        """Where the store and the call sockets listen, and whether workers may be on
        other hosts (then TCP on that address, else ipc:// sockets)."""
        if args.nnodes > 1:
            return args.master_addr, True
        return "127.0.0.1", False

    def _launch(self, args: EngineArgs, host: str, port: int) -> str:
        """Start this node's workers (node 0: ranks 0..per_node-1; the other nodes'
        are started there, `--headless`); what was started, for the log."""
        per_node = self.world_size // args.nnodes
        for local_rank in range(per_node):
            self._spawn(args, local_rank, host, port, per_node)
        return f"{per_node} on this node"

    def _remove_socket_dir(self) -> None:
        """Once every local worker is connected, the ipc socket files are not needed
        (established connections stay up without them): remove them, so that nothing
        stays in /tmp even if the engine core is killed (multi-node: tcp, the directory
        is empty)."""
        shutil.rmtree(self._tmpdir, ignore_errors=True)

    def _spawn(self, args: EngineArgs, rank: int, host: str, port: int, per_node: int
               ) -> None:
        read, write = os.pipe()
        self._procs[rank] = spawn_worker(args, rank, rank, host, port, per_node, read)
        os.close(read)
        self._lifelines.append(write)

    def _wait_ready(self) -> None:
        """Every rank's start-up reply, and every rank subscribed to the calls."""
        ready: set[int] = set()
        subscribed = 0
        poller = zmq.Poller()
        poller.register(self._replies, zmq.POLLIN)
        poller.register(self._calls, zmq.POLLIN)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while len(ready) < self.world_size or subscribed < self.world_size:
            self._check_alive()
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.world_size)) - ready)
                raise WorkerDied(f"tensor-parallel rank(s) {missing} did not start within "
                                 f"{STARTUP_TIMEOUT_S:.0f} s")
            events = dict(poller.poll(_POLL_MS))
            if self._calls in events:
                subscribed += self._calls.recv().startswith(b"\x01")
            if self._replies in events:
                frames = self._replies.recv_multipart()
                reply = msgspec.msgpack.decode(frames[0], type=Reply)
                if reply.error_type is not None:
                    raise _ERROR_TYPES.get(reply.error_type, RuntimeError)(
                        f"tensor-parallel rank {reply.rank}: {reply.message}")
                ready.add(reply.rank)

    # -- calls -----------------------------------------------------------------------

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        t0 = time.perf_counter()
        output = super().execute_model(scheduler_output)
        busy = output.prepare_inputs_s + output.forward_s + output.sample_s
        output.dispatch_s = max(0.0, time.perf_counter() - t0 - busy)
        return output

    def _run(self, method: str, *args: Any) -> list[Any]:
        if self._failure is not None:
            raise WorkerDied(self._failure)
        self._seq += 1
        self._calls.send_multipart([SEQ.pack(self._seq), method.encode(),
                                    msgspec.msgpack.encode(args)])
        results: list[Any] = [None] * self.world_size
        errors: dict[int, Reply] = {}
        pending = set(range(self.world_size))
        decoder = _RESULT_DECODERS.get(method, _ANY_DECODER)
        grace: float | None = None
        while pending:
            if self._replies.poll(_POLL_MS):
                frames = self._replies.recv_multipart()
                reply = msgspec.msgpack.decode(frames[0], type=Reply)
                if reply.seq != self._seq or reply.rank not in pending:
                    continue  # a late answer to a call that already failed
                pending.discard(reply.rank)
                if reply.error_type is not None:
                    errors[reply.rank] = reply
                    grace = grace or time.monotonic() + ERROR_GRACE_S
                elif len(frames) > 1 and frames[1]:
                    results[reply.rank] = decoder.decode(frames[1])
            else:
                self._check_alive()
            if grace is not None and pending and time.monotonic() > grace:
                rank, first = next(iter(errors.items()))
                raise WorkerDied(f"tensor-parallel rank {rank} failed {method}: "
                                 f"{first.error_type}: {first.message}; rank(s) "
                                 f"{sorted(pending)} did not answer")
        if errors:
            rank, first = min(errors.items())
            if method == "execute_model" and (len(errors) < self.world_size or any(
                    e.error_type != "StepFailed" for e in errors.values())):
                # Some ranks finished the step and some did not: they no longer agree.
                raise WorkerDied(f"tensor-parallel rank {rank} failed the step: "
                                 f"{first.error_type}: {first.message}")
            raise _ERROR_TYPES.get(first.error_type or "", RuntimeError)(
                f"tensor-parallel rank {rank}: {first.message}")
        return results

    # -- health ------------------------------------------------------------------------

    def _check_alive(self) -> None:
        """Raise WorkerDied naming the first dead local worker (or a lost remote one)."""
        if self._failure is None:
            self._failure = self._find_failure()
        if self._failure is not None:
            raise WorkerDied(self._failure)

    def _find_failure(self) -> str | None:
        for rank, proc in self._procs.items():
            code = proc.poll()
            if code is not None:
                how = (f"killed by {signal.Signals(-code).name}" if code < 0
                       else f"exited with code {code}")
                return f"tensor-parallel worker rank {rank} (pid {proc.pid}) {how}"
            if _stopped(proc.pid):  # every collective would wait for it, forever
                return (f"tensor-parallel worker rank {rank} (pid {proc.pid}) is stopped "
                        "(SIGSTOP): every step would wait for it")
        return None

    def _watch(self) -> None:
        """Between calls: a local worker's death, or a disconnection (a worker on
        another node), is reported through `on_failure` within a poll interval."""
        while not self._stop_watch.wait(_POLL_MS / 1000):
            failure = self._find_failure()
            if failure is None and self._disconnects.poll(0):
                self._disconnects.recv_multipart()
                time.sleep(0.2)  # a local worker's exit shows in poll() shortly after
                failure = self._find_failure() or (
                    "a tensor-parallel worker disconnected (on another node, or it hung up)")
            if failure is not None:
                self._failure = failure
                logger.error("%s", failure)
                if self._on_failure is not None:
                    self._on_failure(failure)
                return

    # -- shutdown ----------------------------------------------------------------------

    def shutdown(self) -> None:
        self._stop_watch.set()
        if self._watcher is not None:
            self._watcher.join(timeout=1)
        if self._failure is None:
            with contextlib.suppress(Exception):
                self._run("shutdown")
        self._stop_workers()

    def _stop_workers(self) -> None:
        """Every local worker stopped and reaped, sockets and files gone; idempotent."""
        self._stop_watch.set()
        for fd in self._lifelines:  # EOF: they exit on their own
            with contextlib.suppress(OSError):
                os.close(fd)
        self._lifelines = []
        stop_processes(list(self._procs.values()), SHUTDOWN_WAIT_S)
        self._ctx.destroy(linger=0)
        shutil.rmtree(self._tmpdir, ignore_errors=True)


def _stopped(pid: int) -> bool:
    """Stopped by a signal (state T), not by a debugger (t: tracing stop)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_STOPPED
    except psutil.Error:
        return False  # gone: poll() says how


def stop_processes(procs: list[subprocess.Popen[bytes]], wait_s: float) -> None:
    """Wait up to `wait_s` for them to exit, SIGTERM, then SIGKILL; reap all. A stopped
    process (SIGSTOP) can neither exit nor take SIGTERM until continued: it is killed
    at once instead of after both waits."""
    for proc in procs:
        if proc.poll() is None and _stopped(proc.pid):
            proc.kill()
    deadline = time.monotonic() + wait_s
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(2)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def spawn_worker(args: EngineArgs, rank: int, local_rank: int, host: str, port: int,
                 per_node: int, lifeline: int) -> subprocess.Popen[bytes]:
    """Start rank `rank`'s worker process (`python -m pagellm.executor.worker_proc`)."""
    env = dict(os.environ)
    # The node's cores shared among its ranks: oversubscribed OpenMP threads spin.
    threads = int(env.get("OMP_NUM_THREADS") or usable_cpus())
    env["OMP_NUM_THREADS"] = str(max(1, threads // per_node))
    cmd = [sys.executable, "-m", "pagellm.executor.worker_proc", *args.to_cli_args(),
           "--rank", str(rank), "--local-rank", str(local_rank), "--store",
           f"{host}:{port}", "--lifeline-fd", str(lifeline)]
    if threading.current_thread() is threading.main_thread():  # see die_with_parent
        cmd.append("--die-with-parent")
    return subprocess.Popen(cmd, pass_fds=(lifeline,), env=env)
