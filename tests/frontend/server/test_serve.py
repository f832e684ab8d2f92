"""frontend/server/serve.py: the server's process. SIGTERM stops it within
--shutdown-timeout even while a stream runs (issue 12, finding 9: it waited for every
stream, 17 s seen, with no bound). The references are its exit status and how long it
took. (SIGTERM with an API key and a dead engine core is test_server.py's.)"""

from __future__ import annotations

import http.client
import json
import signal
import time

from helpers import NAME, Server


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
