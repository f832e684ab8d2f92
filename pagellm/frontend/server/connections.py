"""What uvicorn lacks against slow and idle connections (Slowloris).

uvicorn closes idle keep-alive connections, but a connection that has not yet sent a
complete request is held forever, and it accepts connections until the process runs
out of file descriptors (then /health stops answering and asyncio logs every failed
accept). `GuardedH11Protocol` adds:

- a header timeout: a connection with no request in progress (none yet, or between
  two requests) is closed after `header_timeout_s`;
- a body deadline: from the moment a request's headers arrive, its body must be
  complete within `body_timeout_s`, else the connection is closed (with a 408 if no
  response has started). It is kept here, not in the app, because the app sees a body
  only if its route reads one: a route that answers without reading (401, 404, 413)
  or streams first left a dripping body holding its connection for as long as the
  client liked. A connection whose response is complete while its request's body is
  still arriving is closed at once too: it can never carry another request;
- a connection limit: above `max_connections`, the connection that has waited longest
  without a request in progress is closed to make room, so half-open connections can
  never crowd out a client that sends a request; only when every connection is busy
  with a request is a new one answered 503 and closed;
- a connection limit per client (peer IP address), `per_client`, the same rule among
  one client's own connections: above it, that client's connection idle longest makes
  room, or the new one is refused. Without it one client whose requests stay busy
  (bodies dripping until their deadline, streams read slowly) could hold every slot.
  Behind a reverse proxy every client is the proxy's one address: raise it there;
- a write-stall timeout: a connection whose writes have been paused by flow control
  (its client reads nothing, so the socket and the transport's buffer are full) for
  `write_stall_timeout_s` is aborted. Without it a streaming client that never reads
  holds its connection busy forever, never evictable, and `max_connections` of them
  refuse everyone else (the engine frees their KV cache; the slots stayed taken).
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagellm.frontend.server.edge import error_response

logger = logging.getLogger("pagellm")

HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 30.0  # from a request's headers to the end of its body
WRITE_STALL_TIMEOUT_S = 30.0
LINGER_S = 2.0  # what a client still sends after its answer is read and dropped this long
MAX_CONNECTIONS = 2048
_FD_RESERVE = 128  # descriptors kept for the engine sockets, logs, the tokenizer, ...
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\n"
         b"connection: close\r\ncontent-length: 28\r\n\r\ntoo many requests in flight\n")


def _timeout_response(seconds: float) -> bytes:
    """The 408 in OpenAI's error shape, as the app writes its errors."""
    body = error_response(408, f"the request body did not arrive within {seconds:g} s",
                          "RequestTimeoutError").body
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int = MAX_CONNECTIONS
    max_connections_per_client: int | None = None  # None: `per_client`'s default
    header_timeout_s: float = HEADER_TIMEOUT_S
    body_timeout_s: float = BODY_TIMEOUT_S
    write_stall_timeout_s: float = WRITE_STALL_TIMEOUT_S
    linger_s: float = LINGER_S

    @property
    def per_client(self) -> int:
        """The most connections one peer address holds: as given, else half of
        `max_connections`, so that no one client can ever take every slot."""
        if self.max_connections_per_client is not None:
            return self.max_connections_per_client
        return max(1, self.max_connections // 2)


def connection_limit(requested: int) -> int:
    """At most `requested`, and never more than this process's file descriptors allow
    (after raising the soft limit to the hard one, as servers do)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    if soft == resource.RLIM_INFINITY:
        return requested
    return max(1, min(requested, soft - _FD_RESERVE))


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header timeout, a body deadline, connection limits
    (in all and per client) and a write-stall timeout.

    One timer, `_deadline`, holds whichever of the header timeout, the body deadline
    and the linger applies: they belong to successive phases of a connection."""

    def __init__(self, *args: Any, limits: ConnectionLimits, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self.waiting_since = time.monotonic()  # when it last had no request in progress
        self.peer: str | None = None  # the client's IP address (None on a Unix socket)
        self.lingering = False  # answered and shut for writing: only draining is left
        self._deadline: asyncio.TimerHandle | None = None
        self._stall_timer: asyncio.TimerHandle | None = None

    @property
    def busy(self) -> bool:
        """A request is in progress (its headers arrived; its response is not done)."""
        return (not self.lingering and self.cycle is not None
                and not self.cycle.response_complete)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.peer = self.client[0] if self.client else None
        if not self._admit():
            # Out of the count now: connection_lost comes a loop iteration later, and a
            # refused connection must not be taken for an idle one meanwhile.
            self.connections.discard(self)
            transport.write(_BUSY)
            transport.close()
            return
        self._set_deadline(self.limits.header_timeout_s, self._on_header_timeout)

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            return  # the rest of a body nobody will read
        super().data_received(data)

    def handle_events(self) -> None:
        """Start the body deadline when a request's headers arrive with a body still to
        come (pipelined requests start here too, from on_response_complete); stop the
        clock once the body is complete."""
        cycle = self.cycle
        super().handle_events()
        if not self.busy:
            return  # no request yet: the header timeout runs
        if self.conn.their_state is not h11.SEND_BODY:
            self._clear_deadline()
        elif self.cycle is not cycle:
            self._set_deadline(self.limits.body_timeout_s, self._on_body_timeout)

    def on_response_complete(self) -> None:
        # Read before super(), which may start a pipelined request's cycle.
        unread_body = self.conn.their_state is h11.SEND_BODY
        super().on_response_complete()
        self.waiting_since = time.monotonic()
        if unread_body:
            self._close_lingering()
        elif not self.busy:
            self._set_deadline(self.limits.header_timeout_s, self._on_header_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._clear_deadline()
        self._disarm_stall()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        """The transport's buffer is over its high-water mark: the client is not keeping
        up. Start the stall clock (uvicorn's own handling holds the response's next send
        until `resume_writing`, which a client that never reads never brings)."""
        super().pause_writing()
        if self._stall_timer is None:
            self._stall_timer = self.loop.call_later(self.limits.write_stall_timeout_s,
                                                     self._on_write_stall)

    def resume_writing(self) -> None:
        """The buffer drained below its low-water mark: the client reads, however slowly
        (it must take in about 48 KiB, the gap between asyncio's default water marks,
        per `write_stall_timeout_s`)."""
        super().resume_writing()
        self._disarm_stall()

    def _admit(self) -> bool:
        """Whether this new connection may stay: within its client's share and within
        the total, after closing an idle connection to make room where needed."""
        limits = self.limits
        # Fewer connections in all than one client's share: no client can be over it.
        if len(self.connections) > limits.per_client:
            mine = [c for c in self.connections
                    if isinstance(c, GuardedH11Protocol) and c.peer == self.peer]
            if len(mine) > limits.per_client and not self._make_room(mine):
                logger.warning("HTTP: a client holds %d connections (at most %d per client), "
                               "all busy: refusing a new one", len(mine) - 1,
                               limits.per_client)
                return False
        if len(self.connections) > limits.max_connections \
                and not self._make_room(self.connections):
            logger.warning("HTTP: %d connections, all busy: refusing a new one",
                           len(self.connections) - 1)
            return False
        return True

    def _make_room(self, among: Iterable[object]) -> bool:
        """Close the connection of `among` that has waited longest without a request in
        progress; False if every other one is busy."""
        idle = [c for c in among if c is not self and isinstance(c, GuardedH11Protocol)
                and not c.busy and not c.transport.is_closing()]
        if not idle:
            return False
        oldest = min(idle, key=lambda c: c.waiting_since)
        logger.warning("HTTP: connection limit reached (%d in all, %d per client): closing "
                       "the connection that waited longest without a request",
                       self.limits.max_connections, self.limits.per_client)
        oldest.transport.close()
        self.connections.discard(oldest)
        return True

    def _set_deadline(self, seconds: float, callback: Callable[[], None]) -> None:
        self._clear_deadline()
        self._deadline = self.loop.call_later(seconds, callback)

    def _clear_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _on_header_timeout(self) -> None:
        self._deadline = None
        if not self.busy and not self.transport.is_closing():
            logger.warning("HTTP: closing a connection that sent no complete request "
                           "within %.0f s", self.limits.header_timeout_s)
            self.transport.close()

    def _on_body_timeout(self) -> None:
        """The one body deadline: the app has no clock of its own (edge.read_body), so
        no route answers a slow body differently. Before a response has started the
        client gets the 408 the app would have sent; after, the response is cut
        (abort: what it has of it is unusable anyway). The handler sees a disconnect
        either way, and its sends go nowhere."""
        self._deadline = None
        if self.conn.their_state is not h11.SEND_BODY or self.transport.is_closing():
            return
        logger.warning("HTTP: closing a connection whose request body did not arrive "
                       "within %.0f s", self.limits.body_timeout_s)
        cycle = self.cycle
        if cycle.response_started:
            self.transport.abort()
            return
        cycle.disconnected = True
        cycle.message_event.set()
        self.transport.write(_timeout_response(self.limits.body_timeout_s))
        self._close_lingering()

    def _close_lingering(self) -> None:
        """Close a connection whose client is still sending a body after its answer.
        Shut for writing at once (the client sees its answer end, then EOF), then read
        and drop what still comes for up to `linger_s` before closing: a socket closed
        with unread data sends a reset, which can destroy the answer in flight before
        the client reads it (nginx's lingering close, for the same reason). Then abort,
        not close: an answer still unsent by then waits on a client that does not read.
        The connection counts as idle meanwhile: it may be closed to make room."""
        if self.transport.is_closing():
            return
        self.lingering = True
        self._clear_deadline()
        if not self.transport.can_write_eof():  # TLS: no half-close
            self.transport.close()
            return
        self.transport.write_eof()
        self.flow.resume_reading()  # uvicorn may have paused it for a large body
        self._set_deadline(self.limits.linger_s, self.transport.abort)

    def _disarm_stall(self) -> None:
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

    def _on_write_stall(self) -> None:
        """Abort, not close: close() would wait for the buffer to drain, which is what
        never happens. connection_lost then marks the request disconnected, and the app
        aborts its engine requests as for a client that left. Busy or not: a finished
        response stuck in the buffer holds the socket just the same."""
        self._stall_timer = None
        logger.warning("HTTP: closing a connection whose client has not read its response "
                       "for %.0f s", self.limits.write_stall_timeout_s)
        self.transport.abort()
