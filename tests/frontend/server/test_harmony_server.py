"""gpt-oss's Harmony output over HTTP, as vLLM serves it with `--reasoning-parser
openai_gptoss --tool-call-parser openai --enable-auto-tool-choice`: a server on
tests/conftest.py's harmony_model_dir (Harmony's tags are special tokens there, as in
gpt-oss's tokenizer, so the server must decode them for the parsers even when the
client asks skip_special_tokens). A random model writes no Harmony of itself: a regex
(structured outputs, applied from the first token with enable_in_reasoning) makes it
write a whole Harmony reply, and the test checks what the chat API makes of it, whole
and streamed through the openai client, against the regex's parts."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest
from helpers import NAME, Server

ANALYSIS = r"<\|channel\|>analysis<\|message\|>([ab]{2,5})<\|end\|>"
CALL = (r"<\|start\|>assistant<\|channel\|>commentary to=functions\.get_weather "
        r'<\|constrain\|>json<\|message\|>\{"city": "(Paris|Rome)"\}<\|call\|>')
FINAL = r"<\|start\|>assistant<\|channel\|>final<\|message\|>([ab]{1,4})<\|return\|>"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
USER = [{"role": "user", "content": "Weather?"}]


@pytest.fixture(scope="module")
def harmony_server(harmony_model_dir, tmp_path_factory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("harmony-server") / "stderr.log"
    s = Server(harmony_model_dir, "--enable-auto-tool-choice", "--tool-call-parser",
               "openai", "--reasoning-parser", "openai_gptoss",
               "--structured-outputs-config.enable_in_reasoning", "true", log=log)
    yield s
    assert s.stop() == 0


def _chat(server: Server, regex: str, **body) -> dict:
    status, response = server.post("/v1/chat/completions", {
        "model": NAME, "messages": USER, "max_tokens": 120, "seed": 5, "n": 3,
        "structured_outputs": {"regex": regex}, "skip_special_tokens": True,
        "return_token_ids": True, **body})
    assert status == 200, response
    return response


def test_a_harmony_call_is_reasoning_and_a_tool_call(harmony_server):
    response = _chat(harmony_server, ANALYSIS + CALL, tools=[WEATHER])
    for choice in response["choices"]:
        message = choice["message"]
        assert choice["finish_reason"] == "tool_calls", choice
        assert re.fullmatch("[ab]{2,5}", message["reasoning_content"]), message
        assert message["content"] is None
        (call,) = message["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Rome")

    stream = harmony_server.client().chat.completions.create(
        model=NAME, messages=USER, max_tokens=120, seed=5, stream=True, tools=[WEATHER],
        extra_body={"structured_outputs": {"regex": ANALYSIS + CALL}})
    reasoning, content, calls, finish = "", "", [], None
    for chunk in stream:
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        calls += [(c.function.name, json.loads(c.function.arguments))
                  for c in delta.tool_calls or []]
        finish = chunk.choices[0].finish_reason or finish
    assert re.fullmatch("[ab]{2,5}", reasoning) and content == "" and finish == "tool_calls"
    assert [name for name, _ in calls] == ["get_weather"]


def test_a_harmony_answer_is_reasoning_and_content(harmony_server):
    """Without tools too (the reasoning parser alone); the final message's text is the
    content, none of the tags (nor the <|return|> that ended it) left in it."""
    for tools in ([WEATHER], None):
        body = {"tools": tools} if tools else {}
        response = _chat(harmony_server, ANALYSIS + FINAL, **body)
        for choice in response["choices"]:
            message = choice["message"]
            match = re.fullmatch(ANALYSIS + FINAL, "".join(
                _token_texts(harmony_server, choice["token_ids"][:-1])))
            assert match is not None, choice  # the model wrote what the regex says
            assert (message["reasoning_content"], message["content"]) == match.groups()
            assert choice["finish_reason"] == "stop" and "tool_calls" not in message


def _token_texts(server: Server, token_ids: list[int]) -> list[str]:
    """The tokens' texts, special ones included: the tokenizer's own decoding."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(server.proc.args[4])
    return [tokenizer.decode([t], skip_special_tokens=False) for t in token_ids]
