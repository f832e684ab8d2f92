"""frontend/server/connections.py: GuardedH11Protocol against slow and idle
connections (Slowloris; issue 12, red-team finding 4, issue 37 item 8). Half-open
connections and slow headers never crowd out a request; a client that never reads is
closed after the write-stall bound, freeing its slot and aborting its requests, while
one that reads slowly keeps its stream; a dripping body is answered 408 and closed at
the body deadline; one client gets only its share of the connections. Most tests run
the protocol alone in an in-process uvicorn with short bounds (`_guarded_server`,
`_StallProbe`); two run the real server (the `guarded` one of tests/conftest.py, and
serve.py with a short stall bound). The references are what raw sockets see, and when."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import http.client
import json
import select
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, NamedTuple

import pytest
from guarded_server import completion_text, timed_health
from helpers import NAME, free_port

if TYPE_CHECKING:
    from pagellm.frontend.server.connections import ConnectionLimits


def test_half_open_connections_never_crowd_out_a_request(guarded):
    """Finding 7: half-open connections were held forever; ~20k exhausted the file
    descriptors and /health stopped. Here --max-connections is 64: 300 half-open
    connections later, requests still get through, and the log stays short."""
    lines_before = guarded.log_lines()
    sockets = []
    try:
        for _ in range(300):
            s = socket.create_connection(("127.0.0.1", guarded.port))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # never finished
            sockets.append(s)
        assert completion_text(guarded, prompt="through the crowd")
        assert timed_health(guarded) < 2.0
    finally:
        for s in sockets:
            s.close()
    assert guarded.log_lines() - lines_before < 20  # warnings are rate-limited


def test_the_connection_guard_closes_slow_headers_and_refuses_only_when_all_are_busy():
    """GuardedH11Protocol on its own, with a short header timeout."""
    from pagellm.frontend.server.connections import ConnectionLimits

    release = threading.Event()
    # One client (this test) may take every slot here: the limit in all is what is tested.
    limits = ConnectionLimits(max_connections=8, max_connections_per_client=8,
                              header_timeout_s=0.5)
    opened: list[socket.socket] = []
    with _guarded_server(limits, release, [], []) as port:
        try:
            half = [_half_open(port) for _ in range(20)]  # more than the limit
            opened += half
            assert _get(port, "/") == 200  # the oldest waiting connection made room
            time.sleep(1.0)
            assert all(_closed_by_server(s) for s in half)  # header timeout
            busy = [_half_open(port, b"GET /ignore HTTP/1.1\r\nHost: x\r\n\r\n")
                    for _ in range(8)]
            opened += busy
            # Every connection is mid-request once the 8 reach /ignore: refuse a new one.
            deadline = time.monotonic() + 10
            while (status := _get(port, "/")) != 503 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert status == 503
            release.set()
            assert all(b"200 OK" in s.recv(1024) for s in busy)
            assert _get(port, "/") == 200
        finally:
            release.set()
            for s in opened:
                s.close()


def _half_open(port: int, data: bytes = b"GET / HTTP/1.1\r\nHost: x\r\n") -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(data)
    return s


def _closed_by_server(s: socket.socket) -> bool:
    s.settimeout(1.0)
    try:
        return s.recv(1024) == b""
    except ConnectionResetError:
        return True


def _get(port: int, path: str) -> int:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("GET", path)
        return connection.getresponse().status
    finally:
        connection.close()


# -- Write stalls: clients that stop reading their responses (red-team finding 4) ------

STALL_S = 1.0  # the write-stall bound in these tests (the server's is 30 s)


class _StallProbe:
    """An in-process uvicorn server on GuardedH11Protocol: GET /stream?bytes=N streams N
    bytes (without N, forever) through Starlette's StreamingResponse, as the app's
    streams go; any other path answers 200. It records when writes were paused and
    when each stream ended, with how many bytes. The server's send buffers are pinned
    small: on loopback the kernel would otherwise take megabytes before flow control
    engages."""

    def __init__(self, max_connections: int) -> None:
        import uvicorn
        from starlette.responses import StreamingResponse

        from pagellm.frontend.server.connections import ConnectionLimits, GuardedH11Protocol

        self.paused: list[float] = []
        self.ended: list[tuple[float, int]] = []
        probe = self

        class Protocol(GuardedH11Protocol):
            def connection_made(self, transport: asyncio.Transport) -> None:
                transport.get_extra_info("socket").setsockopt(
                    socket.SOL_SOCKET, socket.SO_SNDBUF, 32 * 1024)
                super().connection_made(transport)

            def pause_writing(self) -> None:
                probe.paused.append(time.monotonic())
                super().pause_writing()

        async def app(scope, receive, send):
            if scope["type"] != "http":
                return
            if scope["path"] != "/stream":
                await send({"type": "http.response.start", "status": 200, "headers": []})
                await send({"type": "http.response.body", "body": b"ok"})
                return
            total = int(scope["query_string"].partition(b"=")[2] or -1)
            sent = 0

            async def chunks():
                nonlocal sent
                while sent != total:
                    chunk = b"x" * (8192 if total < 0 else min(8192, total - sent))
                    sent += len(chunk)
                    yield chunk
                    await asyncio.sleep(0)

            await StreamingResponse(chunks())(scope, receive, send)
            self.ended.append((time.monotonic(), sent))

        self.port = free_port()
        limits = ConnectionLimits(max_connections=max_connections,
                                  max_connections_per_client=max_connections,
                                  write_stall_timeout_s=STALL_S)
        config = uvicorn.Config(app, port=self.port, lifespan="off", log_level="error",
                                http=functools.partial(Protocol, limits=limits))
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:  # a port taken meanwhile ends the thread
            assert self.thread.is_alive() and time.monotonic() < deadline
            time.sleep(0.01)

    def stream(self, total: int | None = None) -> socket.socket:
        """A client with a small receive buffer that has asked for a stream."""
        query = b"" if total is None else b"?bytes=%d" % total
        return _small_buffer_client(self.port, b"GET /stream%s HTTP/1.1\r\nHost: x\r\n\r\n"
                                    % query)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        assert not self.thread.is_alive()


def test_a_client_that_never_reads_is_closed_after_the_stall_bound_freeing_its_slot():
    """Finding 4: once a non-reading client's socket buffers filled, its connection
    stayed busy forever (so never evictable), and --max-connections of them had every
    other client refused with 503. Now a connection whose writes stay paused for the
    bound is aborted, the app sees a disconnect, and the slot is free again."""
    probe = _StallProbe(max_connections=2)
    stuck: list[socket.socket] = []
    try:
        stuck = [probe.stream(), probe.stream()]  # never read
        _wait_for(probe.paused, 2, timeout=10)  # both sockets are full
        first_pause = min(probe.paused)
        assert _get(probe.port, "/") == 503  # every slot is held by a stalled stream
        _wait_for(probe.ended, 2, timeout=STALL_S + 10)  # the streams saw a disconnect
        assert min(when for when, _ in probe.ended) >= first_pause + STALL_S - 0.05
        for s in stuck:
            _read_to_eof(s)  # what the kernel still held, then the server's close
        assert _get(probe.port, "/") == 200  # the slots are free again
    finally:
        for s in stuck:
            s.close()
        probe.stop()


def test_a_client_that_reads_slowly_but_steadily_is_not_cut_off():
    """The bound is on one stall, not on the response: a client that keeps draining its
    socket (~300 KB/s here, so each pause ends well within the bound) gets all of a
    response that takes longer than the bound, paused again and again on the way."""
    probe = _StallProbe(max_connections=2)
    total, rate = 640 * 1024, 300 * 1024  # bytes, bytes per second
    s = probe.stream(total)
    try:
        s.settimeout(10)
        data = b""
        start = time.monotonic()
        while not data.endswith(b"\r\n0\r\n\r\n"):  # the chunked body's last chunk
            chunk = s.recv(8192)
            assert chunk, f"closed by the server after {len(data)} bytes"
            data += chunk
            # Keep to the rate on average: after a late wake-up, read sooner.
            time.sleep(max(0.0, start + len(data) / rate - time.monotonic()))
        assert time.monotonic() - start > 1.5 * STALL_S
        assert data.startswith(b"HTTP/1.1 200 OK")
        assert len(probe.paused) >= 3  # flow control did hold the stream back
        assert [sent for _, sent in probe.ended] == [total]
    finally:
        s.close()
        probe.stop()


# The real server with --max-connections 2 (both for this one client), a short stall
# bound and small send buffers
# (names swapped in serve's module before it runs, as test_server's heap probe does).
STALL_SERVER = """
import socket, sys
from dataclasses import dataclass
from pagellm.frontend.server import connections, serve
from pagellm.frontend.server.options import ServerOptions
from pagellm.logger import configure_logging
from pagellm.protocol.engine_args import EngineArgs


