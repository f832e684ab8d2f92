"""`EngineCoreProc`: the engine core as a process, served over ZeroMQ.

    frontend(s)                                 engine-core process
    DEALER ── HELLO / ADD / ABORT / ─────▶ ROUTER  (the one address a supervisor
              UTILITY / BYE                         configures): input thread — who sent
                                                    it (the connection), decode ─▶ queue
                                                busy loop (main thread): step ◀──────┘
    PULL ◀─── EngineCoreOutputs ────────── PUSH    output thread: outputs by client,
              (one PUSH per client)                 encode, send, heartbeats; watches
                                                    each client's output connection
                                                    (OutputSender, output_sender.py)

Who a message comes from is the ROUTER's routing id of the connection it arrived on,
assigned by ZeroMQ (never a field the client writes), so no client can act for
another. A client is told its index and its own output endpoint in READY. Everything
a client can make the engine hold is bounded: the number of clients (MAX_CLIENTS),
the size of a message (MAX_MESSAGE_BYTES), the outputs queued for a client that stops
reading (OUTPUT_HWM: it is dropped), and a client that never connects its output
socket is dropped after CONNECT_GRACE_S. No pickle anywhere; a message that does not
decode is logged (rate-limited) and dropped, a request the engine cannot serve
fails alone with an error output, and a utility call it cannot decode (an unknown
method) is answered with a failure, never left to its caller's timeout. An I/O thread
that dies takes the engine down with a message to every client, never leaving a
process that heartbeats but is deaf.
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
from dataclasses import dataclass
from types import FrameType
from typing import Any, TypeVar

import msgspec
import zmq

from pagellm.enginecore.core import Deferred, EngineCore, RequestRejected
from pagellm.enginecore.output_sender import AttachedClient, OutputSender, last_word
from pagellm.enginecore.request import Request
from pagellm.enginecore.transport import CurveServerKeys, SocketFactory
from pagellm.lifeline import wait_for_eof
from pagellm.logger import freeze_startup_heap
from pagellm.protocol.codec import MsgpackDecoder
from pagellm.protocol.engine_args import EngineArgs
from pagellm.protocol.messages import (
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    HandshakeReply,
    HandshakeRequest,
    RequestType,
    UtilityMethod,
    UtilityOutput,
    UtilityRequest,
)

logger = logging.getLogger("pagellm")
T = TypeVar("T")

MAX_CLIENTS = 64  # frontends attached at once
_POLL_MS = 100  # how often the input thread checks for shutdown
_SIGNAL_CHECK_S = 0.2  # how often an idle busy loop lets signal handlers run
SHUTDOWN_GRACE_S = 15.0  # after this long in the final shutdown the process exits anyway


class ShutdownRequested(BaseException):
    """Raised in the main thread by a second SIGTERM / SIGINT: stop now (a
    BaseException, so that no `except Exception` on the way swallows it)."""


class EngineThreadDied(Exception):
    """An I/O thread of the engine core, or a tensor-parallel worker, died."""


# Items for the busy loop (from the input thread) ------------------------------------
@dataclass
class _Add:
    request: Request  # validated and hashed


@dataclass
class _Abort:
    client: int
    request_ids: list[str]


@dataclass
class _Utility:
    client: int
    request: UtilityRequest


@dataclass
class _ClientGone:
    client: int


@dataclass
class _ThreadDied:
    message: str  # what died and how (an I/O thread, a tensor-parallel worker)


class EngineCoreProc:
    def __init__(self, args: EngineArgs, address: str, curve: CurveServerKeys | None = None,
                 lifeline_fd: int | None = None, shutdown_timeout: float = 0.0) -> None:
        self.address = address
        self.shutdown_timeout = shutdown_timeout
        # Refuses unsafe binds before loading. A launched engine (it has a lifeline) owns
        # its socket directory, the launching frontend's private one.
        self.sockets = SocketFactory(address, curve, owns_directory=lifeline_fd is not None)
        self.input_queue: queue.Queue[Any] = queue.Queue()
        # A tensor-parallel worker that dies between steps stops the busy loop too.
        self.core = EngineCore(args, on_failure=lambda m: self.input_queue.put(_ThreadDied(m)))
        self.frontends, _ = self.sockets.bind(zmq.ROUTER, address, {
            zmq.ROUTER_MANDATORY: 1,  # a reply to a gone peer raises
            zmq.MAXMSGSIZE: MAX_MESSAGE_BYTES})
        self._lock = threading.Lock()  # guards the two maps below
        self._identities: dict[bytes, int] = {}  # connection -> client index
        self._clients: dict[int, AttachedClient] = {}
        self._next_client = 0
        self._accepting = threading.Event()  # cleared while draining for shutdown
        self._accepting.set()
        self._stopping = threading.Event()
        self._stop_requested: float | None = None  # when the first SIGTERM/SIGINT came
        # Utility calls answered once a pause in mode "wait" settles.
        self._deferred: list[tuple[int, UtilityRequest, Deferred]] = []
        self.output_s = 0.0  # mean time the busy loop spends sending a step's outputs
        self.outputs = OutputSender(self._stamp, self._forget_client)
        # (waiting, running, ADDs handled per client) as the busy loop last saw them, one
        # tuple replaced whole: every message carries its client's part, plus the ADDs
        # the input thread refused (a data-parallel frontend routes by it). Each count
        # has one writer; a client's entries go when it does.
        self._adds_handled: dict[int, int] = {}  # busy loop
        self._adds_refused: dict[int, int] = {}  # input thread
        self.load: tuple[int, int, dict[int, int]] = (0, 0, {})
        self.threads = [self._thread(self._input_loop, "input"),
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
                self._handle_inputs(block=not self.core.has_work())
                if self.core.has_work():
                    outputs = self.core.step()
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
        self.load = (self.core.scheduler.num_waiting, self.core.scheduler.num_running,
                     self._adds_handled.copy())

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._stop_requested is not None:
            raise ShutdownRequested(signal.Signals(signum).name)
        self._stop_requested = time.monotonic()
        self._accepting.clear()  # new requests and frontends are refused from now on
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
        item = None
        while block and item is None and self._stop_requested is None:
            # Wake now and then: a signal the kernel hands to another thread only runs
            # its Python handler once the main thread runs bytecode again.
            try:
                item = self.input_queue.get(timeout=_SIGNAL_CHECK_S)
            except queue.Empty:
                continue
        while True:
            if item is not None:
                self._handle(item)
            try:
                item = self.input_queue.get_nowait()
            except queue.Empty:
                return

    def _handle(self, item: Any) -> None:
        if isinstance(item, _ThreadDied):
            raise EngineThreadDied(item.message)
        try:
            if isinstance(item, _Add):
                client = item.request.client_index  # counted even if the add fails
                self._adds_handled[client] = self._adds_handled.get(client, 0) + 1
                self.core.add_preprocessed(item.request)
            elif isinstance(item, _Abort):
                self.core.abort_requests(item.request_ids, item.client)
            elif isinstance(item, _Utility):
                answer = self._call(item.client, item.request)
                if answer is not None:
                    self.outputs.send_now({item.client: EngineCoreOutputs(
                        timestamp=time.monotonic(), utility_output=answer)})
            elif isinstance(item, _ClientGone):
                self.core.abort_client(item.client)
                self._adds_handled.pop(item.client, None)
        except Exception as e:  # one client's message must not stop the engine
            logger.exception("engine core: could not handle %s", type(item).__name__)
            if isinstance(item, _Add):
                self._error_to(item.request.client_index, item.request.request_id,
                               f"{type(e).__name__}: {e}")

    def _call(self, client: int, request: UtilityRequest) -> UtilityOutput | None:
        """Answer a utility call, or (a pause in mode "wait" still draining) remember it:
        `_answer_deferred` answers once the pause has settled."""
        try:
            result = self.core.call_utility(request.method, request.args)
            if isinstance(result, Deferred):
                if not result.settled:
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
        outputs.num_adds_taken = handled.get(index, 0) + self._adds_refused.get(index, 0)

    def _answer_deferred(self) -> None:
        if not self._deferred or not self.core.pause_settled():
            return
        deferred, self._deferred = self._deferred, []
        for client, request, result in deferred:
            try:
                output = self._result(request, result.finish())
            except Exception as e:
                output = UtilityOutput(request.call_id, failure=f"{type(e).__name__}: {e}")
            self.outputs.send_now({client: EngineCoreOutputs(
                timestamp=time.monotonic(), utility_output=output)})

    def _error_to(self, client: int, request_id: str, error: str) -> None:
        """Fail one request that never reached the scheduler."""
        self.outputs.queue_send({client: EngineCoreOutputs(
            [EngineCoreOutput(request_id, [], FinishReason.ERROR, error=error)],
            time.monotonic())})

    def _shutdown(self, message: str) -> None:
        # Whatever hangs below, a supervisor's SIGTERM must end the process.
        watchdog = threading.Timer(SHUTDOWN_GRACE_S, os._exit, args=(1,))
        watchdog.daemon = True
        watchdog.start()
        self._accepting.clear()
        self._stopping.set()
        self.outputs.stop(message)
        for thread in self.threads[:2]:
            thread.join(timeout=5)
        if not self.threads[1].is_alive() and not self.outputs.last_word_sent:
            with self._lock:  # the output thread died: say it from here
                last_word(list(self._clients.values()), message)
        self.core.shutdown()
        self.sockets.close()

    # -- input thread ----------------------------------------------------------------

    def _thread(self, target: Callable[[], None], name: str) -> threading.Thread:
        def run() -> None:
            try:
                target()
            except BaseException as e:  # a dead I/O thread must take the engine down
                message = f"engine core {name} thread failed: {type(e).__name__}: {e}"
                logger.error("%s\n%s", message, traceback.format_exc())
                self.input_queue.put(_ThreadDied(message))
        return threading.Thread(target=run, name=f"engine-{name}", daemon=True)

    def _input_loop(self) -> None:
        decoders = {RequestType.ADD: MsgpackDecoder(EngineCoreRequest),
                    RequestType.ABORT: MsgpackDecoder(list[str]),
                    RequestType.UTILITY: MsgpackDecoder(UtilityRequest),
                    RequestType.HELLO: MsgpackDecoder(HandshakeRequest)}
        while not self._stopping.is_set():
            if not self.frontends.poll(_POLL_MS):
                continue
            frames = self.frontends.recv_multipart()
            try:
                self._on_message(frames, decoders)
            except (msgspec.DecodeError, ValueError) as e:
                logger.warning("engine core: dropped a malformed message: %s", e)
            except Exception as e:  # no message may stop this thread
                logger.exception("engine core: could not handle a message: %s", e)

    def _on_message(self, frames: list[bytes], decoders: dict[RequestType, Any]) -> None:
        if len(frames) != 3:
            raise ValueError(f"expected a type frame and a payload, got {len(frames) - 1} "
                             "frame(s)")
        identity, kind, payload = frames[0], RequestType(frames[1]), frames[2]
        with self._lock:
            client = self._identities.get(identity)
        if kind == RequestType.HELLO:
            self._hello(identity, client, decoders[kind].decode(payload))
            return
        if client is None:
            raise ValueError(f"{kind.name} from a connection that has not attached (HELLO)")
        if kind == RequestType.BYE:
            self._forget_client(client)
            self.outputs.unregister(client)
        elif kind == RequestType.ADD:
            if not self._add(client, payload, decoders[kind]):
                self._adds_refused[client] = self._adds_refused.get(client, 0) + 1
        elif kind == RequestType.ABORT:
            self.input_queue.put(_Abort(client, decoders[kind].decode(payload)))
        else:
            try:
                call = decoders[kind].decode(payload)
            except msgspec.ValidationError as e:  # e.g. a method this engine lacks
                call_id = _first_field(payload, int)
                if call_id is None or not 0 <= call_id < 2**63:
                    raise
                # Answered, or the caller would wait for its own timeout.
                self.outputs.queue_send({client: EngineCoreOutputs(
                    timestamp=time.monotonic(), utility_output=UtilityOutput(
                        call_id, failure=f"invalid utility call: {e}"))})
                return
            self.input_queue.put(_Utility(client, call))

    def _add(self, client: int, payload: bytes, decoder: MsgpackDecoder[Any]) -> bool:
        """Queue the request for the busy loop; False if it was refused here."""
        try:
            request = decoder.decode(payload)
        except msgspec.ValidationError as e:  # e.g. a sampling value out of range
            request_id = _first_field(payload, str)
            if not request_id:
                raise
            self._error_to(client, request_id, f"invalid request: {e}")
            return False
        if not self._accepting.is_set():
            self._error_to(client, request.request_id, "the engine core is shutting down")
            return False
        try:
            self.input_queue.put(_Add(self.core.preprocess(request, client)))
        except RequestRejected as e:
            self._error_to(client, request.request_id, str(e))
            return False
        return True

    def _hello(self, identity: bytes, client: int | None, request: HandshakeRequest) -> None:
        error = None
        if request.protocol_version != PROTOCOL_VERSION:
            error = (f"protocol version {request.protocol_version} is not supported (engine "
                     f"speaks {PROTOCOL_VERSION})")
        elif client is not None:
            error = f"this connection is already attached as frontend {client}"
        elif not self._accepting.is_set():
            error = "the engine core is shutting down"
        elif len(self._clients) >= MAX_CLIENTS:
            error = f"the engine core serves at most {MAX_CLIENTS} frontends at once"
        if error is not None:
            self._reply(identity, HandshakeReply(error=error))
            return
        index = self._next_client
        try:
            record = AttachedClient.bind(self.sockets, self.address, index, identity)
        except zmq.ZMQError as e:  # e.g. out of file descriptors
            self._reply(identity, HandshakeReply(error=f"cannot attach a frontend: {e}"))
            return
        self._next_client += 1
        with self._lock:
            self._identities[identity] = index
            self._clients[index] = record
        self.outputs.register(record)
        self._reply(identity, HandshakeReply(info=self.core.info, client_index=index,
                                             output_endpoint=record.endpoint,
                                             output_password=record.password))
        logger.info("frontend %d attached", index)

    def _reply(self, identity: bytes, reply: HandshakeReply) -> None:
        self.frontends.send_multipart([identity, msgspec.msgpack.encode(reply)])

    def _forget_client(self, index: int) -> None:
        """The client is gone (BYE, lost connection, not reading): requests from its
        connection are refused from now on and the busy loop aborts what it left."""
        with self._lock:
            record = self._clients.pop(index, None)
            if record is None:
                return
            self._identities.pop(record.identity, None)
            self._adds_refused.pop(index, None)
        self.sockets.forget_password(record.password)
        self.input_queue.put(_ClientGone(index))
        logger.info("frontend %d detached", index)

def _first_field(payload: bytes, kind: type[T]) -> T | None:
    """The first field of a message that failed validation (an ADD's request id, a
    utility call's id), to tell its sender why."""
    try:
        fields = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError:
        return None
    if isinstance(fields, list) and fields and type(fields[0]) is kind:
        return fields[0]
    return None


def _watch_lifeline(fd: int) -> None:
    """The frontend that launched us holds the other end of the lifeline."""
    wait_for_eof(fd)
    logger.info("engine core: launching frontend is gone")
    os.kill(os.getpid(), signal.SIGTERM)
