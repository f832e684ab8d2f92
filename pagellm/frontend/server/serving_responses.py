"""`OpenAIServingResponses`: POST /v1/responses (OpenAI's Responses API), stateless, over
the chat handler.

A Responses request is translated into a `ChatCompletionRequest` (`chat_request`) and
run by `OpenAIServingChat.chat`, so the chat path's checks, chat template, tool modes,
structured outputs, reasoning split and streaming (`ChoiceStream`) are the same here;
its result is then reshaped: a whole chat completion into a Response object
(`response_output`), a chat stream's chunks into the Responses events OpenAI's SDK reads
(`ResponseEvents`).

The translation: `instructions` is a system message, first; `input` is a user message
(a string) or a list of items: messages (role user, system, developer (a system
message) or assistant; content a string or input_text / output_text parts),
`function_call` items (an assistant message's tool_calls: consecutive calls, and calls
right after an assistant message, are one assistant message) and `function_call_output`
items (a `tool` message with its tool_call_id). Reasoning items (a previous output sent
back whole, as OpenAI's guides do) are accepted and left out of the prompt: a chat
message carries no reasoning, and chat templates drop earlier turns' reasoning anyway.
`max_output_tokens` is max_tokens; `text.format` (json_schema, json_object) is
response_format; function tools `{"type": "function", "name", "description",
"parameters", "strict"}` and `tool_choice` ("none", "auto", "required", or
`{"type": "function", "name"}`) are the chat's tools and tool_choice, with
`parallel_tool_calls`; `reasoning.effort` "none" turns thinking off
(chat_template_kwargs enable_thinking false, as vLLM does). vLLM's extra sampling fields
on /v1/responses are served too (top_k, min_p, repetition_penalty, seed, stop,
ignore_eos, logit_bias, skip_special_tokens, include_stop_str_in_output, priority,
cache_salt, structured_outputs).

Stateless: nothing is stored. `store` (OpenAI's default is true) is accepted either way
and the response says `"store": false`; there is no GET /v1/responses/{id} to pretend
otherwise (app.py answers 404 saying why). Refused with a 400 naming the field, since
ignoring them would change what the client gets: `previous_response_id` and
`conversation` (send the whole conversation), `background`, `prompt` (stored prompt
templates), tools other than functions (web_search, file_search, ...) and tool_choice
naming them, input items other than the above (images, files, item references, ...),
and output logprobs (`include: ["message.output_text.logprobs"]`, `top_logprobs`).
Accepted and changing nothing here: `user`, `metadata`, `service_tier`,
`prompt_cache_key`, `safety_identifier`, `max_tool_calls` (built-in tools only),
`text.verbosity`, `reasoning.summary`, `stream_options`, the other `include` values (they
name items this server never produces) and `truncation` (with "auto" a conversation too
long for max_model_len is still a 400, not cut). Unknown top-level fields are accepted
and logged once, as on the other routes (extra_fields.py). n is always 1. Usage counts
every generated token as output; its reasoning_tokens and cached_tokens are 0 (the chat
path counts neither apart).
"""

from __future__ import annotations

import contextlib
import re
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import msgspec

from pagellm.frontend.server.api_models import (
    ChatCompletionRequest,
    ChatMessage,
    StreamOptions,
)
from pagellm.frontend.server.chat_tools import MAX_TOOLS
from pagellm.frontend.server.edge import APIError, bad_request
from pagellm.frontend.server.serving import MAX_MESSAGES
from pagellm.frontend.server.serving_chat import OpenAIServingChat

INPUT_ROLES = {"user": "user", "system": "system", "developer": "system",
               "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text")
# include values this server cannot honour (the others name items it never produces).
UNSERVED_INCLUDES = {"message.output_text.logprobs": "output logprobs"}


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """The body of POST /v1/responses: OpenAI's fields, and vLLM's extras."""

    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    stream: bool | None = None
    # Accepted; they change nothing here (see the module's docstring).
    store: bool | None = None
    stream_options: dict[str, Any] | None = None
    include: list[str] | None = None
    truncation: str | None = None
    max_tool_calls: int | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    top_logprobs: int | None = None  # refused above 0 (no output logprobs here)
    # Refused when given: state this server does not keep, features it does not serve.
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None
    prompt: dict[str, Any] | None = None
    # vLLM's extra sampling fields on /v1/responses.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    cache_salt: str | None = None
    structured_outputs: dict[str, Any] | None = None


