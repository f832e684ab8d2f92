"""`EngineCoreProc`: the engine core as a process, served over ZeroMQ.

    frontend(s)                                  engine-core process
    DEALER ── HELLO / BYE ──────────▶ ROUTER  (the one address a supervisor configures)
    PUSH ──── [type, client, payload] ▶ PULL   ─ input thread: decode, scope ids ─┐
                                                                              queue
                                                 busy loop (main thread): step ◀┘
    PULL ◀─── EngineCoreOutputs ────── PUSH    ─ output thread: split per client,
              (one PUSH per client)                encode, send; heartbeats

Requests and outputs travel over PUSH/PULL; the handshake socket tells each frontend
its client index and where the data sockets are. Request ids are scoped per client
("<client>:<id>") on the way in and unscoped on the way out, so several frontends can
use the same ids and each receives only its own outputs. No pickle anywhere: every
payload is a typed msgspec Struct, and a frame that does not decode is logged and
dropped.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import struct
import threading
import time
import traceback
from dataclasses import dataclass
from types import FrameType
from typing import Any

import msgspec
import zmq

from enginecore.core import EngineCore
from enginecore.request import Request
from enginecore.transport import CurveServerKeys, SocketFactory, data_endpoint
from protocol.codec import MsgpackDecoder, MsgpackEncoder
from protocol.engine_args import EngineArgs
from protocol.messages import (
    CLIENT_INDEX,
    PROTOCOL_VERSION,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    HandshakeKind,
    HandshakeReply,
    HandshakeRequest,
    RequestType,
    UtilityMethod,
    UtilityOutput,
    UtilityRequest,
)
from protocol.utility import NUM_ARGS

logger = logging.getLogger("pagellm")

HEARTBEAT_INTERVAL_S = 0.5  # an idle client hears from the engine at least this often
_POLL_MS = 100  # how often the input thread checks for shutdown
_SIGNAL_CHECK_S = 0.2  # how often an idle busy loop lets signal handlers run
# A client that has not connected its output socket yet is not "gone" (see _output_loop).
CONNECT_GRACE_S = 10.0
SHUTDOWN_GRACE_S = 15.0  # after this long in shutdown the process exits regardless


class ShutdownRequested(Exception):
    """Raised in the main thread by SIGTERM / SIGINT."""


# Items for the busy loop (from the input thread) ------------------------------------
@dataclass
class _Add:
    request: Request | EngineCoreOutput  # preprocessed, or the error for a bad one


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _Utility:
    client: int
    request: UtilityRequest


@dataclass
class _ClientGone:
    client: int


# Items for the output thread ---------------------------------------------------------
@dataclass
class _Register:
    client: int
    socket: zmq.Socket


@dataclass
class _Unregister:
    client: int


@dataclass
class _Send:
    client: int | None  # None: split the step's outputs by client
    outputs: EngineCoreOutputs


@dataclass
class _Stop:
    message: str | None  # the last word to every client (why the engine stopped)


def scope(client: int, request_id: str) -> str:
    return f"{client}:{request_id}"


def unscope(scoped: str) -> tuple[int, str]:
    client, _, request_id = scoped.partition(":")
    return int(client), request_id


class EngineCoreProc:
    def __init__(self, args: EngineArgs, address: str, curve: CurveServerKeys | None = None,
                 lifeline_fd: int | None = None) -> None:
        self.address = address
        self.sockets = SocketFactory(address, curve)  # refuses unsafe binds before loading
        self.core = EngineCore(args)
        self.handshake, _ = self.sockets.bind(zmq.ROUTER, address)
        self.input, self.input_endpoint = self.sockets.bind(zmq.PULL,
                                                            data_endpoint(address, "in"))
        self.input_queue: queue.Queue[Any] = queue.Queue()
        self.output_queue: queue.Queue[Any] = queue.Queue()
        self.clients: set[int] = set()
        self._next_client = 0
        self._stopping = threading.Event()
        self.encode_s = 0.0  # mean output encoding time, updated by the output thread
        self.threads = [threading.Thread(target=self._input_loop, name="engine-input",
                                         daemon=True),
                        threading.Thread(target=self._output_loop, name="engine-output",
                                         daemon=True)]
        if lifeline_fd is not None:
            self.threads.append(threading.Thread(target=_watch_lifeline, args=(lifeline_fd,),
                                                 name="engine-lifeline", daemon=True))

    # -- the busy loop ---------------------------------------------------------------

    def run(self) -> int:
        """Serve until SIGTERM/SIGINT (exit 0) or a failure in the loop (exit 1)."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _raise_shutdown)
        for thread in self.threads:
            thread.start()
        logger.info("engine core ready at %s", self.address)
        code, message = 0, "engine core shut down"
        try:
            while True:
                self._handle_inputs(block=not self.core.has_work())
                if self.core.has_work():
                    outputs = self.core.step()
                    if outputs.outputs:
                        self.output_queue.put(_Send(None, outputs))
        except ShutdownRequested:
            logger.info("engine core: shutting down on signal")
        except Exception as e:  # the loop's failure is every client's EngineDeadError
            code, message = 1, f"engine core failed: {type(e).__name__}: {e}"
            logger.error("%s\n%s", message, traceback.format_exc())
        self._shutdown(message)
        return code

    def _handle_inputs(self, block: bool) -> None:
        item = None
        while block and item is None:
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
        if isinstance(item, _Add):
            self.core.add_preprocessed(item.request)
        elif isinstance(item, _Abort):
            self.core.abort_requests(item.request_ids)
        elif isinstance(item, _Utility):
            self.output_queue.put(_Send(item.client, EngineCoreOutputs(
                timestamp=time.monotonic(), utility_output=self._call(item.request))))
        elif isinstance(item, _ClientGone):
            self.clients.discard(item.client)
            prefix = scope(item.client, "")
            self.core.abort_requests([r for r in self.core.scheduler.requests
                                      if r.startswith(prefix)])
            self.output_queue.put(_Unregister(item.client))

    def _call(self, request: UtilityRequest) -> UtilityOutput:
        expected = NUM_ARGS.get(request.method)
        if expected is not None and len(request.args) != expected:
            return UtilityOutput(request.call_id, failure=(
                f"{request.method.name} takes {expected} argument(s), got {len(request.args)}"))
        try:
            if request.method == UtilityMethod.GET_STATS:
                stats = self.core.get_stats()
                stats.step_timings.output_encode_s = self.encode_s
                return UtilityOutput(request.call_id, result=msgspec.msgpack.encode(stats))
            if request.method == UtilityMethod.RESET_PREFIX_CACHE:
                reset = self.core.reset_prefix_cache()
                return UtilityOutput(request.call_id, result=msgspec.msgpack.encode(reset))
            return UtilityOutput(request.call_id, failure=f"unknown method {request.method}")
        except Exception as e:
            return UtilityOutput(request.call_id, failure=f"{type(e).__name__}: {e}")

    def _shutdown(self, message: str) -> None:
        # Whatever hangs below, a supervisor's SIGTERM must end the process.
        watchdog = threading.Timer(SHUTDOWN_GRACE_S, os._exit, args=(1,))
        watchdog.daemon = True
        watchdog.start()
        self._stopping.set()
        self.output_queue.put(_Stop(message))
        for thread in self.threads[:2]:
            thread.join(timeout=5)
        self.core.shutdown()
        self.sockets.close()

    # -- input thread ----------------------------------------------------------------

    def _input_loop(self) -> None:
        hello = MsgpackDecoder(HandshakeRequest)
        decoders = {RequestType.ADD: MsgpackDecoder(EngineCoreRequest),
                    RequestType.ABORT: MsgpackDecoder(list[str]),
                    RequestType.UTILITY: MsgpackDecoder(UtilityRequest)}
        poller = zmq.Poller()
        poller.register(self.handshake, zmq.POLLIN)
        poller.register(self.input, zmq.POLLIN)
        while not self._stopping.is_set():
            events = dict(poller.poll(_POLL_MS))
            if self.handshake in events:
                frames = self.handshake.recv_multipart()
                self._on_handshake(frames, hello)
            if self.input in events:
                frames = self.input.recv_multipart()
                try:
                    self._on_input(frames, decoders)
                except (msgspec.DecodeError, ValueError, struct.error) as e:
                    logger.warning("dropped a malformed message (%d frames): %s",
                                   len(frames), e)

    def _on_handshake(self, frames: list[bytes], decoder: MsgpackDecoder[Any]) -> None:
        identity, payload = frames[0], frames[-1]
        try:
            request = decoder.decode(payload)
        except msgspec.DecodeError as e:
            logger.warning("dropped a malformed handshake: %s", e)
            return
        if request.kind == HandshakeKind.BYE:
            if request.client_index in self.clients:
                self.clients.discard(request.client_index)
                self.input_queue.put(_ClientGone(request.client_index))
            return
        if request.protocol_version != PROTOCOL_VERSION:
            reply = HandshakeReply(error=f"protocol version {request.protocol_version} is "
                                         f"not supported (engine speaks {PROTOCOL_VERSION})")
        else:
            client = self._next_client
            self._next_client += 1
            # The output thread owns the socket from here on (queue.put is the barrier).
            sock, endpoint = self.sockets.bind(zmq.PUSH,
                                               data_endpoint(self.address, f"out{client}"))
            self.output_queue.put(_Register(client, sock))
            self.clients.add(client)
            reply = HandshakeReply(info=self.core.info, client_index=client,
                                   input_endpoint=self.input_endpoint,
                                   output_endpoint=endpoint)
            logger.info("frontend %d attached", client)
        self.handshake.send_multipart([identity, msgspec.msgpack.encode(reply)])

    def _on_input(self, frames: list[bytes], decoders: dict[RequestType, Any]) -> None:
        if len(frames) != 3:
            raise ValueError(f"expected 3 frames, got {len(frames)}")
        kind = RequestType(frames[0])  # ValueError for an unknown type byte
        (client,) = CLIENT_INDEX.unpack(frames[1])
        if client not in self.clients:
            raise ValueError(f"unknown client index {client}")
        payload = decoders[kind].decode(frames[2])
        if kind == RequestType.ADD:
            payload.request_id = scope(client, payload.request_id)
            self.input_queue.put(_Add(self.core.preprocess(payload)))
        elif kind == RequestType.ABORT:
            self.input_queue.put(_Abort([scope(client, r) for r in payload]))
        else:
            self.input_queue.put(_Utility(client, payload))

    # -- output thread ---------------------------------------------------------------

    def _output_loop(self) -> None:
        sockets: dict[int, zmq.Socket] = {}
        last_sent: dict[int, float] = {}
        registered: dict[int, float] = {}
        encoder = MsgpackEncoder()
        buffer = bytearray()

        def send(client: int, outputs: EngineCoreOutputs) -> None:
            sock = sockets.get(client)
            if sock is None:
                return  # the client left
            start = time.perf_counter()
            encoder.encode_into(outputs, buffer)
            self.encode_s = 0.9 * self.encode_s + 0.1 * (time.perf_counter() - start)
            try:
                sock.send(buffer, flags=zmq.NOBLOCK)  # copies: the buffer is reused
                last_sent[client] = time.monotonic()
            except zmq.Again:  # no peer: the frontend is gone without a BYE...
                if time.monotonic() - registered[client] < CONNECT_GRACE_S:
                    return  # ...or still connecting: only heartbeats can be sent yet
                logger.warning("frontend %d is unreachable; aborting its requests", client)
                sockets.pop(client).close(linger=0)
                last_sent.pop(client, None)
                self.input_queue.put(_ClientGone(client))

        while True:
            try:
                item = self.output_queue.get(timeout=HEARTBEAT_INTERVAL_S)
            except queue.Empty:
                item = None
            if isinstance(item, _Register):
                sockets[item.client] = item.socket
                last_sent[item.client] = registered[item.client] = time.monotonic()
            elif isinstance(item, _Unregister):
                last_sent.pop(item.client, None)
                sock = sockets.pop(item.client, None)
                if sock is not None:
                    sock.close(linger=1000)
            elif isinstance(item, _Send) and item.client is not None:
                send(item.client, item.outputs)
            elif isinstance(item, _Send):
                for client, outputs in _split_by_client(item.outputs).items():
                    send(client, outputs)
            elif isinstance(item, _Stop):
                for client in list(sockets):
                    send(client, EngineCoreOutputs(timestamp=time.monotonic(),
                                                   engine_dead=item.message))
                for sock in sockets.values():
                    sock.close(linger=1000)  # let the last word reach the frontends
                return
            now = time.monotonic()
            for client in [c for c, t in last_sent.items() if now - t > HEARTBEAT_INTERVAL_S]:
                send(client, EngineCoreOutputs(timestamp=now))


def _split_by_client(outputs: EngineCoreOutputs) -> dict[int, EngineCoreOutputs]:
    per_client: dict[int, list[EngineCoreOutput]] = {}
    for output in outputs.outputs:
        client, output.request_id = unscope(output.request_id)
        per_client.setdefault(client, []).append(output)
    return {c: EngineCoreOutputs(outs, outputs.timestamp) for c, outs in per_client.items()}


def _raise_shutdown(signum: int, frame: FrameType | None) -> None:
    raise ShutdownRequested(signal.Signals(signum).name)


def _watch_lifeline(fd: int) -> None:
    """The frontend that launched us holds the other end: EOF means it is gone."""
    while True:
        try:
            if not os.read(fd, 1):
                break
        except InterruptedError:
            continue
        except OSError:
            break
    logger.info("engine core: launching frontend is gone")
    os.kill(os.getpid(), signal.SIGTERM)
