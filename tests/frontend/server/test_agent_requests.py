"""Structured outputs, tool calls and reasoning over HTTP (issue 39), on `agent_server`
(tests/conftest.py): response_format, vLLM's structured_outputs field and the
deprecated guided_* fields on both routes, tool_choice required / named / auto (hermes)
with streamed tool-call deltas, the qwen3 reasoning split, and the real clients agents
use (openai's `parse`, LangChain). References: jsonschema, re.fullmatch, the tools'
own parameter schemas."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Literal

import jsonschema
import pytest
from helpers import NAME

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "maxLength": 5}}, "required": ["zone"],
        "additionalProperties": False}}}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}  # grammar from token 1
USER = [{"role": "user", "content": "Who?"}]
CLOSED = "<think>\n\n</think>\n\n"  # a completion prompt past its (empty) reasoning


def chat(server, **body):
    status, response = server.post("/v1/chat/completions", {
        "model": NAME, "messages": USER, "max_tokens": 80, "seed": 7, **NO_THINKING,
        **body})
    assert status == 200, response
    return response


def test_response_format_json_schema_and_json_object_on_both_routes(agent_server):
    response = chat(agent_server, n=3, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    for choice in response["choices"]:
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)
    status, response = agent_server.post("/v1/completions", {
        "model": NAME, "prompt": CLOSED, "max_tokens": 120, "seed": 3,
        "response_format": {"type": "json_object"}})
    assert status == 200, response
    # Issue 39: this was a 200 with free text (the unknown-field path).
    choice = response["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["text"]), dict)
    else:  # an object may nest past max_tokens; what came is still a JSON object's start
        assert choice["text"].startswith("{")


def test_the_structured_outputs_field_and_the_deprecated_guided_fields(agent_server):
    status, response = agent_server.post("/v1/completions", {
        "model": NAME, "prompt": CLOSED, "max_tokens": 20, "n": 4, "seed": 1,
        "structured_outputs": {"choice": ["yes", "no", "not sure"]}})
    assert status == 200, response
    assert {c["text"] for c in response["choices"]} <= {"yes", "no", "not sure"}
    before = agent_server.log_lines()
    for field, value, check in [
            ("guided_regex", "[a-c]{2}-[0-9]{3}",
             lambda t: re.fullmatch(r"[a-c]{2}-[0-9]{3}", t)),
            ("guided_choice", ["up", "down"], lambda t: t in ("up", "down")),
            ("guided_json", PERSON, lambda t: jsonschema.validate(json.loads(t), PERSON)
             is None),
            ("guided_grammar", 'root ::= "x" ("y" | "z")+', lambda t: re.fullmatch(
                "x[yz]+", t))]:
        status, response = agent_server.post("/v1/completions", {
            "model": NAME, "prompt": CLOSED, "max_tokens": 30, "seed": 2, field: value})
        assert status == 200, (field, response)
        text = response["choices"][0]["text"]
        if field == "guided_grammar" and response["choices"][0]["finish_reason"] == "length":
            assert re.fullmatch("x[yz]*", text)  # the grammar may go on to max_tokens
        else:
            assert check(text), (field, text)
    assert agent_server.log is not None
    text = Path(agent_server.log.name).read_text(encoding="utf-8")
    assert "guided_regex: deprecated" in text and "guided_json: deprecated" in text
    assert agent_server.log_lines() > before


@pytest.mark.parametrize(("body", "named"), [
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     "structured_outputs, response_format"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
    ({"structured_outputs": {"regexp": "a"}}, "regexp"),
    ({"structured_outputs": {"json": {"type": "array", "uniqueItems": True}}},
     "uniqueItems"),
    ({"structured_outputs": {"regex": "("}}, "regex"),
    ({"guided_json": {"type": "strin"}}, "strin"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "a" * 70_000}}, "more than"),
    ({"tools": [WEATHER], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "cannot be combined"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "nope"),
    ({"tool_choice": "required"}, "needs tools"),
])
def test_bad_constraints_are_400s_naming_the_problem(agent_server, body, named):
    status, response = agent_server.post("/v1/chat/completions", {
        "model": NAME, "messages": USER, "max_tokens": 5, **body})
    assert status == 400, (body, response)
    assert named in response["error"]["message"], (body, response)
    assert chat(agent_server, max_tokens=2)["choices"]  # and it serves on


def test_tool_choice_required_and_named_give_calls_valid_against_their_schemas(agent_server):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    # One call each (a random model given parallel calls goes on adding them).
    response = chat(agent_server, n=3, tools=[WEATHER, TIME], tool_choice="required",
                    max_tokens=120, parallel_tool_calls=False)
    calls = 0
    for choice in response["choices"]:
        assert choice["finish_reason"] == "tool_calls", choice
        assert choice["message"]["content"] is None
        for call in choice["message"]["tool_calls"]:
            jsonschema.validate(json.loads(call["function"]["arguments"]),
                                schemas[call["function"]["name"]])
            assert call["id"].startswith("chatcmpl-tool-") and call["type"] == "function"
            calls += 1
    assert calls == 3
    response = chat(agent_server, tools=[WEATHER, TIME], tool_choice="required",
                    max_tokens=12)  # parallel calls, cut short: still the array's start
    assert response["choices"][0]["message"]["content"].startswith('[{"name":')
    named = {"type": "function", "function": {"name": "get_time"}}
    response = chat(agent_server, tools=[WEATHER, TIME], tool_choice=named)
    (call,) = response["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_time"
    jsonschema.validate(json.loads(call["function"]["arguments"]), schemas["get_time"])


def test_streamed_tool_calls_arrive_as_openai_deltas(agent_server):
    client = agent_server.client()
    for choice, name in (({"type": "function", "function": {"name": "get_weather"}},
                          "get_weather"), ("required", None)):
        stream = client.chat.completions.create(
            model=NAME, messages=USER, max_tokens=80, seed=5, stream=True, tools=[WEATHER],
            tool_choice=choice, parallel_tool_calls=False, extra_body=NO_THINKING)
        ids, names, arguments, finish = set(), [], "", None
        for chunk in stream:
            for delta_call in chunk.choices[0].delta.tool_calls or []:
                ids.add(delta_call.id) if delta_call.id else None
                if delta_call.function.name:
                    names.append(delta_call.function.name)
                arguments += delta_call.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert names[:1] == ["get_weather"] and len(ids) == len(names)
        if name is None:  # required: whole calls at the end, "tool_calls"
            assert finish == "tool_calls"
        jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])


def test_auto_tool_choice_parses_hermes_calls_whole_and_streamed(agent_server):
    """The model decides; here a regex makes it "decide" to call (the hermes format,
    with content before it), so the parser's work is checked end to end."""
    regex = r'Let me check\.<tool_call>\{"name": "get_weather", "arguments": ' \
            r'\{"city": "(Paris|Rome)", "days": [1-7]\}\}</tool_call>'
    body = {"tools": [WEATHER], "structured_outputs": {"regex": regex}, "max_tokens": 200}
    message = chat(agent_server, **body)["choices"][0]
    assert message["finish_reason"] == "tool_calls", message
    assert message["message"]["content"] == "Let me check."
    (call,) = message["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]),
                        WEATHER["function"]["parameters"])
    stream = agent_server.client().chat.completions.create(
        model=NAME, messages=USER, seed=7, stream=True,
        extra_body={**NO_THINKING, **body})
    content, calls, finish = "", [], None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls += [(c.function.name, c.function.arguments) for c in delta.tool_calls or []]
        finish = chunk.choices[0].finish_reason or finish
    assert content == "Let me check." and finish == "tool_calls"
    assert calls == [("get_weather", call["function"]["arguments"])]
    plain = chat(agent_server, tools=[WEATHER], max_tokens=8)["choices"][0]  # no call made
    assert plain["message"].get("tool_calls") in (None, []) and plain["finish_reason"] in (
        "stop", "length")