@dataclass(frozen=True)
class QuickStall(connections.ConnectionLimits):
    write_stall_timeout_s: float = float(sys.argv[3])


class SmallSendBuffers(connections.GuardedH11Protocol):
    def connection_made(self, transport):
        transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF,
                                                      32 * 1024)
        super().connection_made(transport)


serve.ConnectionLimits, serve.GuardedH11Protocol = QuickStall, SmallSendBuffers
configure_logging()
args = EngineArgs(model=sys.argv[1], kv_cache_memory_bytes=8 << 20)
sys.exit(serve.run_server(args, ServerOptions(served_model_name=sys.argv[4]), "127.0.0.1",
                          int(sys.argv[2]), max_connections=2, max_connections_per_client=2))
"""


def test_the_server_closes_stalled_streams_aborts_their_requests_and_serves_again(
        model_dirs):
    """Finding 4 end to end: two streaming completions whose clients never read hold
    both of --max-connections 2; after the bound both are closed, their requests are
    aborted in the engine (none finished: 1900 tokens each), and a new client is
    served."""
    import os
    import subprocess
    import sys

    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-c", STALL_SERVER, str(model_dirs["llama"]), str(port),
         str(STALL_S), NAME], env={**os.environ, "PAGELLM_LOG_LEVEL": "WARNING"})
    stuck: list[socket.socket] = []
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None and time.monotonic() < deadline
            try:
                if _get(port, "/health") == 200:
                    break
            except OSError:
                time.sleep(0.2)
        body = json.dumps({"model": NAME, "prompt": "never read", "max_tokens": 1900,
                           "ignore_eos": True, "n": 4, "logprobs": 5, "stream": True})
        request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: "
                   b"application/json\r\ncontent-length: %d\r\n\r\n%s"
                   % (len(body), body.encode()))
        stuck = [_small_buffer_client(port, request) for _ in range(2)]
        deadline = time.monotonic() + 10
        while (status := _get(port, "/health")) != 503 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert status == 503  # both slots are taken by the streams (/metrics too)
        deadline = time.monotonic() + STALL_S + 20
        while (status := _get(port, "/health")) != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert status == 200  # a slot is free again
        deadline = time.monotonic() + 10
        while _metric(port, "vllm:num_requests_running") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _metric(port, "vllm:num_requests_running") == 0
        assert _metric(port, "vllm:request_success_total") == 0  # aborted, not finished
        assert 0 < _metric(port, "vllm:generation_tokens_total") < 2 * 4 * 1900
        for s in stuck:  # both streams ended (reading one still open would revive it)
            _read_to_eof(s)
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        connection.request("POST", "/v1/completions", json.dumps({
            "model": NAME, "prompt": "and now", "max_tokens": 2}),
            {"content-type": "application/json"})
        assert connection.getresponse().status == 200
        connection.close()
    finally:
        for s in stuck:
            s.close()
        server.send_signal(signal.SIGTERM)
        try:
            assert server.wait(60) == 0
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()


def _small_buffer_client(port: int, request: bytes) -> socket.socket:
    """A client with a 4 KiB receive buffer (set before connecting, so the window is
    small from the start) that has sent `request` and reads nothing yet."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    s.sendall(request)
    return s


