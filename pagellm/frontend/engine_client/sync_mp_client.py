"""`SyncMPClient`, the engine-core client of `LLM`: a thread reads this client's outputs
into a queue, and utility calls wait on futures in short slices so Ctrl-C gets through
(the handshake, sending and the death watch are `MPClient`'s, in mp_client.py)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from pagellm.frontend.engine_client import mp_client
from pagellm.frontend.engine_client.core_client import (
    UTILITY_TIMEOUT_S,
    EngineDeadError,
    SyncEngineCoreClient,
)
from pagellm.frontend.engine_client.engine_process import EngineProcess
from pagellm.frontend.engine_client.mp_client import MPClient
from pagellm.protocol.engine_args import EngineArgs
from pagellm.protocol.messages import EngineCoreOutputs, RequestType, UtilityMethod
from pagellm.transport.curve import CurveClientKeys

_SIGNAL_CHECK_S = 0.2  # how often a blocked caller lets signal handlers (Ctrl-C) run


class SyncMPClient(MPClient, SyncEngineCoreClient):
    """For `LLM`: a thread reads this client's outputs into a queue."""

    def __init__(self, args: EngineArgs | None, engine_address: str | None = None,
                 curve: CurveClientKeys | None = None, *, process: EngineProcess | None = None,
                 label: str | None = None, on_dead: Callable[[str], None] | None = None,
                 outputs: queue.Queue[EngineCoreOutputs | EngineDeadError] | None = None
                 ) -> None:
        # `outputs`: a queue shared with other clients (data parallel: one queue for all
        # the engine cores' outputs, which is all `get_output` needs).
        self._outputs: queue.Queue[EngineCoreOutputs | EngineDeadError] = \
            queue.Queue() if outputs is None else outputs
        self._calls: dict[int, concurrent.futures.Future[EngineCoreOutputs]] = {}
        super().__init__(args, engine_address, curve, process=process, label=label,
                         on_dead=on_dead)
        self._reader = threading.Thread(target=self._read_outputs, name="engine-outputs",
                                        daemon=True)
        self._start_poller(self._reader)

    def get_output(self) -> EngineCoreOutputs:
        item = _interruptible(self._outputs.get)
        if isinstance(item, EngineDeadError):
            self._outputs.put(item)  # every later call fails the same way
            raise item
        return item

    def call_utility(self, method: UtilityMethod, *args: Any,
                     timeout: float | None = UTILITY_TIMEOUT_S) -> Any:
        call = self.start_utility(method, *args)
        return self.finish_utility(method, call, timeout)

    def start_utility(self, method: UtilityMethod, *args: Any
                      ) -> tuple[int, concurrent.futures.Future[EngineCoreOutputs]]:
        """Send a utility call without waiting (a data-parallel client sends to every
        engine core first, then waits for all: a pause reaches them all at once)."""
        request = self._utility_request(method, args)
        future: concurrent.futures.Future[EngineCoreOutputs] = concurrent.futures.Future()
        self._calls[request.call_id] = future
        self._send(RequestType.UTILITY, request)
        return request.call_id, future

    def finish_utility(self, method: UtilityMethod,
                       call: tuple[int, concurrent.futures.Future[EngineCoreOutputs]],
                       timeout: float | None = UTILITY_TIMEOUT_S) -> Any:
        """Wait for the result of `start_utility`'s call."""
        call_id, future = call
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:  # short waits: Ctrl-C must reach a caller blocked here
                outputs = future.result(timeout=_SIGNAL_CHECK_S)
                break
            except concurrent.futures.TimeoutError:
                if deadline is not None and time.monotonic() > deadline:
                    self._calls.pop(call_id, None)
                    raise TimeoutError(f"engine core utility call {method.name.lower()} "
                                       f"timed out after {timeout} s") from None
        return self._utility_result(method, outputs)

    def _read_outputs(self) -> None:
        last_seen = time.monotonic()
        while not self._closed and self.dead_error is None:
            try:
                if not self.output.poll(100):
                    # (read through the module: tests shorten it)
                    if time.monotonic() - last_seen > mp_client.HEARTBEAT_TIMEOUT_S:
                        self._on_silence()
                    continue
                outputs = self._decoder.decode(self.output.recv())
            except zmq.ZMQError:
                return  # the context was closed under us: shutting down
            last_seen = time.monotonic()
            self._check_outputs(outputs)
            if outputs.utility_output is not None:
                future = self._calls.pop(outputs.utility_output.call_id, None)
                if future is not None:
                    future.set_result(outputs)
            if outputs.has_outputs:
                self._outputs.put(outputs)

    def _notify_dead(self, cause: str) -> None:
        self._outputs.put(EngineDeadError(cause))
        for future in list(self._calls.values()):
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                future.set_exception(EngineDeadError(cause))
        self._calls.clear()

    def shutdown(self) -> None:
        if self._closed:
            return
        super().shutdown()
        # A caller still waiting for outputs (a generate in another thread) wakes now;
        # else it waited forever, and so did its process at exit.
        self._outputs.put(EngineDeadError("the engine-core client was shut down"))


def _interruptible(get: Any) -> Any:
    """queue.get() that lets signal handlers (Ctrl-C) run: a signal the kernel hands to
    another thread only runs once the main thread executes bytecode again."""
    while True:
        try:
            return get(timeout=_SIGNAL_CHECK_S)
        except queue.Empty:
            continue
