"""What a server started for RL must survive, over HTTP (issue 37, items 1 and 5-7): an
init that waits on a trainer that never comes, a loop blocked inside one call, responses
too large to build, logprobs JSON cannot spell, and states in which the engine would
answer 200 with garbage or nothing at all."""

from __future__ import annotations

import json
import math
import socket
import time
import urllib.request
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

import pytest
from helpers import NAME, Server, free_port

KEY = {"authorization": "Bearer k"}


@pytest.fixture
def server(rl_server: Server) -> Server:
    return rl_server


def call(server: Server, method: str, path: str, body: object = None) -> tuple[int, dict]:
    status, data = server.request(method, path, body, headers=KEY)
    return status, json.loads(data) if data else {}


def complete(server: Server, **body: object) -> tuple[int, dict]:
    return call(server, "POST", "/v1/completions",
                {"model": NAME, "prompt": "Tell me", "max_tokens": 6, "temperature": 0,
                 **body})


def init_info(port: int, host: str = "127.0.0.1") -> dict:
    return {"init_info": {"master_address": host, "master_port": port, "rank_offset": 1,
                          "world_size": 2}}


def test_an_init_whose_trainer_never_comes_stalls_no_one(server):
    """Item 1: init_weight_transfer_engine towards a port where nothing listens sat in
    torch's TCPStore connect loop on the engine's loop for up to 300 s; a second init
    queued behind it and every completion timed out while /health said 200. The join
    now waits off the loop, for init_timeout_s, and fails naming where it looked."""
    port = free_port()  # nothing listens there
    with ThreadPoolExecutor(2) as pool:
        start = time.monotonic()
        inits = [pool.submit(call, server, "POST", "/init_weight_transfer_engine",
                             init_info(port)) for _ in range(2)]
        done, pending = wait(inits, timeout=10, return_when=FIRST_COMPLETED)
        status, body = done.pop().result()  # whichever came second: refused at once
        assert status == 400 and "already in progress" in body["error"]["message"], body
        served = time.monotonic()
        status, body = complete(server)
        assert status == 200 and time.monotonic() - served < 5, body
        assert server.get("/health")[0] == 200
        status, body = pending.pop().result(timeout=60)
    message = body["error"]["message"]
    assert status == 400 and f"at 127.0.0.1:{port}" in message, body
    assert "within init_timeout_s=2" in message and time.monotonic() - start >= 2
    # The host is bounded where it enters (a 100,000-character name also went to the
    # connect loop), with a short message.
    status, body = call(server, "POST", "/init_weight_transfer_engine",
                        init_info(port, host="h" * 100_000))
    assert status == 400 and "master_address must be a host name" in \
        body["error"]["message"] and len(body["error"]["message"]) < 400, body
    assert complete(server)[0] == 200


def test_health_reports_a_loop_blocked_in_one_call_and_metrics_still_answer(server):
    """Item 1: with the loop blocked, /health kept answering 200 and /metrics turned
    into a 500 after 60 s. Here an extension naps 7 s inside collective_rpc."""
    with ThreadPoolExecutor(1) as pool:
        start = time.monotonic()
        nap = pool.submit(call, server, "POST", "/collective_rpc",
                          {"method": "nap", "args": [7.0]})
        while (status := server.get("/health"))[0] != 503:
            assert time.monotonic() - start < 5, "the stall was not reported"
            time.sleep(0.1)
        error = json.loads(status[1])["error"]
        assert "inside one step or control call" in error["message"], error
        assert "--engine-stall-timeout 1 s" in error["message"], error
        time.sleep(max(0.0, start + 6.0 - time.monotonic()))
        asked = time.monotonic()
        status, text = server.get("/metrics")
        assert status == 200 and time.monotonic() - asked < 2
        assert b"vllm:prompt_tokens_total" in text  # the server's own metrics
        assert nap.result(timeout=30)[0] == 200
    assert server.get("/health")[0] == 200
    assert b"vllm:num_requests_running" in server.get("/metrics")[1]


def test_responses_are_bounded_in_token_entries(server):
    """Item 5: n=256, max_tokens=50, logprobs=-1 grew the server to 11.4 GB, built on
    the event loop. n x max_tokens x (1 + logprobs) is bounded per request (here
    5000), streamed or not, before anything runs."""
    fits = {"n": 4, "max_tokens": 50, "logprobs": 20, "temperature": 1.0, "seed": 0,
            "ignore_eos": True}  # 4 x 50 x 21 = 4200 entries
    status, body = complete(server, **fits)
    assert status == 200 and len(body["choices"]) == 4, body
    assert all(len(c["logprobs"]["tokens"]) == 50 for c in body["choices"])
    for stream in (False, True):
        status, body = complete(server, **{**fits, "n": 8}, stream=stream)
        assert status == 400, body
        message = body["error"]["message"]
        assert "8400 token entries" in message and "--max-response-entries=5000" in message
    status, body = call(server, "POST", "/v1/chat/completions", {
        "model": NAME, "messages": [{"role": "user", "content": "hi"}], "n": 8,
        "max_tokens": 50, "logprobs": True, "top_logprobs": 20})
    assert status == 400 and "--max-response-entries" in body["error"]["message"], body
    # Prompt logprobs count too: every prompt token with its alternatives.
    status, body = complete(server, prompt="x " * 300, max_tokens=1, prompt_logprobs=20)
    assert status == 400 and "--max-response-entries" in body["error"]["message"], body