def _wait_for(events: list, count: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while len(events) < count:
        assert time.monotonic() < deadline, f"{len(events)} of {count} within {timeout} s"
        time.sleep(0.01)


def _read_to_eof(s: socket.socket) -> None:
    """Read what the kernel still holds for this client up to the server's close (EOF
    or a reset); a connection still open fails with a timeout."""
    s.settimeout(5)
    try:
        while s.recv(65536):
            pass
    except ConnectionResetError:
        pass


def _metric(port: int, name: str) -> float:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("GET", "/metrics")
        response = connection.getresponse()
        assert response.status == 200
        text = response.read().decode()
    finally:
        connection.close()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{"))


# --- slow bodies and one client's share of the connections (issue 37, item 8) ----------

BODY_S = 1.0  # the body deadline in these tests (the server's is 30 s)
LINGER_S = 0.3  # how long a closed connection still drains (the server's is 2 s)
DRIP_S = 0.2  # a byte of body this often


class _Drip(NamedTuple):
    """What a dripping client saw, in seconds from its headers: the answer (None: none
    came) and when it came, the server's EOF (or reset), the first write refused."""

    data: bytes
    answered: float | None
    eof: float | None
    refused: float | None


@contextlib.contextmanager
def _guarded_server(limits: ConnectionLimits, release: threading.Event, started: list[str],
                    ended: list[str]) -> Iterator[int]:
    """An in-process uvicorn on GuardedH11Protocol (its port); its app records each
    request's path as it starts (`started`) and what ended a body it read (`ended`):
    /read reads its body, then answers; /ignore never reads it and answers once
    `release` is set; /stream starts its response without reading and finishes it
    once `release` is set; any other path answers at once."""
    import uvicorn

    from pagellm.frontend.server.connections import GuardedH11Protocol

    async def wait_for_release() -> None:
        await asyncio.get_running_loop().run_in_executor(None, release.wait, 10)

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        started.append(scope["path"])
        if scope["path"] == "/read":
            message = await receive()
            while message["type"] == "http.request" and message["more_body"]:
                message = await receive()
            ended.append(message["type"])
        elif scope["path"] == "/ignore":
            await wait_for_release()
        elif scope["path"] == "/stream":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"part", "more_body": True})
            await wait_for_release()
            await send({"type": "http.response.body", "body": b""})
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    port = free_port()
    config = uvicorn.Config(app, port=port, lifespan="off", log_level="error",
                            http=functools.partial(GuardedH11Protocol, limits=limits))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:  # a port taken meanwhile ends the thread: fail, not hang
        assert thread.is_alive() and time.monotonic() < deadline
        time.sleep(0.01)
    try:
        yield port
    finally:
        release.set()
        server.should_exit = True
        thread.join(10)
        assert not thread.is_alive()


