"""No HTTP request or connection can stop the server for anyone else (issue 12):
API key on every route, body limits, chat templates from requests, tokenization off
the event loop, Slowloris, bounded shutdown."""

from __future__ import annotations

import asyncio
import functools
import http.client
import json
import signal
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import NAME, Server, free_port

MESSAGES = [{"role": "user", "content": "Tell me about blocks."}]


@pytest.fixture(scope="module")
def guarded(model_dirs, tmp_path_factory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("server") / "stderr.log"
    s = Server(model_dirs["llama"], "--api-key", "sesame", "--trust-request-chat-template",
               "--max-connections", "64", log=log)
    yield s
    assert s.stop() == 0


KEY = {"authorization": "Bearer sesame"}


def post(server: Server, path: str, body: object, headers: dict[str, str] | None = None
         ) -> tuple[int, dict]:
    status, data = server.request("POST", path, body, headers={**KEY, **(headers or {})})
    return status, json.loads(data) if data else {}


def completion_text(server: Server, **body: object) -> str:
    status, response = post(server, "/v1/completions", {"model": NAME, "max_tokens": 8,
                                                         "temperature": 0, **body})
    assert status == 200, response
    return response["choices"][0]["text"]


def timed_health(server: Server) -> float:
    start = time.monotonic()
    assert server.get("/health")[0] == 200
    return time.monotonic() - start


def test_the_api_key_guards_every_route_but_health_ping_metrics_and_version(guarded):
    """Finding 6: /tokenize, /detokenize, /docs and /openapi.json were open."""
    for method, path in (("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/docs"),
                         ("GET", "/openapi.json"), ("GET", "/redoc"), ("GET", "/v1/models"),
                         ("POST", "/v1/completions"), ("GET", "/no/such/route"),
                         ("GET", "/tokenizer_info")):
        status, data = guarded.request(method, path, {"prompt": "x"})
        assert status == 401, (path, data)
        assert json.loads(data)["error"]["type"] == "AuthenticationError"
    for path in ("/health", "/ping", "/metrics", "/version"):
        assert guarded.get(path)[0] == 200, path
    status, body = post(guarded, "/tokenize", {"prompt": "x"})
    assert status == 200 and body["count"] >= 1


def test_bodies_over_the_limit_are_refused_before_they_are_read(guarded):
    # A declared length over the limit: answered without sending a byte of the body.
    with socket.create_connection(("127.0.0.1", guarded.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nauthorization: Bearer "
                  b"sesame\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
                  % (17 * 2**20))
        answer = _response(s)
    assert answer.startswith(b"HTTP/1.1 413") and b"larger than 16777216 bytes" in answer
    # Without a Content-Length (chunked), the limit holds while reading.
    connection = http.client.HTTPConnection("127.0.0.1", guarded.port, timeout=30)
    connection.putrequest("POST", "/tokenize")
    connection.putheader("authorization", KEY["authorization"])
    connection.putheader("transfer-encoding", "chunked")
    connection.endheaders()
    chunk = b"x" * 2**20
    try:
        for _ in range(20):
            connection.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
    except OSError:
        pass  # the server may close once it has answered
    response = connection.getresponse()
    assert response.status == 413
    connection.close()
    assert completion_text(guarded, prompt="still serving")


def test_a_huge_prompt_is_refused_before_tokenization_and_health_stays_fast(guarded):
    """Finding 6: a 10 MB /tokenize (tokenized on the event loop) blocked the server."""
    prompt = "a b " * 2_500_000  # 10 MB
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(post, guarded, path, body) for path, body in (
            ("/tokenize", {"prompt": prompt}),
            ("/v1/completions", {"model": NAME, "prompt": prompt}),
            ("/v1/chat/completions", {"model": NAME, "messages": [
                {"role": "user", "content": prompt}]}))]
        health = [timed_health(guarded) for _ in range(5)]
        results = [f.result() for f in futures]
    for status, body in results:
        assert status == 400 and "characters: more than max_model_len" in \
            body["error"]["message"], body
    assert max(health) < 2.0, health


def test_chat_templates_from_requests_run_sandboxed_with_a_time_limit(guarded, tokenizer,
                                                                       hf_reference):
    """Finding 3: a nested-loop template froze /health and even SIGTERM (the class of
    vLLM's CVE-2025-61620). Requests' templates now render in a killable process."""
    loop = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
            "{% endfor %}")
    bomb = "{{ 'x' * 10000000000 }}"
    with ThreadPoolExecutor(2) as pool:
        slow = pool.submit(post, guarded, "/v1/chat/completions", {
            "model": NAME, "messages": MESSAGES, "chat_template": loop})
        time.sleep(0.5)
        health = [timed_health(guarded) for _ in range(5)]  # while the template spins
        status, body = slow.result()
    assert status == 400 and "did not finish within 5 s" in body["error"]["message"], body
    assert max(health) < 2.0, health
    status, body = post(guarded, "/v1/chat/completions", {
        "model": NAME, "messages": MESSAGES, "chat_template_kwargs": {"chat_template": bomb}})
    assert status == 400 and "chat template failed" in body["error"]["message"], body
    # A harmless custom template works, and its tokens are the rendered text's.
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    status, body = post(guarded, "/v1/chat/completions", {
        "model": NAME, "messages": MESSAGES, "chat_template": template, "max_tokens": 6,
        "temperature": 0})
    assert status == 200, body
    ids = tokenizer.encode("<user>Tell me about blocks.\n", add_special_tokens=False)
    assert body["usage"]["prompt_tokens"] == len(ids)
    expected = tokenizer.decode(hf_reference("llama", ids, 6), skip_special_tokens=True)
    assert body["choices"][0]["message"]["content"] == expected
    status, body = post(guarded, "/v1/chat/completions", {
        "model": NAME, "messages": MESSAGES, "chat_template_kwargs": {"return_tensors": "pt"}})
    assert status == 400 and "return_tensors" in body["error"]["message"]


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
    import uvicorn

    from pagellm.frontend.server.connections import ConnectionLimits, GuardedH11Protocol

    release = threading.Event()

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        if scope["path"] == "/slow":
            await asyncio.get_running_loop().run_in_executor(None, release.wait, 10)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    port = free_port()
    limits = ConnectionLimits(max_connections=8, header_timeout_s=0.5)
    config = uvicorn.Config(app, port=port, lifespan="off", log_level="error",
                            http=functools.partial(GuardedH11Protocol, limits=limits))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:  # a port taken meanwhile ends the thread: fail, not hang
        assert thread.is_alive() and time.monotonic() < deadline
        time.sleep(0.01)
    opened: list[socket.socket] = []
    try:
        half = [_half_open(port) for _ in range(20)]  # more than the limit
        opened += half
        assert _get(port, "/") == 200  # the oldest waiting connection made room
        time.sleep(1.0)
        assert all(_closed_by_server(s) for s in half)  # header timeout
        busy = [_half_open(port, b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n") for _ in range(8)]
        opened += busy
        # Every connection is mid-request once the 8 reach /slow: refuse the new one.
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
        server.should_exit = True
        thread.join(10)


def _response(s: socket.socket) -> bytes:
    """One whole HTTP response (headers and a Content-Length body) from a raw socket."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += _recv(s, data)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")))
    while len(body) < length:
        body += _recv(s, body)
    return head + b"\r\n\r\n" + body


def _recv(s: socket.socket, so_far: bytes) -> bytes:
    """The next bytes; a connection the server closed early is a failure (recv would
    return b"" at once, forever)."""
    chunk = s.recv(4096)
    assert chunk, f"the server closed the connection after {so_far[:200]!r}"
    return chunk


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


def test_a_body_that_never_arrives_times_out(monkeypatch):
    from fastapi import Request

    from pagellm.frontend.server import edge

    monkeypatch.setattr(edge, "BODY_TIMEOUT_S", 0.2)

    async def receive() -> dict:
        await asyncio.sleep(0.05)
        return {"type": "http.request", "body": b"x", "more_body": True}  # forever

    request = Request({"type": "http", "method": "POST", "headers": []}, receive)
    with pytest.raises(edge.APIError) as info:
        asyncio.run(edge.read_body(request, 2**20))
    assert info.value.status == 408


def test_sigterm_stops_the_server_within_its_shutdown_timeout(model_dirs):
    """Finding 9: SIGTERM waited for every stream (17 s seen) with no bound."""
    server = Server(model_dirs["llama"], "--shutdown-timeout", "1")
    try:
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        connection.request("POST", "/v1/completions", json.dumps({
            "model": NAME, "prompt": "never finish", "max_tokens": 1900, "ignore_eos": True,
            "stream": True}), {"content-type": "application/json"})
        response = connection.getresponse()
        response.fp.readline()  # streaming
        signalled = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) == 0
        assert time.monotonic() - signalled < 8
        connection.close()
    finally:
        server.stop()


@pytest.fixture(scope="module")
def tokenizer(model_dirs):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dirs["llama"])
