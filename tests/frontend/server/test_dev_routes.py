"""frontend/server/dev_routes.py: the RL control routes of `pagellm serve
--enable-dev-endpoints`, in vLLM's shapes: sleep, wake, pause, collective_rpc and the
"nccl" weight-update phases driven over HTTP with a trainer broadcasting, behind the API
key; world sizes counted as vLLM counts them; values out of range refused with a 400.
References: vLLM's response shapes, and transformers' greedy tokens on the broadcast
weights. (Without the flag the routes do not exist: test_edge.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import SUPPORT, Server, free_port
from rl_helpers import PROMPTS, NcclTrainer, hf_greedy, hf_model, perturbed


def test_get_world_size_counts_every_worker_as_vllm_does() -> None:
    """Tensor-parallel ranks times engine cores (without the cores: include_dp=false):
    what a trainer sizes its weight-transfer group by. The engine's own figures come
    from its EngineInfo (checked in test_tensor_parallel and test_data_parallel)."""
    from types import SimpleNamespace

    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from pagellm.frontend.server.dev_routes import add_dev_routes
    from pagellm.protocol.messages import EngineInfo

    app = FastAPI()
    info = EngineInfo("m", 64, 100, 16, 8, 64, "cuda:0", "bfloat16", world_size=4,
                      data_parallel_size=2)
    add_dev_routes(app, SimpleNamespace(info=info), None)  # type: ignore[arg-type]
    with TestClient(app) as client:
        assert client.get("/get_world_size").json() == {"world_size": 8}
        assert client.get("/get_world_size?include_dp=false").json() == {"world_size": 4}


def test_reset_prefix_cache_takes_vllms_query_flags_and_answers_its_shape() -> None:
    """vLLM's route: `reset_running_requests` and `reset_external` (the engine API's
    `reset_connector`) as query flags read as vLLM's pydantic reads them, the answer
    {"success": bool} (false is a 200, as in vLLM: a refusal, not an error). A value that
    is no boolean was silently ignored (the route took no parameters); now it is a 400
    naming the parameter, in OpenAI's error shape rather than FastAPI's 422."""
    from types import SimpleNamespace
    from typing import Any

    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from pagellm.frontend.server.app import _add_error_handlers
    from pagellm.frontend.server.dev_routes import add_dev_routes

    calls: list[dict[str, bool]] = []

    async def reset_prefix_cache(**kwargs: bool) -> bool:
        calls.append(kwargs)
        return not kwargs["reset_connector"]  # no connector here: False, as pagellm's

    app = FastAPI()
    _add_error_handlers(app)
    engine: Any = SimpleNamespace(reset_prefix_cache=reset_prefix_cache)
    add_dev_routes(app, engine, None)  # type: ignore[arg-type]  # no route reads a body
    with TestClient(app) as client:
        for query, running, external in (
                ("", False, False), ("?reset_running_requests=true", True, False),
                ("?reset_external=True", False, True),
                ("?reset_running_requests=1&reset_external=off", True, False),
                ("?reset_running_requests=FALSE&reset_external=yes", False, True)):
            calls.clear()
            response = client.post("/reset_prefix_cache" + query)
            assert (response.status_code, response.json()) == (
                200, {"success": not external}), query
            assert calls == [{"reset_running_requests": running,
                              "reset_connector": external}], query
        calls.clear()
        for query, name in (("?reset_running_requests=ture", "reset_running_requests"),
                            ("?reset_external=", "reset_external"),
                            ("?reset_external=truee", "reset_external"),
                            ("?reset_running_requests=%C2%B9", "reset_running_requests")):
            response = client.post("/reset_prefix_cache" + query)
            error = response.json()["error"]
            assert response.status_code == 400 and error["param"] == name, (query, error)
            assert error["message"].startswith(f"{name} must be true or false"), error
        assert calls == []  # a refused value reaches no engine


def test_dev_routes_drive_sleep_pause_rpc_and_nccl_updates_over_http(
        model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    from helpers import NAME

    monkeypatch.setenv("PYTHONPATH", str(SUPPORT))
    model_dir = model_dirs["llama"]
    # Off unless asked for: tests/frontend/server/test_edge.py checks the 404s.
    server = Server(model_dir, "--enable-dev-endpoints", "--enable-sleep-mode",
                    "--weight-transfer-config", '{"backend": "nccl"}',
                    "--worker-extension-cls", "rl_extension.Probe", "--api-key", "k")
    key = {"Authorization": "Bearer k"}
    trainer: NcclTrainer | None = None
    try:
        def call(method: str, path: str, body: object = None) -> tuple[int, dict]:
            status, data = server.request(method, path, body, headers=key)
            return status, json.loads(data)

        def complete() -> str:
            response = server.client("k").completions.create(
                model=NAME, prompt=PROMPTS[1],
                max_tokens=8, temperature=0)
            return response.choices[0].text

        assert server.request("POST", "/sleep?level=1")[0] == 401  # behind the API key
        before = complete()
        assert call("POST", "/sleep?level=1") == (200, {"status": "sleeping", "level": 1})
        assert call("GET", "/is_sleeping") == (200, {"is_sleeping": True})
        status, body = call("POST", "/v1/completions", {
            "model": NAME, "prompt": "x", "max_tokens": 2})
        assert status == 503 and "sleeping" in body["error"]["message"]
        assert call("POST", "/wake_up?tags=kv_cache") == (
            200, {"status": "sleeping", "tags": ["kv_cache"]})
        assert call("POST", "/wake_up") == (200, {"status": "awake", "tags": None})
        assert complete() == before
        assert call("POST", "/pause?mode=keep") == (200, {"status": "paused"})
        assert call("GET", "/is_paused") == (200, {"is_paused": True})
        assert call("POST", "/resume") == (200, {"status": "resumed"})
        for path in ("/sleep?level=7", "/sleep?level=x", "/pause?mode=soon",
                     "/wake_up?tags=everything"):
            status, body = call("POST", path)
            assert status == 400 and body["error"]["message"], path
        assert call("GET", "/get_world_size") == (200, {"world_size": 1})
        assert call("GET", "/get_world_size?include_dp=false") == (200, {"world_size": 1})
        assert call("POST", "/reset_prefix_cache") == (200, {"success": True})
        assert call("POST", "/reset_prefix_cache?reset_running_requests=true") == (
            200, {"success": True})
        # No KV connector: the local cache is reset and the answer is false, as vLLM's.
        assert call("POST", "/reset_prefix_cache?reset_external=true") == (
            200, {"success": False})
        status, body = call("POST", "/collective_rpc", {"method": "describe", "args": ["p"],
                                                        "kwargs": {"scale": 3.0}})
        assert (status, body) == (200, {"results": [{"prefix": "p", "scale": 3.0,
                                                     "rank": 0}]})
        status, body = call("POST", "/collective_rpc", {"method": "fail"})
        assert status == 400 and "probe failed on purpose" in body["error"]["message"]
        status, body = call("POST", "/collective_rpc", {"method": "nap", "args": [2.0],
                                                        "timeout": 0.3})
        assert status == 504
        # The weight-update phases with a trainer broadcasting (gloo).
        init_info = {"master_address": "127.0.0.1", "master_port": free_port(),
                     "rank_offset": 1, "world_size": 2}
        trainer = NcclTrainer(model_dir, init_info)
        trainer.guard(server.engine_pid())
        assert call("POST", "/init_weight_transfer_engine", {"init_info": init_info}) == (
            200, {"message": "Weight transfer initialized"})
        update_info = trainer.joined()["update_info"]
        assert call("POST", "/start_weight_update")[0] == 200
        trainer.send()
        assert call("POST", "/update_weights", {"update_info": update_info}) == (
            200, {"message": "Weights updated"})
        assert call("POST", "/finish_weight_update", {"weight_version": "1"})[0] == 200
        assert trainer.finish() == 0
        reference = hf_model(model_dir, perturbed(model_dir, seed=7))
        ids = server.post("/tokenize", {"prompt": PROMPTS[1]}, headers=key)[1]["tokens"]
        tokens = hf_greedy(reference, ids, 8)
        from transformers import AutoTokenizer

        assert complete() == AutoTokenizer.from_pretrained(model_dir).decode(tokens)
    finally:
        if trainer is not None:
            trainer.stop()
        assert server.stop() == 0


def test_dev_routes_refuse_values_out_of_range(dev_server: Server) -> None:
    """A level past any integer the wire takes was a 500; a timeout that had passed
    before the call began was a 504 while the call still ran in the engine."""
    for path in ("/sleep?level=99999999999999999999999", "/sleep?level=%D9%A3"):
        status, data = dev_server.request("POST", path)
        assert status == 400 and b"level must be 0, 1 or 2" in data, (path, data)
    status, data = dev_server.request("POST", "/collective_rpc",
                                      {"method": "describe", "timeout": -1})
    assert status == 400 and b"timeout" in data, data
    assert not json.loads(dev_server.get("/is_sleeping")[1])["is_sleeping"]