def _body_headers(path: str) -> bytes:
    return (b"POST %s HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 100000\r\n\r\n" % path.encode())


def _drip(port: int, path: str, seconds: float) -> _Drip:
    """Valid headers and Content-Length 100000 for `path`, then a byte every DRIP_S
    for up to `seconds` (or until a write is refused), reading whatever comes back."""
    s = socket.create_connection(("127.0.0.1", port))
    data, answered, eof, refused = b"", None, None, None
    try:
        s.sendall(_body_headers(path))
        start = next_byte = time.monotonic()
        while (now := time.monotonic()) - start < seconds:
            if eof is None:
                if select.select([s], [], [], max(0.0, next_byte - now))[0]:
                    try:
                        chunk = s.recv(65536)
                    except ConnectionResetError:
                        chunk = b""
                    if chunk:
                        data += chunk
                        answered = time.monotonic() - start if answered is None else answered
                    else:
                        eof = time.monotonic() - start
                    continue
            else:
                time.sleep(max(0.0, next_byte - now))
            try:
                s.send(b"x")
            except OSError:
                refused = time.monotonic() - start
                break
            next_byte += DRIP_S
    finally:
        s.close()
    return _Drip(data, answered, eof, refused)


@pytest.mark.parametrize("path", ["/read", "/ignore"])
def test_a_dripping_body_is_answered_408_and_closed_at_the_body_deadline(path):
    """Issue 37: valid headers, Content-Length 100000, then a byte every 4 s: writes
    were still accepted at 39 s, past the 30 s body deadline (the app's 408 left the
    connection to the 10 s header timeout, and a route that never reads its body had no
    deadline at all). Now the connection answers 408 at the deadline, whether its route
    reads the body or not, and refuses the client's writes once it has drained briefly."""
    from pagellm.frontend.server.connections import ConnectionLimits

    release, started, ended = threading.Event(), [], []
    limits = ConnectionLimits(body_timeout_s=BODY_S, linger_s=LINGER_S)
    with _guarded_server(limits, release, started, ended) as port:
        drip = _drip(port, path, seconds=BODY_S + 5)
        if path == "/read":
            deadline = time.monotonic() + 5
            while not ended and time.monotonic() < deadline:
                time.sleep(0.01)
            assert ended == ["http.disconnect"]  # the handler saw a client that left
    assert drip.data.startswith(b"HTTP/1.1 408"), drip
    assert b'"RequestTimeoutError"' in drip.data and b"within 1 s" in drip.data, drip
    assert drip.answered is not None and BODY_S - 0.05 < drip.answered < BODY_S + 0.5, drip
    assert drip.eof is not None and drip.eof - drip.answered < 0.3, drip
    assert drip.refused is not None and drip.refused < BODY_S + LINGER_S + 1.0, drip