def _events(data: bytes) -> list[dict]:
    lines = [line.removeprefix(b"data: ") for line in data.split(b"\n\n") if line]
    assert lines[-1] == b"[DONE]", lines[-3:]
    return [json.loads(line) for line in lines[:-1]]


def test_non_finite_logprobs_read_as_vllms_minus_9999(server):
    """Item 6: a -inf logprob (here: tokens top_k masks, reported in processed mode) made
    a finished request a 500, "Out of range float values are not JSON compliant", and
    streams sent null. vLLM writes -9999.0; so does every route here."""
    sampled = {"prompt": "Hello", "max_tokens": 4, "temperature": 1.0, "top_k": 2,
               "seed": 3, "logprobs": 5}
    status, body = complete(server, **sampled)
    assert status == 200, body
    tops = body["choices"][0]["logprobs"]["top_logprobs"]
    values = [v for top in tops for v in top.values()]
    assert -9999.0 in values and all(math.isfinite(v) for v in values), values
    status, data = server.request("POST", "/v1/completions",
                                  {"model": NAME, **sampled, "stream": True}, headers=KEY)
    streamed = [v for event in _events(data) for c in event["choices"]
                for top in c["logprobs"]["top_logprobs"] for v in top.values()]
    assert status == 200 and -9999.0 in streamed and None not in streamed, streamed
    chat = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "temperature": 1.0, "top_k": 2, "seed": 3, "logprobs": True, "top_logprobs": 5}
    status, body = call(server, "POST", "/v1/chat/completions", chat)
    assert status == 200, body
    values = [t["logprob"] for c in body["choices"][0]["logprobs"]["content"]
              for t in c["top_logprobs"]]
    assert -9999.0 in values and all(math.isfinite(v) for v in values), values
    status, data = server.request("POST", "/v1/chat/completions", {**chat, "stream": True},
                                  headers=KEY)
    streamed = [t["logprob"] for event in _events(data) for c in event["choices"]
                if c["logprobs"] for entry in c["logprobs"]["content"]
                for t in entry["top_logprobs"]]
    assert status == 200 and -9999.0 in streamed and None not in streamed, streamed


def test_a_level_2_wake_without_weights_refuses_requests_until_they_are_loaded(server,
                                                                              model_dirs):
    """Item 7: after sleep(level=2) and wake_up() with no weights loaded the server
    answered 200 with garbage (25 of 25 cycles). Requests are now a 503 naming the state
    until every checkpoint tensor is loaded again (here: an extension's load_weights of
    the checkpoint, vLLM's reload_weights)."""
    before = complete(server)[1]["choices"][0]["text"]
    assert call(server, "POST", "/sleep?level=2")[0] == 200
    assert call(server, "POST", "/wake_up") == (200, {"status": "awake", "tags": None})
    status, body = complete(server)
    assert status == 503, body
    assert "discarded by sleep(level=2)" in body["error"]["message"], body
    status, body = call(server, "POST", "/collective_rpc", {
        "method": "reload_from", "args": [str(model_dirs["llama"])]})
    assert status == 200, body
    status, body = complete(server)
    assert status == 200 and body["choices"][0]["text"] == before


def test_a_request_waiting_under_pause_keep_ends_with_its_client(server):
    """Item 7: under pause(mode="keep") a new request waits with no answer, as in vLLM
    (docs/ARCHITECTURE.md and the README say so now); the client's own timeout or
    disconnect bounds the wait and aborts it in the engine, and it runs on resume."""
    assert call(server, "POST", "/pause?mode=keep")[0] == 200
    try:
        request = urllib.request.Request(
            server.url + "/v1/completions", method="POST", headers={
                **KEY, "content-type": "application/json"},
            data=json.dumps({"model": NAME, "prompt": "wait", "max_tokens": 4}).encode())
        with pytest.raises((TimeoutError, socket.timeout)):
            urllib.request.urlopen(request, timeout=1)
        deadline = time.monotonic() + 10
        while server.metric("vllm:num_requests_waiting"):  # aborted when the client left
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        assert call(server, "POST", "/resume")[0] == 200
    assert complete(server)[0] == 200
    assert server.metric("vllm:num_requests_waiting") == 0
