"""frontend/server/edge.py: the HTTP edge bounds what a client sends before any handler
reads it (issue 12): the API key guards every route but /health, /ping, /metrics and
/version (the RL dev routes do not exist without --enable-dev-endpoints), and a body
over the limit is refused with a 413 before it is read, with a Content-Length or
without one (chunked). Against the `guarded` server (tests/conftest.py); the
references are the status codes and OpenAI-shaped errors seen over raw sockets."""

from __future__ import annotations

import http.client
import json
import socket

from guarded_server import KEY, completion_text, post


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
    # The RL dev routes exist only with --enable-dev-endpoints (test_dev_routes.py).
    for path in ("/sleep?level=1", "/collective_rpc", "/update_weights"):
        assert post(guarded, path, {})[0] == 404, path


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
