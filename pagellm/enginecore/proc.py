"""`EngineCoreProc`: the engine core as a process, served over ZeroMQ.

    frontend(s)                                 engine-core process
    DEALER ── HELLO / ADD / ABORT / ─────▶ ROUTER  (the one address a supervisor
              UTILITY / BYE                         configures): input thread — who sent
                                                    it (the connection), decode ─▶ queue
                                                    (InputReceiver, input_receiver.py)
                                                busy loop (main thread): step ◀──────┘
    PULL ◀─── EngineCoreOutputs ────────── PUSH    output thread: outputs by client,
              (one PUSH per client)                 encode, send, heartbeats; watches
                                                    each client's output connection
                                                    (OutputSender, output_sender.py)

This module is the busy loop and the process around it: signals (the first SIGTERM or
SIGINT drains for up to `shutdown_timeout` seconds, a second stops now), the launching
frontend's lifeline, utility calls (a pause in mode "wait" is answered once it
settles), and the load every message carries. Everything a client can make the engine
hold is bounded: the number of clients and the size of a message (input_receiver.py),
the outputs queued for a client that stops reading and the time a client has to
connect its output socket (output_sender.py). An I/O thread that dies takes the engine
down with a message to every client, never leaving a process that heartbeats but is
deaf.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable
from types import FrameType
from typing import Any

import msgspec
import zmq

from pagellm.enginecore.core import Deferred, EngineCore
from pagellm.enginecore.input_receiver import (
    Abort,
    Add,
    ClientGone,
    InputReceiver,
    ThreadDied,
    Utility,
)
from pagellm.enginecore.output_sender import OutputSender, last_word
from pagellm.lifeline import wait_for_eof
from pagellm.logger import freeze_startup_heap
from pagellm.protocol.engine_args import EngineArgs
from pagellm.protocol.messages import (
    EngineCoreOutputs,
    UtilityMethod,
    UtilityOutput,
    UtilityRequest,
)
from pagellm.transport.sockets import SocketFactory

logger = logging.getLogger("pagellm")

_SIGNAL_CHECK_S = 0.2  # how often an idle busy loop lets signal handlers run
GRAMMAR_READY = object()  # a queue item that only wakes the loop
_DEFERRED_POLL_S = 0.02  # ... and looks at a call that waits off the loop (a join)
SHUTDOWN_GRACE_S = 15.0  # after this long in the final shutdown the process exits anyway


class ShutdownRequested(BaseException):
    """Raised in the main thread by a second SIGTERM / SIGINT: stop now (a
    BaseException, so that no `except Exception` on the way swallows it)."""


class EngineThreadDied(Exception):
    """An I/O thread of the engine core, or a tensor-parallel worker, died."""


class EngineCoreProc:
    def __init__(self, args: EngineArgs, sockets: SocketFactory, frontends: zmq.Socket,
                 lifeline_fd: int | None = None, shutdown_timeout: float = 0.0) -> None:
        """`sockets` and `frontends` (the ROUTER at the engine's address) are made by
        the entry point before the model loads (`transport.bind_frontends`); the engine
        owns them from here on."""
        self.address = sockets.address
        self.shutdown_timeout = shutdown_timeout
        self.sockets = sockets
        self.input_queue: queue.Queue[Any] = queue.Queue()
        # A tensor-parallel worker that dies between steps stops the busy loop too.
        self.core = EngineCore(args, on_failure=lambda m: self.input_queue.put(ThreadDied(m)))
        # A grammar compiled: wake the loop if it waits for input (the item does nothing).
        self.core.structured.on_ready = lambda: self.input_queue.put(GRAMMAR_READY)
        self._stop_requested: float | None = None  # when the first SIGTERM/SIGINT came
        # Utility calls answered once a pause in mode "wait" settles.
        self._deferred: list[tuple[int, UtilityRequest, Deferred]] = []
        self.output_s = 0.0  # mean time the busy loop spends sending a step's outputs
        # (the output thread drops a client that stops reading: the input side forgets it)
        self.outputs = OutputSender(self._stamp, lambda index: self.inputs.forget_client(index))
        self.inputs = InputReceiver(self.core, self.sockets, frontends, self.input_queue,
                                    self.outputs)
        # (waiting, running, ADDs handled per client) as the busy loop last saw them, one
        # tuple replaced whole: every message carries its client's part, plus the ADDs
        # the input thread refused (a data-parallel frontend routes by it). Each count
        # has one writer; a client's entries go when it does.
        self._adds_handled: dict[int, int] = {}  # busy loop (the input thread: adds_refused)
        self.load: tuple[int, int, dict[int, int]] = (0, 0, {})
        # When the busy loop last went round (or waited, idle): messages carry how long
        # ago (`loop_busy_s`), so a loop blocked in one call shows though heartbeats flow.
        self.loop_turned = time.monotonic()
        self.threads = [self._thread(self.inputs.run, "input"),
                        self._thread(self.outputs.run, "output")]
        if lifeline_fd is not None:
            self.threads.append(threading.Thread(target=_watch_lifeline, args=(lifeline_fd,),
                                                 name="engine-lifeline", daemon=True))

    # -- the busy loop ---------------------------------------------------------------

    def run(self) -> int:
        """Serve until SIGTERM/SIGINT (exit 0, after draining for up to
        `shutdown_timeout` seconds) or a failure in the loop (exit 1)."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        freeze_startup_heap("engine core")  # with one object per KV block: 500 000+
        for thread in self.threads:
            thread.start()
        logger.info("engine core ready at %s", self.address)
        code, message = 0, "engine core shut down"
        try:
            while not self._drained():
                self.loop_turned = time.monotonic()
                self._handle_inputs(block=not self.core.has_work())
                if self.core.has_work():
                    outputs = self.core.step()
                    self.loop_turned = time.monotonic()  # back from the step
                    self._save_load()  # before sending: the outputs carry the step's result
                    if outputs:
                        self._hand_out(outputs)
                self._answer_deferred()
                self._save_load()
        except ShutdownRequested:
            logger.info("engine core: stopping now (second signal)")
        except Exception as e:  # the loop's failure is every client's EngineDeadError
            code, message = 1, f"engine core failed: {type(e).__name__}: {e}"
            logger.error("%s\n%s", message, traceback.format_exc())
        self._shutdown(message)
        return code

    def _save_load(self) -> None:
        """The load the next messages carry. Saved after a step, before its outputs go
        out: stamped with the load before the step, a request's last output said it was
        still running, and a data-parallel frontend counted it until the core's next
        message."""
        self.load = (self.core.num_waiting, self.core.scheduler.num_running,
                     self._adds_handled.copy())

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._stop_requested is not None:
            raise ShutdownRequested(signal.Signals(signum).name)
        self._stop_requested = time.monotonic()
        self.inputs.accepting.clear()  # new requests and frontends are refused from now on
        logger.info("engine core: %s, draining for up to %.0f s", signal.Signals(signum).name,
                    self.shutdown_timeout)

    def _drained(self) -> bool:
        """After a stop signal: True once nothing runs, or the drain time is up."""
        if self._stop_requested is None:
            return False
        timed_out = time.monotonic() - self._stop_requested >= self.shutdown_timeout
        if timed_out and self.core.scheduler.has_unfinished_requests():
            logger.warning("engine core: shutdown timeout; aborting %d unfinished request(s)",
                           len(self.core.scheduler.requests))
        return timed_out or not self.core.has_work()

    def _handle_inputs(self, block: bool) -> None:
        """Handle what the input thread queued; with `block`, first wait for something
        (only a slice of time while a deferred call waits for something else than a
        step: a join of the trainer's group is polled)."""
        item = None
        while block and item is None and self._stop_requested is None:
            self.loop_turned = time.monotonic()  # idle is not stalled
            # Wake now and then: a signal the kernel hands to another thread only runs
            # its Python handler once the main thread runs bytecode again.
            try:
                item = self.input_queue.get(
                    timeout=_DEFERRED_POLL_S if self._deferred else _SIGNAL_CHECK_S)
            except queue.Empty:
                if self._deferred:
                    return
        while True:
            if item is not None:
                self._handle(item)
            try:
                item = self.input_queue.get_nowait()
            except queue.Empty:
                return

    def _handle(self, item: Any) -> None:
        if isinstance(item, ThreadDied):
            raise EngineThreadDied(item.message)
        try:
            if isinstance(item, Add):
                client = item.request.client_index  # counted even if the add fails
                self._adds_handled[client] = self._adds_handled.get(client, 0) + 1
                self.core.add_preprocessed(item.request)
            elif isinstance(item, Abort):
                self.core.abort_requests(item.request_ids, item.client)
            elif isinstance(item, Utility):
                answer = self._call(item.client, item.request)
                self.loop_turned = time.monotonic()  # back from the call
                if answer is not None:
                    self.outputs.send_now({item.client: EngineCoreOutputs(
                        timestamp=time.monotonic(), utility_output=answer)})
            elif isinstance(item, ClientGone):
                self.core.abort_client(item.client)
                self._adds_handled.pop(item.client, None)
        except Exception as e:  # one client's message must not stop the engine
            logger.exception("engine core: could not handle %s", type(item).__name__)
            if isinstance(item, Add):
                self.outputs.fail_request(item.request.client_index, item.request.request_id,
                                          f"{type(e).__name__}: {e}")

    def _call(self, client: int, request: UtilityRequest) -> UtilityOutput | None:
        """Answer a utility call, or (one that completes later: a pause in mode "wait"
        still draining, a weight-transfer join) remember it: `_answer_deferred` answers
        once it is ready."""
        try:
            result = self.core.call_utility(request.method, request.args)
            if isinstance(result, Deferred):
                if not result.ready():
                    self._deferred.append((client, request, result))
                    return None
                result = result.finish()
            return self._result(request, result)
        except Exception as e:
            return UtilityOutput(request.call_id, failure=f"{type(e).__name__}: {e}")

    def _result(self, request: UtilityRequest, result: Any) -> UtilityOutput:
        if request.method == UtilityMethod.GET_STATS:
            result.step_timings.output_s = self.output_s
        return UtilityOutput(request.call_id, result=msgspec.msgpack.encode(result))

    def _hand_out(self, outputs: dict[int, EngineCoreOutputs]) -> None:
        """Send a step's outputs (timed: `StepTimings.output_s`)."""
        start = time.perf_counter()
        self.outputs.send_now(outputs)
        self.output_s = 0.9 * self.output_s + 0.1 * (time.perf_counter() - start)

    def _stamp(self, index: int, outputs: EngineCoreOutputs) -> None:
        """The load every message carries, as client `index` should count it."""
        outputs.num_waiting, outputs.num_running, handled = self.load
        outputs.loop_busy_s = round(max(0.0, time.monotonic() - self.loop_turned), 3)
        outputs.num_adds_taken = handled.get(index, 0) + self.inputs.adds_refused.get(index, 0)

    def _answer_deferred(self) -> None:
        if not self._deferred:
            return
        waiting = []
        for client, request, result in self._deferred:
            try:
                if not result.ready():
                    waiting.append((client, request, result))
                    continue
                output = self._result(request, result.finish())
            except Exception as e:
                output = UtilityOutput(request.call_id, failure=f"{type(e).__name__}: {e}")
            self.outputs.send_now({client: EngineCoreOutputs(
                timestamp=time.monotonic(), utility_output=output)})
        self._deferred = waiting

    def _shutdown(self, message: str) -> None:
        # Whatever hangs below, a supervisor's SIGTERM must end the process.
        watchdog = threading.Timer(SHUTDOWN_GRACE_S, os._exit, args=(1,))
        watchdog.daemon = True
        watchdog.start()
        self.inputs.accepting.clear()
        self.inputs.stopping.set()
        self.outputs.stop(message)
        for thread in self.threads[:2]:
            thread.join(timeout=5)
        if not self.threads[1].is_alive() and not self.outputs.last_word_sent:
            last_word(self.inputs.clients(), message)  # the output thread died: say it here
        self.core.shutdown()
        self.sockets.close()

    def _thread(self, target: Callable[[], None], name: str) -> threading.Thread:
        def run() -> None:
            try:
                target()
            except BaseException as e:  # a dead I/O thread must take the engine down
                message = f"engine core {name} thread failed: {type(e).__name__}: {e}"
                logger.error("%s\n%s", message, traceback.format_exc())
                self.input_queue.put(ThreadDied(message))
        return threading.Thread(target=run, name=f"engine-{name}", daemon=True)

def _watch_lifeline(fd: int) -> None:
    """The frontend that launched us holds the other end of the lifeline."""
    wait_for_eof(fd)
    logger.info("engine core: launching frontend is gone")
    os.kill(os.getpid(), signal.SIGTERM)