# -- the request: Responses -> chat -------------------------------------------------------


def check_served(body: ResponsesRequest) -> None:
    """A field asking for state or a feature this server does not serve: ValueError
    naming it."""
    if body.previous_response_id is not None:
        raise ValueError("previous_response_id: stateless server: send the whole "
                         "conversation; previous_response_id is not supported")
    if body.conversation is not None:
        raise ValueError("conversation: stateless server: send the whole conversation "
                         "as input; conversations are not supported")
    if body.background:
        raise ValueError("background: background responses are not supported (stateless "
                         "server: nothing is stored to poll)")
    if body.prompt is not None:
        raise ValueError("prompt: stored prompt templates are not supported (send "
                         "instructions and input)")
    for value in body.include or ():
        if value in UNSERVED_INCLUDES:
            raise ValueError(f"include: {value!r}: {UNSERVED_INCLUDES[value]} are not "
                             f"supported on /v1/responses (/v1/chat/completions serves "
                             f"logprobs)")
    if body.top_logprobs:
        raise ValueError("top_logprobs: output logprobs are not supported on "
                         "/v1/responses (/v1/chat/completions serves logprobs)")
    if body.max_output_tokens is not None and body.max_output_tokens < 1:
        raise ValueError(f"max_output_tokens must be at least 1, got "
                         f"{body.max_output_tokens}")


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, or input_text / output_text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where} must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise ValueError(f"{where}[{j}].type: {str(kind)[:100]!r} content is not "
                             f"supported (text only: {' or '.join(TEXT_PARTS)})")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{where}[{j}].text must be a string")
        texts.append(part["text"])
    return "".join(texts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise ValueError(f"{where}.{key} must be a string")
    return value


def chat_messages(instructions: str | None, input: str | list[dict[str, Any]]
                  ) -> list[ChatMessage]:
    """The conversation as chat messages (see the module's docstring)."""
    messages = [] if instructions is None else [ChatMessage("system", instructions)]
    if isinstance(input, str):
        return [*messages, ChatMessage("user", input)]
    if not input:
        raise ValueError("input must not be empty")
    if len(input) > MAX_MESSAGES:  # before the loop below, which runs on the event loop
        raise ValueError(f"input: {len(input)} items, more than {MAX_MESSAGES}")
    for i, item in enumerate(input):
        where = f"input[{i}]"
        kind = item.get("type", "message")  # a message's type may be left out
        if kind == "message":
            role = item.get("role")
            if not isinstance(role, str) or role not in INPUT_ROLES:
                raise ValueError(f"{where}.role must be one of {', '.join(INPUT_ROLES)}, "
                                 f"got {str(role)[:100]!r}")
            messages.append(ChatMessage(INPUT_ROLES[role],
                                        _text(item.get("content"), f"{where}.content")))
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where),
                                 "arguments": _string(item, "arguments", where)}}
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":  # the same assistant turn
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(ChatMessage("assistant", None, tool_calls=[call]))
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append(ChatMessage(
                "tool", _text(output, f"{where}.output"),
                tool_call_id=_string(item, "call_id", where)))
        elif kind == "reasoning":
            continue  # a previous output's reasoning: not rendered (module docstring)
        elif kind == "item_reference":
            raise ValueError(f"{where}.type: item_reference: stateless server: nothing is "
                             f"stored to refer to; send the item itself")
        else:
            raise ValueError(f"{where}.type: {str(kind)[:100]!r} input items are not "
                             f"supported (only message, function_call, "
                             f"function_call_output and reasoning)")
    return messages


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' function tools as chat tools; any other kind of tool is refused."""
    if tools is None:
        return None
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"tools: {len(tools)} tools, more than {MAX_TOOLS}")
    converted = []
    for j, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise ValueError(f"tools[{j}].type: {str(kind)[:100]!r} tools are not supported "
                             f"(this server calls function tools only)")
        function = {"name": _string(tool, "name", f"tools[{j}]")}
        for key in ("description", "parameters", "strict"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        converted.append({"type": "function", "function": function})
    return converted


def chat_tool_choice(tool_choice: str | dict[str, Any] | None
                     ) -> str | dict[str, Any] | None:
    """"none", "auto", "required" as they are; `{"type": "function", "name"}` as the
    chat's `{"type": "function", "function": {"name"}}`."""
    if not isinstance(tool_choice, dict):
        return tool_choice
    kind = tool_choice.get("type")
    if kind != "function":
        raise ValueError(f"tool_choice.type: {str(kind)[:100]!r} is not supported (give "
                         f'"none", "auto", "required" or {{"type": "function", '
                         f'"name": ...}})')
    name = tool_choice.get("name")
    if not isinstance(name, str):
        raise ValueError("tool_choice.name must be a string")
    return {"type": "function", "function": {"name": name}}


def text_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as the chat's response_format (None for plain text)."""
    spec = (text or {}).get("format")
    if spec is None:
        return None
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        assert isinstance(spec, dict)
        if not isinstance(spec.get("schema"), dict):
            raise ValueError("text.format.schema must be a JSON schema (an object)")
        return {"type": "json_schema", "json_schema": {
            "name": spec.get("name"), "schema": spec["schema"], "strict": spec.get("strict")}}
    raise ValueError(f"text.format.type must be 'text', 'json_object' or 'json_schema', "
                     f"got {str(kind)[:100]!r}")


def _effort(reasoning: dict[str, Any] | None) -> Any:
    """`reasoning.effort` low, medium or high, for the template (gpt-oss's); None for
    none ("none" turns thinking off instead); ValueError for any other value."""
    effort = (reasoning or {}).get("effort")
    if effort in (None, "none"):
        return None
    if effort not in ("low", "medium", "high"):
        raise ValueError(f'reasoning.effort must be "none", "low", "medium" or "high", '
                         f"got {str(effort)[:50]!r}")
    return effort


def _thinking_off(reasoning: dict[str, Any] | None) -> bool:
    """`reasoning.effort` "none": the chat template's thinking switch off."""
    return (reasoning or {}).get("effort") == "none"


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion request that serves `body` (ValueError naming a field the
    Responses API has that is wrong or not served)."""
    check_served(body)
    stream = bool(body.stream)
    return ChatCompletionRequest(
        model=body.model, messages=chat_messages(body.instructions, body.input),
        max_tokens=body.max_output_tokens, temperature=body.temperature, top_p=body.top_p,
        tools=chat_tools(body.tools), tool_choice=chat_tool_choice(body.tool_choice),
        parallel_tool_calls=body.parallel_tool_calls is not False,
        response_format=text_format(body.text),
        chat_template_kwargs={"enable_thinking": False} if _thinking_off(body.reasoning)
        else None, reasoning_effort=_effort(body.reasoning),
        stream=stream, stream_options=StreamOptions(include_usage=True) if stream else None,
        user=body.user, top_k=body.top_k, min_p=body.min_p,
        repetition_penalty=body.repetition_penalty, seed=body.seed, stop=body.stop,
        ignore_eos=body.ignore_eos, logit_bias=body.logit_bias,
        skip_special_tokens=body.skip_special_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output, priority=body.priority,
        cache_salt=body.cache_salt, structured_outputs=body.structured_outputs)


# The chat path's names for what a Responses request calls otherwise, in its errors.
_RENAMES = [(re.compile(r"\bresponse_format\.json_schema\.schema\b"), "text.format.schema"),
            (re.compile(r"\bresponse_format\b"), "text.format"),
            (re.compile(r"\bmax_tokens\b"), "max_output_tokens"),
            (re.compile(r"^messages\b"), "input")]


def in_responses_terms(message: str) -> str:
    for pattern, name in _RENAMES:
        message = pattern.sub(name, message)
    return message


# -- the response: chat -> Responses ------------------------------------------------------


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [_output_text(text)]}


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str
              ) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def response_usage(usage: dict[str, int] | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}


def _finished(items: list[dict[str, Any]], finish_reason: str | None) -> str:
    """The response's status; a response cut by max_output_tokens is incomplete, and so
    is its last item."""
    if finish_reason != "length":
        return "completed"
    if items:
        items[-1]["status"] = "incomplete"
    return "incomplete"


def response_output(message: dict[str, Any], finish_reason: str | None
                    ) -> tuple[list[dict[str, Any]], str]:
    """(the output items, the status) of a chat completion's assistant message:
    reasoning, then the message (left out when it is empty and something else was
    produced), then one function_call per tool call."""
    items = []
    reasoning = message.get("reasoning_content")
    if reasoning:
        items.append(reasoning_item(_id("rs"), reasoning, "completed"))
    content = message.get("content") or ""
    calls = message.get("tool_calls") or []
    if content or not (items or calls):
        items.append(message_item(_id("msg"), content, "completed"))
    for call in calls:
        items.append(call_item(_id("fc"), call["id"], call["function"]["name"],
                               call["function"]["arguments"], "completed"))
    return items, _finished(items, finish_reason)


class ResponseShape:
    """The fields every Response object of one request carries: its id, and what the
    request asked for, echoed as OpenAI does."""

    def __init__(self, body: ResponsesRequest, model: str, defaults: dict[str, Any]
                 ) -> None:
        self.id = _id("resp")
        self.created_at = int(time.time())
        tool_choice = body.tool_choice
        if tool_choice is None:
            tool_choice = "auto" if body.tools else "none"
        text: dict[str, Any] = {"format": (body.text or {}).get("format")
                                or {"type": "text"}}
        if (body.text or {}).get("verbosity") is not None:
            text["verbosity"] = (body.text or {})["verbosity"]
        reasoning = body.reasoning or {}
        self.fields = {
            "model": model, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "max_tool_calls": body.max_tool_calls,
            "temperature": body.temperature if body.temperature is not None
            else defaults.get("temperature", 1.0),
            "top_p": body.top_p if body.top_p is not None else defaults.get("top_p", 1.0),
            "tools": body.tools or [], "tool_choice": tool_choice,
            "parallel_tool_calls": body.parallel_tool_calls is not False, "text": text,
            "reasoning": {"effort": reasoning.get("effort"),
                          "summary": reasoning.get("summary")},
            "truncation": body.truncation or "disabled", "top_logprobs": body.top_logprobs,
            "metadata": body.metadata or {}, "user": body.user,
            "service_tier": body.service_tier, "background": False,
            "previous_response_id": None, "store": False}

    def response(self, status: str, output: list[dict[str, Any]],
                 usage: dict[str, Any] | None = None,
                 error: dict[str, Any] | None = None) -> dict[str, Any]:
        return {"id": self.id, "object": "response", "created_at": self.created_at,
                "status": status, "completed_at": int(time.time())
                if status == "completed" else None,
                "error": error, "incomplete_details": {"reason": "max_output_tokens"}
                if status == "incomplete" else None,
                "output": output, "usage": usage, **self.fields}


class ResponseEvents:
    """A chat stream's chunks in, the Responses stream's events out.

    Each output item opens when its first delta arrives (`response.output_item.added`,
    and a content part for text), grows by delta events, and closes (`.done` events,
    then `response.output_item.done`) when a delta of another item arrives or the
    stream ends; then `response.completed` (or `response.incomplete`, cut by
    max_output_tokens) carries the whole response. A failure after the 200 is an
    `error` event and `response.failed`."""

    def __init__(self, shape: ResponseShape) -> None:
        self.shape = shape
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # every item opened, in output order
        self.open: dict[str, Any] | None = None  # the item deltas go to now
        self.key: Any = None  # which item that is: "reasoning", "message" or a call index
        self.texts: list[str] = []  # its text (or arguments) so far
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {msgspec.json.encode(payload).decode()}\n\n"

    def start(self) -> Iterator[str]:
        created = self.shape.response("in_progress", [])
        yield self.event("response.created", response=created)
        yield self.event("response.in_progress", response=created)

    def chunk(self, chunk: dict[str, Any]) -> Iterator[str]:
        """One chat completion chunk (its payload, parsed)."""
        if "error" in chunk:
            self.error = chunk["error"]
            return
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                yield from self._text("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                yield from self._text("message", delta["content"])
            for call in delta.get("tool_calls") or ():
                yield from self._call(call)
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]

    def finish(self) -> Iterator[str]:
        if self.error is not None:
            yield from self._close("incomplete")
            message = str(self.error.get("message", "the request failed"))
            yield self.event("error", code=str(self.error.get("code")), message=message,
                             param=None)
            yield self.event("response.failed", response=self.shape.response(
                "failed", self.items, response_usage(self.usage),
                {"code": "server_error", "message": message}))
            return
        if not self.items:  # nothing was generated: an empty message, as when whole
            yield from self._open("message", message_item(_id("msg"), "", "in_progress"))
        status = "incomplete" if self.finish_reason == "length" else "completed"
        yield from self._close(status)
        response = self.shape.response(status, self.items, response_usage(self.usage))
        yield self.event(f"response.{status}", response=response)

    # -- items ----------------------------------------------------------------------------

    def _text(self, key: str, delta: str) -> Iterator[str]:
        if self.key != key:
            yield from self._close("completed")
            item = reasoning_item(_id("rs"), "", "in_progress") if key == "reasoning" \
                else message_item(_id("msg"), "", "in_progress")
            yield from self._open(key, item)
        assert self.open is not None
        self.texts.append(delta)
        kind = "reasoning_text" if key == "reasoning" else "output_text"
        extra: dict[str, Any] = {} if key == "reasoning" else {"logprobs": []}
        yield self.event(f"response.{kind}.delta", item_id=self.open["id"],
                         output_index=len(self.items) - 1, content_index=0, delta=delta,
                         **extra)

    def _call(self, call: dict[str, Any]) -> Iterator[str]:
        key = ("call", call.get("index", 0))
        function = call.get("function") or {}
        if self.key != key:
            yield from self._close("completed")
            yield from self._open(key, call_item(_id("fc"), call.get("id") or _id("call"),
                                                 function.get("name") or "", "",
                                                 "in_progress"))
        assert self.open is not None
        arguments = function.get("arguments") or ""
        if arguments:
            self.texts.append(arguments)
            yield self.event("response.function_call_arguments.delta",
                             item_id=self.open["id"], output_index=len(self.items) - 1,
                             delta=arguments)

    def _open(self, key: Any, item: dict[str, Any]) -> Iterator[str]:
        self.open, self.key, self.texts = item, key, []
        self.items.append(item)
        index = len(self.items) - 1
        added = {**item, "content": []} if "content" in item else item
        yield self.event("response.output_item.added", output_index=index,
                         item=dict(added))
        if "content" in item:
            yield self.event("response.content_part.added", item_id=item["id"],
                             output_index=index, content_index=0, part=item["content"][0])

    def _close(self, status: str) -> Iterator[str]:
        item = self.open
        if item is None:
            return
        index, text = len(self.items) - 1, "".join(self.texts)
        self.open, self.key, self.texts = None, None, []
        item["status"] = status
        if item["type"] == "function_call":
            item["arguments"] = text
            yield self.event("response.function_call_arguments.done", item_id=item["id"],
                             output_index=index, arguments=text)
        else:
            kind = item["content"][0]["type"]
            part = {**item["content"][0], "text": text}
            item["content"] = [part]
            extra: dict[str, Any] = {} if kind == "reasoning_text" else {"logprobs": []}
            yield self.event(f"response.{kind}.done", item_id=item["id"],
                             output_index=index, content_index=0, text=text, **extra)
            yield self.event("response.content_part.done", item_id=item["id"],
                             output_index=index, content_index=0, part=part)
        yield self.event("response.output_item.done", output_index=index, item=item)


async def response_events(chat_events: AsyncIterator[str], shape: ResponseShape
                          ) -> AsyncIterator[str]:
    """The Responses stream over a chat stream (server-sent events, `data: {...}` each,
    then `data: [DONE]`); closing it closes the chat stream, which aborts the request."""
    events = ResponseEvents(shape)
    async with contextlib.aclosing(chat_events):  # type: ignore[type-var]
        for event in events.start():
            yield event
        async for sse in chat_events:
            data = sse.removeprefix("data: ").strip()
            if data == "[DONE]":
                break
            for event in events.chunk(msgspec.json.decode(data)):
                yield event
    for event in events.finish():
        yield event


class OpenAIServingResponses:
    """The /v1/responses handler, over the chat handler."""

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def responses(self, body: ResponsesRequest) -> Any:
        """The Response object, or (stream) its events; a bad request is a 400 before
        anything runs."""
        self.chat.check_model(body.model)
        try:
            request = chat_request(body)
        except (ValueError, TypeError) as e:
            raise bad_request(str(e)) from None
        shape = ResponseShape(body, self.chat.name, self.chat.engine.default_sampling_fields)
        try:
            result = await self.chat.chat(request)
        except APIError as e:
            if e.status == 400:
                raise APIError(400, in_responses_terms(e.message), e.kind, e.param) \
                    from None
            raise
        if request.stream:
            return response_events(result, shape)
        choice = result["choices"][0]
        output, status = response_output(choice["message"], choice["finish_reason"])
        return shape.response(status, output, response_usage(result["usage"]))
