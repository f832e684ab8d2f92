"""POST /v1/responses (frontend/server/serving_responses.py): OpenAI's Responses API,
stateless, over the chat path. Through the official `openai` client against a live
`pagellm serve` (one server for the module: a chat template that prints every field a
conversation carries, and compact JSON from structured outputs, which a random model
would otherwise pad with whitespace until max_output_tokens), and without a server for
what the demo model does not produce (reasoning, several calls in one stream), where
the SDK reads our events from a mock transport."""

from __future__ import annotations

import http.client
import json
import socket
import time
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from helpers import NAME, Server
from openai.types.responses import Response

from pagellm.frontend.server.serving_responses import (
    ResponseEvents,
    ResponseShape,
    ResponsesRequest,
    chat_messages,
    response_output,
)

# Every field of a conversation, so that the prompt shows what reached the template.
TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}{% if m.tool_call_id %}#{{ m.tool_call_id }}"
    "{% endif %}]{{ m['content'] }}{% for c in m.tool_calls or [] %}<call {{ c['id'] }} "
    "{{ c['function']['name'] }} {{ c['function']['arguments'] | tojson }}>{% endfor %}"
    "{% endfor %}{% for t in tools or [] %}<tool {{ t['function']['name'] }}>{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}")

# Tight schemas: the random model's JSON ends within a few tokens.
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The forecast.",
          "parameters": WEATHER},
         {"type": "function", "name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC"]}},
             "required": ["zone"], "additionalProperties": False}}]
ANSWER = {"type": "object", "properties": {
    "answer": {"type": "string", "maxLength": 6},
    "score": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["answer", "score"], "additionalProperties": False}

CONVERSATION = [
    {"role": "developer", "content": "Answer in French."},
    {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris"},
                                 {"type": "input_text", "text": " and Rome?"}]},
    {"type": "reasoning", "id": "rs_1", "summary": []},  # left out of the prompt
    {"type": "function_call", "call_id": "call_1", "name": "get_weather",
     "arguments": '{"city":"Paris","days":1}'},
    {"type": "function_call", "call_id": "call_2", "name": "get_weather",
     "arguments": '{"city":"Rome","days":1}'},
    {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    {"type": "function_call_output", "call_id": "call_2",
     "output": [{"type": "input_text", "text": "rainy"}]},
    {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
     "content": [{"type": "output_text", "text": "Paris: sunny.", "annotations": []}]},
    {"role": "user", "content": "Thanks"}]
CALLS = ('<call call_1 get_weather {"city": "Paris", "days": 1}>'
         '<call call_2 get_weather {"city": "Rome", "days": 1}>')
RENDERED = ("[system]Be brief.[system]Answer in French.[user]Weather in Paris and Rome?"
            f"[assistant]{CALLS}[tool#call_1]sunny[tool#call_2]rainy"
            "[assistant]Paris: sunny.[user]Thanks<tool get_weather><tool get_time>"
            "[assistant]")


@pytest.fixture(scope="module")
def server(model_dirs, tmp_path_factory):
    template = tmp_path_factory.mktemp("responses") / "template.jinja"
    template.write_text(TEMPLATE)
    s = Server(model_dirs["llama"], "--chat-template", str(template),
               "--structured-outputs-config.disable_any_whitespace", "true")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def tokenizer(model_dirs):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dirs["llama"])


def prompt_tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def strictly(response: Any) -> Response:
    """The SDK's client parses leniently: every required field, checked."""
    return Response.model_validate(response.model_dump())


# --- through the server -------------------------------------------------------------------


def test_a_text_response_is_the_chat_completion_reshaped(client, tokenizer):
    response = client.responses.create(model=NAME, input="Hello", max_output_tokens=8,
                                       temperature=0)
    strictly(response)
    chat = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Hello"}], max_tokens=8,
        temperature=0)
    assert response.output_text and response.output_text == chat.choices[0].message.content
    assert response.id.startswith("resp_") and response.object == "response"
    [message] = response.output
    assert message.type == "message" and message.id.startswith("msg_")
    usage = response.usage
    assert usage.input_tokens == prompt_tokens(tokenizer, "[user]Hello[assistant]") == \
        chat.usage.prompt_tokens
    assert usage.output_tokens == chat.usage.completion_tokens
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    if chat.choices[0].finish_reason == "length":
        assert (response.status, response.incomplete_details.reason, message.status) == \
            ("incomplete", "max_output_tokens", "incomplete")
        assert usage.output_tokens == 8
    else:
        assert response.status == message.status == "completed"
    assert (response.store, response.previous_response_id, response.error) == \
        (False, None, None)
    assert (response.max_output_tokens, response.temperature, response.tool_choice) == \
        (8, 0, "none")


