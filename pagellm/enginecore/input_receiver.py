"""`InputReceiver`: the engine core's input thread, and who is attached.

Every frontend talks to one ROUTER socket (the address a supervisor configures). The
thread takes each message, works out who sent it from the connection it arrived on
(the ROUTER's routing id, assigned by ZeroMQ, never a field the client writes: no client
can act for another), decodes it typed (no pickle), and puts what the busy loop must do
on its queue (`Add`, `Abort`, `Utility`, `ClientGone`). Attaching (HELLO) and detaching
(BYE) are handled here, with the limits on what a client can make the engine hold:
MAX_CLIENTS frontends, MAX_MESSAGE_BYTES a message. A message that does not decode is
logged (rate-limited) and dropped; a request that fails validation fails alone with an
error output; a utility call that does not decode (an unknown method) is answered with
a failure, never left to its caller's timeout.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
import zmq

from pagellm.enginecore.core import EngineCore, RequestRejected
from pagellm.enginecore.output_sender import AttachedClient, OutputSender
from pagellm.enginecore.request import Request
from pagellm.protocol.codec import MsgpackDecoder
from pagellm.protocol.messages import (
    PROTOCOL_VERSION,
    EngineCoreOutputs,
    EngineCoreRequest,
    HandshakeReply,
    HandshakeRequest,
    RequestType,
    UtilityOutput,
    UtilityRequest,
)
from pagellm.transport.sockets import SocketFactory

logger = logging.getLogger("pagellm")
T = TypeVar("T")

MAX_CLIENTS = 64  # frontends attached at once
_POLL_MS = 100  # how often the input thread checks for shutdown


# Items for the busy loop's queue ------------------------------------------------------
@dataclass
class Add:
    """A request to schedule."""

    request: Request  # validated and hashed


@dataclass
class Abort:
    client: int
    request_ids: list[str]


@dataclass
class Utility:
    client: int
    request: UtilityRequest


@dataclass
class ClientGone:
    client: int


@dataclass
class ThreadDied:
    message: str  # what died and how (an I/O thread, a tensor-parallel worker)


class InputReceiver:
    """The ROUTER socket, the attached clients (`AttachedClient`, by index) and the
    thread that serves them (`run`). The busy loop reads `items`; `accepting` is cleared
    while the engine drains for shutdown (new requests and frontends are refused),
    `stopping` ends the thread."""

    def __init__(self, core: EngineCore, sockets: SocketFactory, frontends: zmq.Socket,
                 items: queue.Queue[Any], outputs: OutputSender) -> None:
        """`frontends`: the ROUTER at the engine's address (`transport.bind_frontends`),
        bound before the model loaded."""
        self.core = core
        self.sockets = sockets
        self.address = sockets.address
        self.items = items
        self.outputs = outputs
        self.frontends = frontends
        self._lock = threading.Lock()  # guards the two maps below
        self._identities: dict[bytes, int] = {}  # connection -> client index
        self._clients: dict[int, AttachedClient] = {}
        self._next_client = 0
        # ADDs refused here, per client (this thread writes it): every message to a
        # client counts them with those the busy loop handled (data-parallel routing).
        self.adds_refused: dict[int, int] = {}
        self.accepting = threading.Event()
        self.accepting.set()
        self.stopping = threading.Event()

    def clients(self) -> list[AttachedClient]:
        """The clients attached now."""
        with self._lock:
            return list(self._clients.values())

    def run(self) -> None:
        """The input thread: until `stopping` is set."""
        decoders = {RequestType.ADD: MsgpackDecoder(EngineCoreRequest),
                    RequestType.ABORT: MsgpackDecoder(list[str]),
                    RequestType.UTILITY: MsgpackDecoder(UtilityRequest),
                    RequestType.HELLO: MsgpackDecoder(HandshakeRequest)}
        while not self.stopping.is_set():
            if not self.frontends.poll(_POLL_MS):
                continue
            frames = self.frontends.recv_multipart()
            try:
                self._on_message(frames, decoders)
            except (msgspec.DecodeError, ValueError, RecursionError) as e:
                logger.warning("engine core: dropped a malformed message: %s",
                               "nested too deeply" if isinstance(e, RecursionError) else e)
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
            self.forget_client(client)
            self.outputs.unregister(client)
        elif kind == RequestType.ADD:
            if not self._add(client, payload, decoders[kind]):
                self.adds_refused[client] = self.adds_refused.get(client, 0) + 1
        elif kind == RequestType.ABORT:
            self.items.put(Abort(client, decoders[kind].decode(payload)))
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
            self.items.put(Utility(client, call))

    def _add(self, client: int, payload: bytes, decoder: MsgpackDecoder[Any]) -> bool:
        """Queue the request for the busy loop; False if it was refused here."""
        try:
            request = decoder.decode(payload)
        except (msgspec.ValidationError, RecursionError) as e:  # a value out of range,
            request_id = _first_field(payload, str)  # or nested past the decoder's stack
            if not request_id:
                raise
            reason = "nested too deeply" if isinstance(e, RecursionError) else e
            self.outputs.fail_request(client, request_id, f"invalid request: {reason}")
            return False
        if not self.accepting.is_set():
            self.outputs.fail_request(client, request.request_id,
                                      "the engine core is shutting down")
            return False
        try:
            self.items.put(Add(self.core.preprocess(request, client)))
        except RequestRejected as e:
            self.outputs.fail_request(client, request.request_id, str(e))
            return False
        return True

    def _hello(self, identity: bytes, client: int | None, request: HandshakeRequest) -> None:
        error = None
        if request.protocol_version != PROTOCOL_VERSION:
            error = (f"protocol version {request.protocol_version} is not supported (engine "
                     f"speaks {PROTOCOL_VERSION})")
        elif client is not None:
            error = f"this connection is already attached as frontend {client}"
        elif not self.accepting.is_set():
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

    def forget_client(self, index: int) -> None:
        """The client is gone (BYE, lost connection, not reading): requests from its
        connection are refused from now on and the busy loop aborts what it left."""
        with self._lock:
            record = self._clients.pop(index, None)
            if record is None:
                return
            self._identities.pop(record.identity, None)
            self.adds_refused.pop(index, None)
        self.sockets.forget_password(record.password)
        self.items.put(ClientGone(index))
        logger.info("frontend %d detached", index)


def _first_field(payload: bytes, kind: type[T]) -> T | None:
    """The first field of a message that failed validation (an ADD's request id, a
    utility call's id), to tell its sender why."""
    # Read by hand, the rest left unread: it may be what failed (nested past the
    # decoder's stack, which skipping it would recurse through too).
    header = {0xdc: 3, 0xdd: 5}.get(payload[0], 1) if payload else 0
    if not payload or not (0x90 <= payload[0] <= 0x9f or payload[0] in (0xdc, 0xdd)):
        return None
    size = _msgpack_scalar_size(payload[header:header + 5])
    if size is None:
        return None
    try:
        first = msgspec.msgpack.decode(payload[header:header + size])
    except msgspec.DecodeError:
        return None
    return first if type(first) is kind else None


def _msgpack_scalar_size(head: bytes) -> int | None:
    """Bytes of the msgpack string or integer starting `head`, None for anything else."""
    if not head:
        return None
    marker = head[0]
    if marker <= 0x7f or marker >= 0xe0:  # positive / negative fixint
        return 1
    if 0xa0 <= marker <= 0xbf:  # fixstr
        return 1 + (marker & 0x1f)
    if marker in (0xcc, 0xcd, 0xce, 0xcf, 0xd0, 0xd1, 0xd2, 0xd3):  # (u)int 8..64
        return 1 + (1 << (marker & 0x03))
    if marker in (0xd9, 0xda, 0xdb):  # str 8, 16, 32
        width = 1 << (marker - 0xd9)
        if len(head) < 1 + width:
            return None
        return 1 + width + int.from_bytes(head[1:1 + width], "big")
    return None
