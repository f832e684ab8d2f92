"""`OutputSender`: every attached frontend's output socket, and who writes to it when.

The engine core's busy loop sends a step's outputs itself (`send_now`): handed to a
thread instead, they waited for the GIL while the busy loop scheduled and prepared the
next step, ~0.5-0.8 ms of every step's latency at 256 streams. Everything else goes
through the output thread (`run`): clients joining and leaving, heartbeats, watching
each client's connection, and the outputs of a client the busy loop cannot send to
right now (not registered yet, its queue full, or messages of its own still queued
there). A client's messages stay in order because the busy loop sends directly only
to a client with nothing queued for the thread.

What a client can make the engine hold is bounded here: OUTPUT_HWM outputs queued for
a client that stops reading, and as many again held by the output thread (`backlog`)
until its queue has room; a client whose queue stays full for STALL_S, or whose backlog
fills, is dropped. A client that reads again within STALL_S (a frontend the OS did not
run for a moment) loses nothing, and a stalled client never holds up the others. Also
bounded: one peer per output socket (a second would read its outputs: dropped), and
CONNECT_GRACE_S to connect that socket at all.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from pagellm.protocol.codec import MsgpackEncoder
from pagellm.protocol.messages import EngineCoreOutput, EngineCoreOutputs, FinishReason
from pagellm.transport.sockets import SocketFactory, data_endpoint
from pagellm.transport.sockets import monitor as monitor_socket

logger = logging.getLogger("pagellm")

HEARTBEAT_INTERVAL_S = 0.5  # an idle client hears from the engine at least this often
CONNECT_GRACE_S = 10.0  # a client must connect its output socket within this long
# Outputs queued for one client before it counts as not reading: 10 s of steps at 100
# steps/s, and at most ~100 MB for a client of 256 streams with top-20 logprobs.
OUTPUT_HWM = 1000
STALL_S = 1.0  # how long a full queue may stay full (no output taken) before a drop
PEER_MESSAGE_BYTES = 4096  # the most an output socket's peer may send (it sends nothing)
_WATCH_S = 0.1  # how often the output thread looks at its clients' connections
_RETRY_S = 0.005  # how often it retries a stalled client's queue


@dataclass
class AttachedClient:
    """A frontend's output side. Its sockets belong to the output thread once
    registered (the busy loop borrows the PUSH socket under the sender's lock)."""

    index: int
    identity: bytes  # the ROUTER routing id of its connection
    socket: zmq.Socket  # PUSH: its outputs
    monitor: zmq.Socket  # events of that socket
    endpoint: str  # where that socket is bound
    password: str | None  # its PLAIN password (transport.bind_private), None with CURVE
    registered: float = field(default_factory=time.monotonic)
    open_fds: set[int] = field(default_factory=set)  # its socket's open connections
    handshakes: int = 0  # connections that completed the ZMTP (and CURVE) handshake
    last_sent: float = field(default_factory=time.monotonic)
    # Encoded outputs that did not fit its queue, oldest first (the output thread's),
    # and when the first of them last found no room.
    backlog: deque[bytes] = field(default_factory=deque)
    stalled: float = 0.0

    @classmethod
    def bind(cls, sockets: SocketFactory, address: str, index: int, identity: bytes
             ) -> AttachedClient:
        """Bind client `index`'s PUSH socket beside `address` (raises zmq.ZMQError,
        e.g. out of file descriptors)."""
        sock, endpoint, password = sockets.bind_private(
            zmq.PUSH, data_endpoint(address, f"out{index}"), {
            zmq.SNDHWM: OUTPUT_HWM,
            # A PUSH socket reads nothing, but a peer can still send it messages, which
            # ZeroMQ would queue (RCVHWM of them): any but the handshake's drop it.
            zmq.MAXMSGSIZE: PEER_MESSAGE_BYTES})
        events = zmq.EVENT_ACCEPTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
        return cls(index, identity, sock, monitor_socket(sock, events), endpoint, password)


# Items for the output thread ---------------------------------------------------------
@dataclass
class _Register:
    client: AttachedClient


@dataclass
class _Unregister:
    client: int


@dataclass
class _Send:
    outputs: dict[int, EngineCoreOutputs]  # client index -> its outputs


@dataclass
class _Stop:
    message: str  # the last word to every client (why the engine stopped)


class OutputSender:
    """`stamp(index, outputs)` writes the load a message carries just before it is
    encoded; `forget(index)` tells the engine core that the output thread dropped a
    client (gone, not reading), so that its requests are aborted."""

    def __init__(self, stamp: Callable[[int, EngineCoreOutputs], None],
                 forget: Callable[[int], None]) -> None:
        self._stamp = stamp
        self._forget = forget
        self._queue: queue.Queue[Any] = queue.Queue()  # for the output thread
        # Guards both maps and every use of a client's PUSH socket (both threads send).
        self._lock = threading.Lock()
        self._direct: dict[int, AttachedClient] = {}  # registered by the output thread
        self._queued: dict[int, int] = {}  # _Send entries per client the thread has not sent
        self._encoder = MsgpackEncoder()  # the busy loop's; the output thread has its own
        self._buffer = bytearray()
        self.last_word_sent = False

    # -- called from other threads ---------------------------------------------------

    def register(self, client: AttachedClient) -> None:
        self._queue.put(_Register(client))  # the output thread owns its sockets now

    def unregister(self, index: int) -> None:
        self._queue.put(_Unregister(index))

    def stop(self, message: str) -> None:
        """Tell every client `message` (engine_dead) and close their sockets; `run`
        returns."""
        self._queue.put(_Stop(message))

    def send_now(self, outputs: dict[int, EngineCoreOutputs]) -> None:
        """Send outputs from the busy loop; a client with messages queued, not yet
        registered, gone, or with a full queue (zmq.Again: the output thread tells
        which) goes through the output thread."""
        slow: dict[int, EngineCoreOutputs] = {}
        with self._lock:
            for index, client_outputs in outputs.items():
                record = self._direct.get(index)
                if record is None or self._queued.get(index):
                    slow[index] = client_outputs
                    continue
                self._stamp(index, client_outputs)
                self._encoder.encode_into(client_outputs, self._buffer)
                try:
                    record.socket.send(self._buffer, flags=zmq.NOBLOCK)  # copies
                    record.last_sent = time.monotonic()
                except zmq.Again:
                    slow[index] = client_outputs
        if slow:
            self.queue_send(slow)

    def queue_send(self, outputs: dict[int, EngineCoreOutputs]) -> None:
        """Give outputs to the output thread to send (counted per client, see
        `send_now`)."""
        with self._lock:
            for index in outputs:
                self._queued[index] = self._queued.get(index, 0) + 1
        self._queue.put(_Send(outputs))

    def fail_request(self, client: int, request_id: str, error: str) -> None:
        """Fail one request that never reached the scheduler (through the output thread:
        called from the input thread too)."""
        self.queue_send({client: EngineCoreOutputs(
            [EngineCoreOutput(request_id, [], FinishReason.ERROR, error=error)],
            time.monotonic())})

    # -- the output thread -----------------------------------------------------------

    def run(self) -> None:
        clients: dict[int, AttachedClient] = {}  # owned by this thread
        encoder = MsgpackEncoder()
        buffer = bytearray()
        last_watch = 0.0

        def drop(record: AttachedClient, reason: str) -> None:
            logger.warning("frontend %d %s: dropping it and aborting its requests",
                           record.index, reason)
            clients.pop(record.index, None)
            close(record)
            self._forget(record.index)

        def close(record: AttachedClient, linger_ms: int = 0) -> None:
            with self._lock:
                self._direct.pop(record.index, None)
                self._queued.pop(record.index, None)
                _close(record, linger_ms)

        def put(record: AttachedClient, data: bytes | bytearray) -> bool:
            """Send without blocking; False when its queue is full (or it has no peer)."""
            try:
                with self._lock:
                    record.socket.send(data, flags=zmq.NOBLOCK)  # copies: buffer reused
            except zmq.Again:
                return False
            record.last_sent = time.monotonic()
            return True

        def hold(record: AttachedClient, data: bytes) -> None:
            """Keep `data` until its queue has room (`flush`); the busy loop sends this
            client nothing directly meanwhile (`_queued`), so its messages keep order."""
            if len(record.backlog) >= OUTPUT_HWM:
                drop(record, f"stopped reading its outputs ({2 * OUTPUT_HWM} waiting)")
                return
            if not record.backlog:
                record.stalled = time.monotonic()
            record.backlog.append(data)
            with self._lock:
                self._queued[record.index] = self._queued.get(record.index, 0) + 1

        def flush(record: AttachedClient) -> None:
            while record.backlog and put(record, record.backlog[0]):
                record.backlog.popleft()
                record.stalled = record.last_sent
                with self._lock:
                    left = self._queued.pop(record.index, 1) - 1
                    if left:
                        self._queued[record.index] = left
            if record.backlog and record.handshakes \
                    and time.monotonic() - record.stalled > STALL_S:
                drop(record, f"stopped reading its outputs (a queue of {OUTPUT_HWM} "
                             f"full for {STALL_S:g} s)")

        def send(index: int, outputs: EngineCoreOutputs, last: bool = False) -> None:
            record = clients.get(index)
            if record is None:
                return  # the client left
            self._stamp(index, outputs)
            encoder.encode_into(outputs, buffer)
            if last:  # the engine stops: what fits, without waiting
                while record.backlog and put(record, record.backlog.popleft()):
                    pass
                put(record, buffer)
            elif record.backlog or not put(record, buffer):
                hold(record, bytes(buffer))

        while True:
            stalled = [r for r in clients.values() if r.backlog]
            try:  # a stalled client's queue is looked at again soon
                item = self._queue.get(timeout=_RETRY_S if stalled else _WATCH_S)
            except queue.Empty:
                item = None
            for waiting in stalled:
                flush(waiting)
            if isinstance(item, _Register):
                clients[item.client.index] = item.client
                with self._lock:
                    self._direct[item.client.index] = item.client
            elif isinstance(item, _Unregister):
                record = clients.pop(item.client, None)
                if record is not None:
                    close(record, linger_ms=1000)
            elif isinstance(item, _Send):
                for index, outputs in item.outputs.items():
                    send(index, outputs)
                    with self._lock:
                        left = self._queued.pop(index, 1) - 1
                        if left:
                            self._queued[index] = left
            elif isinstance(item, _Stop):
                for index in list(clients):
                    send(index, EngineCoreOutputs(timestamp=time.monotonic(),
                                                  engine_dead=item.message), last=True)
                for record in clients.values():
                    close(record, linger_ms=1000)  # let the last word reach the frontends
                clients.clear()
                self.last_word_sent = True
                return
            now = time.monotonic()
            if now - last_watch >= _WATCH_S:
                last_watch = now
                for record in list(clients.values()):
                    reason = _watch(record, now)
                    if reason is not None:
                        drop(record, reason)
                for record in [r for r in clients.values()  # (a backlog is news enough)
                               if now - r.last_sent > HEARTBEAT_INTERVAL_S and not r.backlog]:
                    send(record.index, EngineCoreOutputs(timestamp=now))


def last_word(clients: list[AttachedClient], message: str) -> None:
    """The output thread is gone: tell every client why, from the calling thread."""
    data = msgspec.msgpack.encode(EngineCoreOutputs(timestamp=time.monotonic(),
                                                    engine_dead=message))
    for record in clients:
        with contextlib.suppress(zmq.ZMQError):
            record.socket.send(data, flags=zmq.NOBLOCK)
        _close(record, linger_ms=1000)


def _watch(record: AttachedClient, now: float) -> str | None:
    """Apply the client's pending socket events; why it must be dropped, if it must.

    ACCEPTED and DISCONNECTED carry the connection's descriptor; HANDSHAKE_SUCCEEDED
    (ZMTP, and CURVE when configured) does not, so peers are counted by it: a stranger
    whose CURVE handshake fails comes and goes without counting."""
    while record.monitor.poll(0):
        event = recv_monitor_message(record.monitor)
        kind, value = event["event"], event["value"]
        if kind == zmq.EVENT_ACCEPTED:
            record.open_fds.add(value)
        elif kind == zmq.EVENT_DISCONNECTED:
            record.open_fds.discard(value)
        elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            record.handshakes += 1
    if record.handshakes > 1:
        # Outputs are round-robined between peers: a second one would read this
        # client's outputs. Fail closed.
        return "got a second connection on its output socket"
    if record.handshakes and not record.open_fds:
        return "disconnected"
    if not record.handshakes and now - record.registered > CONNECT_GRACE_S:
        return f"did not connect its output socket within {CONNECT_GRACE_S:.0f} s"
    return None


def _close(record: AttachedClient, linger_ms: int = 0) -> None:
    with contextlib.suppress(zmq.ZMQError):
        record.socket.disable_monitor()
    record.monitor.close(linger=0)
    record.socket.close(linger=linger_ms)
    if record.endpoint.startswith("ipc://"):  # no socket file per departed client
        with contextlib.suppress(OSError):
            os.unlink(record.endpoint.removeprefix("ipc://"))