def test_instructions_and_conversation_items_reach_the_template(client, tokenizer):
    """developer is a system message, consecutive function calls one assistant
    message, outputs tool messages with their call ids; reasoning items are left out."""
    response = client.responses.create(
        model=NAME, instructions="Be brief.", input=CONVERSATION, tools=TOOLS,
        tool_choice="none", max_output_tokens=1)
    assert response.usage.input_tokens == prompt_tokens(tokenizer, RENDERED)
    # The count tells the calls merged from the calls apart.
    unmerged = RENDERED.replace("><call call_2", ">[assistant]<call call_2")
    assert prompt_tokens(tokenizer, unmerged) != prompt_tokens(tokenizer, RENDERED)
    assert [t.name for t in response.tools] == ["get_weather", "get_time"]


def test_json_schema_text_format(client):
    response = client.responses.create(
        model=NAME, input="Rate it.", max_output_tokens=48,
        text={"format": {"type": "json_schema", "name": "rating", "schema": ANSWER,
                         "strict": True}})
    assert response.status == "completed", response
    jsonschema.validate(json.loads(response.output_text), ANSWER)
    assert response.text.format.type == "json_schema"
    assert response.text.format.name == "rating"
    response = client.responses.create(model=NAME, input="Any JSON.", max_output_tokens=4,
                                       text={"format": {"type": "json_object"}})
    assert response.output_text.startswith("{")  # (cut by max_output_tokens, maybe)


def test_a_named_tool_choice_calls_that_function_and_the_call_goes_back(client, tokenizer):
    response = client.responses.create(
        model=NAME, input="Weather?", tools=TOOLS, max_output_tokens=48,
        tool_choice={"type": "function", "name": "get_weather"})
    strictly(response)
    assert response.status == "completed" and response.output_text == ""
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.id.startswith("fc_") and call.call_id and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    assert response.tool_choice.name == "get_weather"
    # The call (an SDK object) and its output sent back: the next turn's prompt has them.
    follow = client.responses.create(
        model=NAME, input=[{"role": "user", "content": "Weather?"}, *response.output,
                           {"type": "function_call_output", "call_id": call.call_id,
                            "output": "sunny"}],
        tools=TOOLS, tool_choice="none", max_output_tokens=1)
    arguments = json.dumps(json.loads(call.arguments))  # as tojson writes them
    assert follow.usage.input_tokens == prompt_tokens(
        tokenizer, f"[user]Weather?[assistant]<call {call.call_id} get_weather {arguments}>"
                   f"[tool#{call.call_id}]sunny<tool get_weather><tool get_time>[assistant]")


def test_a_required_tool_choice_calls_a_tool(client):
    response = client.responses.create(model=NAME, input="Weather?", tools=TOOLS,
                                       tool_choice="required", parallel_tool_calls=False,
                                       max_output_tokens=64)
    assert response.status == "completed", response
    [call] = response.output
    assert call.type == "function_call" and call.name in ("get_weather", "get_time")
    schema = next(t["parameters"] for t in TOOLS if t["name"] == call.name)
    jsonschema.validate(json.loads(call.arguments), schema)
    assert response.parallel_tool_calls is False


def test_a_text_stream_sends_the_events_in_order(client):
    whole = client.responses.create(model=NAME, input="Hello", max_output_tokens=8,
                                    temperature=0)
    events = list(client.responses.create(model=NAME, input="Hello", max_output_tokens=8,
                                          temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1 and kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * deltas,
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", f"response.{whole.status}"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    item_id = events[2].item.id
    assert all(getattr(e, "item_id", item_id) == item_id for e in events[3:-2])
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-4].text == events[-3].part.text == whole.output_text
    final = strictly(events[-1].response)
    assert final.id == events[0].response.id and final.output_text == text
    assert final.output[0].id == item_id and final.output[0] == events[-2].item
    assert final.usage == whole.usage and final.status == whole.status


def test_a_streamed_call_and_the_sdks_stream_helper(client):
    with client.responses.stream(model=NAME, input="Weather?", tools=TOOLS,
                                 tool_choice={"type": "function", "name": "get_weather"},
                                 max_output_tokens=48) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress",
                         "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done",
                          "response.output_item.done", "response.completed"]
    assert events[2].item.type == "function_call" and events[2].item.name == "get_weather"
    arguments = "".join(e.delta for e in events
                        if e.type == "response.function_call_arguments.delta")
    assert arguments == events[-3].arguments == final.output[0].arguments
    jsonschema.validate(json.loads(arguments), WEATHER)
    assert final.status == "completed" and final.output[0].call_id == events[2].item.call_id


