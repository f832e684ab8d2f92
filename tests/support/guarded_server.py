"""Requests to the `guarded` server (tests/conftest.py: `pagellm serve` behind the API
key "sesame", trusting chat templates sent in requests, --max-connections 64) that its
tests share: tests/frontend/server/test_edge.py, test_serving.py,
test_template_sandbox.py, test_api_models.py and test_connections.py."""

from __future__ import annotations

import json
import time

from helpers import NAME, Server

MESSAGES = [{"role": "user", "content": "Tell me about blocks."}]
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
