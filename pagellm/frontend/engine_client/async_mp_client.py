"""`AsyncMPClient`: the engine-core client of `AsyncLLM` (frontend/engine_client/mp_client.py has
what it shares with `SyncMPClient`: the handshake, sending, the death watch)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from pagellm.frontend.engine_client import mp_client
from pagellm.frontend.engine_client.core_client import (
    UTILITY_TIMEOUT_S,
    AsyncEngineCoreClient,
    EngineDeadError,
)
from pagellm.frontend.engine_client.engine_process import EngineProcess
from pagellm.frontend.engine_client.mp_client import MPClient
from pagellm.protocol.engine_args import EngineArgs
from pagellm.protocol.messages import EngineCoreOutputs, RequestType, UtilityMethod
from pagellm.transport.curve import CurveClientKeys

OutputQueue = asyncio.Queue[EngineCoreOutputs | EngineDeadError]


class LoopQueue:
    """An async client's outputs queue and the tasks that fill it, for whichever event
    loop is running: a client used from a second event loop (`asyncio.run` twice) gets
    a fresh queue and fresh tasks. An engine's death is an item too; taken, it is put
    back, so every waiter sees it. (AsyncMPClient and DPAsyncClient each keep one.)"""

    def __init__(self, start: Callable[[asyncio.AbstractEventLoop, OutputQueue],
                                       list[asyncio.Task[None]]]) -> None:
        self._start = start  # (loop, queue) -> the tasks that fill queue, started in loop
        self.loop: asyncio.AbstractEventLoop | None = None
        self.queue: OutputQueue | None = None
        self._tasks: list[asyncio.Task[None]] = []

    def ensure(self, dead_error: str | None) -> OutputQueue:
        """The running loop's queue, with its tasks started (and the death already
        known, `dead_error`, in it) on first use from that loop."""
        loop = asyncio.get_running_loop()
        if self.queue is None or self.loop is not loop:
            self.loop, self.queue = loop, asyncio.Queue()
            if dead_error is not None:
                self.queue.put_nowait(EngineDeadError(dead_error))
            self._tasks = self._start(loop, self.queue)
        return self.queue

    async def get(self, dead_error: str | None) -> EngineCoreOutputs:
        queue = self.ensure(dead_error)
        item = await queue.get()
        if isinstance(item, EngineDeadError):
            queue.put_nowait(item)
            raise item
        return item

    def run_in_loop(self, fn: Callable[..., object], *args: object) -> None:
        """fn(*args) in the loop's thread: now if that is the caller's, else soon;
        nothing if no loop used the queue yet or it closed (later calls see the state)."""
        loop = self.loop
        if loop is None or loop.is_closed():
            return
        if in_loop(loop):
            fn(*args)
        else:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(fn, *args)

    def cancel(self) -> None:
        """Stop the tasks (shutdown), from any thread."""
        for task in self._tasks:
            self.run_in_loop(task.cancel)


class AsyncMPClient(MPClient, AsyncEngineCoreClient):
    """For `AsyncLLM`: an asyncio task reads this client's outputs through zmq's
    asyncio support (no polling); requests go out on the plain DEALER socket, whose
    sends never block (no high-water mark)."""

    def __init__(self, args: EngineArgs | None, engine_address: str | None = None,
                 curve: CurveClientKeys | None = None, *, process: EngineProcess | None = None,
                 label: str | None = None, on_dead: Callable[[str], None] | None = None
                 ) -> None:
        super().__init__(args, engine_address, curve, process=process, label=label,
                         on_dead=on_dead)
        self._calls: dict[int, asyncio.Future[EngineCoreOutputs]] = {}
        self._outputs = LoopQueue(lambda loop, _: [loop.create_task(
            self._read_outputs(zmq.asyncio.Socket.from_socket(self.output)))])

    async def get_output_async(self) -> EngineCoreOutputs:
        return await self._outputs.get(self.dead_error)

    async def call_utility_async(self, method: UtilityMethod, *args: Any,
                                 timeout: float | None = UTILITY_TIMEOUT_S) -> Any:
        self._outputs.ensure(self.dead_error)  # the reader that answers the call
        request = self._utility_request(method, args)
        future: asyncio.Future[EngineCoreOutputs] = asyncio.get_running_loop().create_future()
        self._calls[request.call_id] = future
        self._send(RequestType.UTILITY, request)
        try:
            outputs = await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"engine core utility call {method.name.lower()} timed out "
                               f"after {timeout} s") from None
        finally:  # timed out or cancelled (a /metrics scrape gave up): answer into the void
            self._calls.pop(request.call_id, None)
        return self._utility_result(method, outputs)

    async def _read_outputs(self, socket: zmq.asyncio.Socket) -> None:
        while not self._closed and self.dead_error is None:
            try:
                try:  # the hot path: a message is there (one await, as a plain recv)
                    data = await socket.recv(flags=zmq.NOBLOCK)
                except zmq.Again:
                    # Not asyncio.wait_for: on Python 3.11 it can swallow a cancellation
                    # that meets a message, and this task would outlive its event loop.
                    ready = await socket.poll(int(mp_client.HEARTBEAT_TIMEOUT_S * 1000))  # POLLIN
                    # A second look: our event loop may be what stalled, not the engine.
                    if not ready and not int(socket.get(zmq.EVENTS)) & zmq.POLLIN:
                        self._on_silence()
                        return
                    continue
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            outputs = self._decoder.decode(data)
            self._check_outputs(outputs)
            if outputs.utility_output is not None:
                future = self._calls.pop(outputs.utility_output.call_id, None)
                if future is not None and not future.done():
                    future.set_result(outputs)
            if outputs.has_outputs and self._outputs.queue is not None:
                self._outputs.queue.put_nowait(outputs)

    def _notify_dead(self, cause: str) -> None:
        self._outputs.run_in_loop(self._wake_all, cause)  # nobody waits yet: dead_error

    def _wake_all(self, cause: str) -> None:
        if self._outputs.queue is not None:
            self._outputs.queue.put_nowait(EngineDeadError(cause))
        for future in self._calls.values():
            if not future.done():
                future.set_exception(EngineDeadError(cause))
        self._calls.clear()

    def shutdown(self) -> None:
        self._outputs.cancel()
        if not self._closed:  # pending utility calls and readers must not wait on
            self._notify_dead("this engine-core client was shut down")
        super().shutdown()


def in_loop(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether the caller runs in `loop`'s thread (its futures may be set directly)."""
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False