def test_a_client_that_leaves_a_stream_aborts_its_request(server):
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    connection.request("POST", "/v1/responses", json.dumps({
        "model": NAME, "input": "never finish", "max_output_tokens": 1900,
        "ignore_eos": True, "stream": True}), {"content-type": "application/json"})
    try:
        response = connection.getresponse()
        assert response.status == 200
        response.fp.readline()  # the first chunk's size
        assert response.fp.readline() == b"event: response.created\n"
    finally:
        connection.sock.shutdown(socket.SHUT_RDWR)
        connection.close()
    deadline = time.monotonic() + 10
    while server.metric("vllm:num_requests_running") or \
            server.metric("vllm:kv_cache_usage_perc"):
        assert time.monotonic() < deadline, "the request still runs"
        time.sleep(0.05)


@pytest.mark.parametrize(("body", "named"), [
    ({"previous_response_id": "resp_1"},
     "stateless server: send the whole conversation; previous_response_id is not "
     "supported"),
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type: 'web_search'"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "'file_search'"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice.type"),
    ({"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "https://x/y.png"}]}]},
     "input[0].content[0].type: 'input_image'"),
    ({"input": [{"type": "input_file", "file_id": "f"}]}, "input[0].type: 'input_file'"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "item_reference"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": []}, "input must not be empty"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"tools": TOOLS, "tool_choice": "required",
      "text": {"format": {"type": "json_object"}}}, "text.format"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "nope"),
    ({"max_output_tokens": "many"}, "$.max_output_tokens"),
])
def test_what_is_not_served_is_a_400_naming_it(server, body, named):
    status, response = server.post("/v1/responses", {"model": NAME, "input": "x",
                                                     "max_output_tokens": 1, **body})
    assert status == 400, response
    assert named in response["error"]["message"], response


def test_store_is_accepted_and_nothing_is_stored(server, client):
    status, response = server.post("/v1/responses", {
        "model": NAME, "input": "x", "max_output_tokens": 1, "store": True,
        "metadata": {"k": "v"}, "frobnicate": 1})  # unknown fields: accepted, logged
    assert status == 200 and response["store"] is False, response
    with pytest.raises(openai.NotFoundError, match="stateless"):
        client.responses.retrieve(response["id"])
    status, error = server.post(f"/v1/responses/{response['id']}/cancel", {})
    assert status == 404 and "stores no responses" in error["error"]["message"]
    status, error = server.post("/v1/responses", {"model": "other", "input": "x"})
    assert status == 404 and error["error"]["param"] == "model"


# --- without a server: what the demo model does not produce ---------------------------


def shape(**fields: Any) -> ResponseShape:
    return ResponseShape(ResponsesRequest(input="x", **fields), "m", {})


def sdk_client(events: list[str]) -> openai.OpenAI:
    """An SDK client whose every request is answered with these server-sent events."""
    body = "".join(events).encode()
    transport = httpx.MockTransport(lambda _: httpx.Response(
        200, content=body, headers={"content-type": "text/event-stream"}))
    return openai.OpenAI(base_url="http://responses.test/v1", api_key="k",
                         http_client=httpx.Client(transport=transport))


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None,
          usage: dict[str, int] | None = None) -> dict[str, Any]:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": choices,
            **({"usage": usage} if usage else {})}


def call_delta(index: int, call_id: str | None, name: str | None, arguments: str
               ) -> dict[str, Any]:
    call: dict[str, Any] = {"index": index, "function": {"arguments": arguments}}
    if call_id is not None:
        call |= {"id": call_id, "type": "function"}
        call["function"]["name"] = name
    return {"tool_calls": [call]}


def events_of(chunks: list[dict[str, Any]], **fields: Any) -> list[str]:
    writer = ResponseEvents(shape(**fields))
    events = list(writer.start())
    for c in chunks:
        events += writer.chunk(c)
    return events + list(writer.finish())


