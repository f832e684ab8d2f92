"""LoRA adapters behind `pagellm serve` (vLLM's flags and routes): --lora-modules in
both forms, the request's `model` picking the adapter, /v1/models listing them with
their parent, the runtime load/unload routes (only with VLLM_ALLOW_RUNTIME_LORA_UPDATING,
behind the API key), and per-adapter metrics. Reference: transformers + PEFT's merged
model, greedy, decoded with the server's tokenizer."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import NAME, Server
from peft_adapters import make_adapter, merged

pytest.importorskip("peft")

KEY = "lora-secret"
AUTH = {"authorization": f"Bearer {KEY}"}
PROMPT = [17, 230, 45, 801, 99, 12, 640]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
             ) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("server-adapters")
    base = model_dirs["llama"]
    return {"qv": make_adapter(base, root / "qv", ["q_proj", "v_proj"], 8, 11),
            "mlp": make_adapter(base, root / "mlp", ["gate_proj", "up_proj", "down_proj"], 4,
                                12),
            "late": make_adapter(base, root / "late", ["o_proj", "k_proj"], 16, 13)}


@pytest.fixture(scope="module")
def expected(model_dirs: dict[str, Path], adapters: dict[str, Path]) -> dict[str, str]:
    """Each model name's greedy text after PROMPT (base model: NAME)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dirs["llama"])
    texts = {}
    for name, path in [(NAME, None), *adapters.items()]:
        model = merged(model_dirs["llama"], path)
        with torch.no_grad():
            out = model.generate(torch.tensor([PROMPT]), max_new_tokens=MAX_TOKENS,
                                 do_sample=False, attention_mask=torch.ones(1, len(PROMPT)))
        texts[name] = tokenizer.decode(out[0, len(PROMPT):], skip_special_tokens=True)
    assert len(set(texts.values())) == len(texts)  # every adapter changes the text
    return texts


@pytest.fixture(scope="module")
def server(model_dirs, adapters) -> Iterator[Server]:
    served = Server(model_dirs["llama"], "--enable-lora", "--max-loras", "2",
                    "--max-lora-rank", "16", "--dtype", "float32", "--api-key", KEY,
                    "--lora-modules", f"qv={adapters['qv']}",
                    json.dumps({"name": "mlp", "path": str(adapters["mlp"]),
                                "base_model_name": "the-base"}),
                    env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"})
    yield served
    assert served.stop() == 0


def complete(server: Server, model: str) -> tuple[int, dict[str, Any]]:
    return server.post("/v1/completions", {"model": model, "prompt": PROMPT,
                                           "max_tokens": MAX_TOKENS, "temperature": 0},
                       headers=AUTH)


def test_the_model_field_picks_the_adapter_and_models_lists_them(server, adapters, expected):
    status, body = server.request("GET", "/v1/models", headers=AUTH)
    cards = {c["id"]: c for c in json.loads(body)["data"]}
    assert status == 200 and set(cards) == {NAME, "qv", "mlp"}
    assert cards["qv"]["parent"] == NAME and cards["qv"]["root"] == str(adapters["qv"])
    assert cards["mlp"]["parent"] == "the-base" and cards[NAME]["parent"] is None
    with ThreadPoolExecutor(3) as pool:  # one batch mixing both adapters and the base
        answers = dict(zip([NAME, "qv", "mlp"], pool.map(
            lambda m: complete(server, m), [NAME, "qv", "mlp"]), strict=True))
    for model, (status, body) in answers.items():
        assert status == 200, body
        assert body["model"] == model and body["choices"][0]["text"] == expected[model]
    chat = server.client(KEY).chat.completions.create(
        model="qv", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert chat.model == "qv" and chat.choices[0].message.content is not None
    status, body = complete(server, "nope")
    assert status == 404 and "`nope` does not exist" in body["error"]["message"]
    text = server.get("/metrics")[1].decode()
    assert 'pagellm:lora_requests_total{engine="0",lora_name="qv",model_name="test-model"}' \
        in text
    assert server.metric("pagellm:lora_generation_tokens_total") >= 2 * MAX_TOKENS


def test_adapters_load_replace_and_unload_at_run_time(server, adapters, expected, tmp_path):
    load = {"lora_name": "late", "lora_path": str(adapters["late"])}
    assert server.request("POST", "/v1/load_lora_adapter", load)[0] == 401  # no key
    status, body = server.request("POST", "/v1/load_lora_adapter", load, headers=AUTH)
    assert status == 200 and b"'late' added" in body
    assert complete(server, "late")[1]["choices"][0]["text"] == expected["late"]
    again = server.request("POST", "/v1/load_lora_adapter", load, headers=AUTH)
    assert again[0] == 400 and b"already loaded" in again[1]
    # In place: "late" now holds qv's weights, and none of its cached KV is reused.
    status, _ = server.request("POST", "/v1/load_lora_adapter", {
        "lora_name": "late", "lora_path": str(adapters["qv"]), "load_inplace": True},
        headers=AUTH)
    assert status == 200
    assert complete(server, "late")[1]["choices"][0]["text"] == expected["qv"]
    (tmp_path / "broken").mkdir()
    status, body = server.request("POST", "/v1/load_lora_adapter", {
        "lora_name": "broken", "lora_path": str(tmp_path / "broken")}, headers=AUTH)
    assert status == 400 and b"has no adapter_config.json" in body
    assert complete(server, "broken")[0] == 404
    for name in ("late", "late"):
        status, body = server.request("POST", "/v1/unload_lora_adapter",
                                      {"lora_name": name}, headers=AUTH)
    assert status == 404 and b"cannot be found" in body
    assert complete(server, "late")[0] == 404
    assert complete(server, "qv")[1]["choices"][0]["text"] == expected["qv"]


def test_runtime_routes_need_the_switch_and_modules_need_enable_lora(model_dirs, adapters):
    plain = Server(model_dirs["llama"], "--enable-lora", "--lora-modules",
                   f"qv={adapters['qv']}", env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "0"})
    try:
        status, _ = plain.request("POST", "/v1/load_lora_adapter", {
            "lora_name": "x", "lora_path": str(adapters["mlp"])})
        assert status == 404
        assert complete(plain, "qv")[0] == 200
    finally:
        assert plain.stop() == 0