def test_a_dripping_body_cuts_a_response_already_started_at_the_body_deadline():
    """A route that streams before reading its body kept the connection as long as the
    body dripped: at the deadline the response is cut (reset), not finished."""
    from pagellm.frontend.server.connections import ConnectionLimits

    release, started, ended = threading.Event(), [], []
    limits = ConnectionLimits(body_timeout_s=BODY_S, linger_s=LINGER_S)
    with _guarded_server(limits, release, started, ended) as port:
        drip = _drip(port, "/stream", seconds=BODY_S + 5)
    assert drip.data.startswith(b"HTTP/1.1 200") and b"part" in drip.data, drip
    assert not drip.data.endswith(b"0\r\n\r\n"), drip  # never finished
    assert drip.answered is not None and drip.answered < 0.5, drip
    assert drip.eof is not None and BODY_S - 0.05 < drip.eof < BODY_S + 0.5, drip
    assert drip.refused is not None and drip.refused < BODY_S + 1.0, drip


def test_a_connection_answered_before_its_body_arrived_is_closed_at_once():
    """A complete answer to a request whose body is still arriving (as the app's 401,
    404 or 413 are) left the connection to the header timeout, the body dripping
    meanwhile: it can never carry another request, so it closes at once."""
    from pagellm.frontend.server.connections import ConnectionLimits

    release, started, ended = threading.Event(), [], []
    limits = ConnectionLimits(body_timeout_s=30, linger_s=LINGER_S)
    with _guarded_server(limits, release, started, ended) as port:
        drip = _drip(port, "/early", seconds=3)
    assert drip.data.startswith(b"HTTP/1.1 200"), drip
    assert drip.data.endswith(b"ok\r\n0\r\n\r\n"), drip  # complete (chunked)
    assert drip.answered is not None and drip.eof is not None, drip
    assert drip.eof - drip.answered < 0.3, drip
    assert drip.refused is not None and drip.refused < LINGER_S + 1.0, drip


def test_one_client_holding_its_share_with_slow_bodies_leaves_room_for_others():
    """Issue 37: slow bodies from one client held 2047 of 2048 connection slots. With
    --max-connections 8 (so 4 per client by default), a client at 127.0.0.2 opening a
    waiting connection and then 8 requests with dripping bodies gets 4 connections: its
    own waiting one makes room for the 4th, the rest are refused with 503. A client at
    127.0.0.1 is still served, and its own waiting connection, older than any of them,
    is left alone."""
    from pagellm.frontend.server.connections import ConnectionLimits

    release, started, ended = threading.Event(), [], []
    limits = ConnectionLimits(max_connections=8, body_timeout_s=30)
    assert limits.per_client == 4
    opened: list[socket.socket] = []
    with _guarded_server(limits, release, started, ended) as port:
        try:
            other_waiting = _half_open(port)
            opened.append(other_waiting)
            waiting = _connect_from("127.0.0.2", port, b"GET / HTTP/1.1\r\nHost: x\r\n")
            opened.append(waiting)
            outcomes = []
            for _ in range(8):
                before = len(started)
                s = _connect_from("127.0.0.2", port, _body_headers("/read") + b"{")
                opened.append(s)
                outcomes.append(_served_or_refused(s, started, before))
            assert outcomes == ["served"] * 4 + ["refused"] * 4
            assert _closed_by_server(waiting)  # the 4th took its own client's idle slot
            assert _get(port, "/") == 200
            other_waiting.sendall(b"\r\n")  # finish the first client's waiting request
            assert other_waiting.recv(1024).startswith(b"HTTP/1.1 200")
        finally:
            for s in opened:
                s.close()


def _connect_from(address: str, port: int, data: bytes) -> socket.socket:
    """A connection from another loopback address (Linux routes all of 127.0.0.0/8 to
    the loopback interface), so the server sees another client."""
    s = socket.socket()
    s.bind((address, 0))
    s.connect(("127.0.0.1", port))
    s.sendall(data)
    return s


def _served_or_refused(s: socket.socket, started: list[str], before: int) -> str:
    """Whether the server took the request on `s` to its app or answered 503."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if len(started) > before:
            return "served"
        if select.select([s], [], [], 0.01)[0]:
            data = s.recv(1024)
            return "refused" if data.startswith(b"HTTP/1.1 503") else repr(data)
    return "no answer"