def test_reasoning_text_and_calls_stream_as_items_the_sdk_assembles():
    chunks = [chunk({"role": "assistant", "content": ""}),
              chunk({"reasoning_content": "Think"}), chunk({"reasoning_content": "ing."}),
              chunk({"content": "Let me "}), chunk({"content": "look."}),
              chunk(call_delta(0, "call_a", "get_weather", '{"city":')),
              chunk(call_delta(0, None, None, '"Rome","days":2}')),
              chunk(call_delta(1, "call_b", "get_time", '{"zone":"UTC"}'), "tool_calls"),
              chunk(usage={"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14})]
    events = events_of(chunks, tools=TOOLS)
    with sdk_client(events).responses.stream(model="m", input="x") as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert kinds.count("response.output_item.added") == 4
    assert kinds.count("response.reasoning_text.delta") == 2
    assert kinds.count("response.function_call_arguments.delta") == 3
    assert kinds[-1] == "response.completed"
    Response.model_validate(final.model_dump())
    reasoning, message, first, second = final.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "Thinking."
    assert message.type == "message" and final.output_text == "Let me look."
    assert (first.call_id, first.name, first.arguments) == \
        ("call_a", "get_weather", '{"city":"Rome","days":2}')
    assert (second.call_id, second.arguments) == ("call_b", '{"zone":"UTC"}')
    assert all(item.status == "completed" for item in final.output)
    assert (final.usage.input_tokens, final.usage.output_tokens) == (5, 9)


def test_a_stream_cut_by_max_output_tokens_is_incomplete_and_a_failure_is_failed():
    events = events_of([chunk({"content": "abc"}, "length"),
                        chunk(usage={"prompt_tokens": 1, "completion_tokens": 2,
                                     "total_tokens": 3})])
    last = list(sdk_client(events).responses.create(model="m", input="x", stream=True))[-1]
    assert last.type == "response.incomplete"
    assert last.response.incomplete_details.reason == "max_output_tokens"
    assert last.response.output[0].status == "incomplete"
    events = events_of([chunk({"content": "abc"}),
                        {"error": {"message": "the engine core is dead", "code": 503}}])
    streamed = list(sdk_client(events).responses.create(model="m", input="x", stream=True))
    assert [e.type for e in streamed[-2:]] == ["error", "response.failed"]
    assert streamed[-2].message == "the engine core is dead"
    assert streamed[-1].response.error.code == "server_error"
    assert streamed[-1].response.output_text == "abc"
    # Nothing generated: an empty message, as a whole response has.
    events = events_of([chunk({"role": "assistant", "content": ""}, "stop")])
    last = list(sdk_client(events).responses.create(model="m", input="x", stream=True))[-1]
    assert last.type == "response.completed" and last.response.output[0].type == "message"


def test_a_whole_chat_message_becomes_items():
    message = {"role": "assistant", "reasoning_content": "Hmm.", "content": "Calling.",
               "tool_calls": [{"id": "call_1", "type": "function", "function": {
                   "name": "get_time", "arguments": '{"zone":"UTC"}'}}]}
    output, status = response_output(message, "tool_calls")
    response = Response.model_validate(shape(tools=TOOLS).response(status, output))
    assert [item.type for item in response.output] == ["reasoning", "message",
                                                       "function_call"]
    assert response.output_text == "Calling." and response.output[2].call_id == "call_1"
    output, status = response_output({"role": "assistant", "reasoning_content": "Hm",
                                      "content": None}, "length")
    assert status == "incomplete" and [(i["type"], i["status"]) for i in output] == \
        [("reasoning", "incomplete")]


def test_the_conversation_translation():
    messages = chat_messages("Be brief.", CONVERSATION)
    assert [(m.role, m.text()) for m in messages] == [
        ("system", "Be brief."), ("system", "Answer in French."),
        ("user", "Weather in Paris and Rome?"), ("assistant", ""), ("tool", "sunny"),
        ("tool", "rainy"), ("assistant", "Paris: sunny."), ("user", "Thanks")]
    assert [c["id"] for c in messages[3].tool_calls or []] == ["call_1", "call_2"]
    assert (messages[4].tool_call_id, messages[5].tool_call_id) == ("call_1", "call_2")
    # A call right after the assistant's text is the same turn.
    turn = chat_messages(None, [{"role": "assistant", "content": "Checking."},
                                CONVERSATION[3]])
    assert len(turn) == 1 and turn[0].text() == "Checking." and turn[0].tool_calls