def test_reasoning_is_split_off_and_the_grammar_applies_after_it(agent_server):
    """With --reasoning-parser qwen3 the grammar waits for </think> (vLLM's
    enable_in_reasoning=False): the model may think in anything, then answers in the
    grammar. allowed_token_ids keeps the random model to a, b, </think> and EOS, and a
    logit_bias makes </think> likely, so some of the n choices close their reasoning."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(agent_server_model(agent_server))
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("a", "b", "</think>")}
    allowed = [*ids.values(), tokenizer.eos_token_id]
    status, response = agent_server.post("/v1/chat/completions", {
        "model": NAME, "messages": USER, "max_tokens": 16, "n": 8, "seed": 11,
        "allowed_token_ids": allowed, "structured_outputs": {"regex": "[ab]{3}"},
        "logit_bias": {str(ids["</think>"]): 3.0}, "return_token_ids": True})
    assert status == 200, response
    closed = 0
    for choice in response["choices"]:
        message = choice["message"]
        if ids["</think>"] in choice["token_ids"]:
            closed += 1
            assert re.fullmatch("[ab]*", message["reasoning_content"] or "")
            assert re.fullmatch("[ab]{3}", message["content"]), message
            assert choice["finish_reason"] == "stop"
        else:  # still thinking (or ended with EOS): no grammar applied yet
            assert re.fullmatch("[ab]*", message["content"] or "")
    assert closed > 0, response["choices"]


def agent_server_model(server) -> str:
    return server.proc.args[4]  # [python, -m, pagellm, serve, MODEL_DIR, ...]


def test_the_openai_clients_parse_with_a_pydantic_model(agent_server):
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=6)
        age: int = Field(ge=0, le=120)

    completion = agent_server.client().chat.completions.parse(
        model=NAME, messages=USER, max_tokens=80, seed=4, response_format=Person,
        extra_body=NO_THINKING)
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person) and 0 <= person.age <= 120


def test_langchain_with_structured_output_and_bind_tools(agent_server):
    langchain_openai = pytest.importorskip("langchain_openai")
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        """A person."""

        name: str = Field(max_length=6)
        age: int = Field(ge=0, le=120)

    llm = langchain_openai.ChatOpenAI(
        model=NAME, base_url=agent_server.url + "/v1", api_key="none", max_tokens=80,
        seed=4, extra_body=NO_THINKING)
    person = llm.with_structured_output(Person, method="json_schema").invoke("Who?")
    assert isinstance(person, Person)

    def get_weather(city: Literal["Paris", "Rome"], days: int) -> str:
        """The weather in a city for some days."""
        return "sunny"

    message = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather?")
    assert not message.invalid_tool_calls, message.invalid_tool_calls
    (call,) = message.tool_calls
    assert call["name"] == "get_weather" and set(call["args"]) == {"city", "days"}
    assert call["args"]["city"] in ("Paris", "Rome") and isinstance(call["args"]["days"], int)
