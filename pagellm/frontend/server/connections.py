"""What uvicorn lacks against slow and idle connections (Slowloris).

uvicorn closes idle keep-alive connections, but a connection that has not yet sent a
complete request is held forever, and it accepts connections until the process runs
out of file descriptors (then /health stops answering and asyncio logs every failed
accept). `GuardedH11Protocol` adds:

- a header timeout: a connection with no request in progress (none yet, or between
  two requests) is closed after `header_timeout_s` (the body has its own deadline in
  the app, BODY_TIMEOUT_S);
- a connection limit: above `max_connections`, the connection that has waited longest
  without a request in progress is closed to make room, so half-open connections can
  never crowd out a client that sends a request; only when every connection is busy
  with a request is a new one answered 503 and closed;
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
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("pagellm")

HEADER_TIMEOUT_S = 10.0
WRITE_STALL_TIMEOUT_S = 30.0
MAX_CONNECTIONS = 2048
_FD_RESERVE = 128  # descriptors kept for the engine sockets, logs, the tokenizer, ...
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\n"
         b"connection: close\r\ncontent-length: 28\r\n\r\ntoo many requests in flight\n")


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int = MAX_CONNECTIONS
    header_timeout_s: float = HEADER_TIMEOUT_S
    write_stall_timeout_s: float = WRITE_STALL_TIMEOUT_S


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
    """uvicorn's h11 protocol with a header timeout, a connection limit and a
    write-stall timeout."""

    def __init__(self, *args: Any, limits: ConnectionLimits, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self.waiting_since = time.monotonic()  # when it last had no request in progress
        self._header_timer: asyncio.TimerHandle | None = None
        self._stall_timer: asyncio.TimerHandle | None = None

    @property
    def busy(self) -> bool:
        """A request is in progress (its headers arrived; its response is not done)."""
        return self.cycle is not None and not self.cycle.response_complete

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections and not self._make_room():
            logger.warning("HTTP: %d connections, all busy: refusing a new one",
                           len(self.connections) - 1)
            transport.write(_BUSY)
            transport.close()
            return
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.busy:
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self.waiting_since = time.monotonic()
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
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

    def _make_room(self) -> bool:
        """Close the connection that has waited longest without a request in progress;
        False if every other connection is busy."""
        idle = [c for c in self.connections
                if c is not self and isinstance(c, GuardedH11Protocol) and not c.busy]
        if not idle:
            return False
        oldest = min(idle, key=lambda c: c.waiting_since)
        logger.warning("HTTP: connection limit (%d) reached: closing the connection that "
                       "waited longest without a request", self.limits.max_connections)
        oldest.transport.close()
        self.connections.discard(oldest)
        return True

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.limits.header_timeout_s,
                                                  self._on_header_timeout)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if not self.busy and not self.transport.is_closing():
            logger.warning("HTTP: closing a connection that sent no complete request "
                           "within %.0f s", self.limits.header_timeout_s)
            self.transport.close()

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
