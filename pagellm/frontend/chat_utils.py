"""Chat messages as chat templates read them, the same for `LLM.chat` and the server
(vLLM's chat_utils): an assistant's earlier tool calls carry their `arguments` as a
JSON string in OpenAI's format, and templates render them with `tojson`, so a call's
arguments are parsed into the object they spell first; an assistant's earlier reasoning
comes back under whichever name the client uses (`reasoning_content`, as this server
returns it, or `reasoning`) and templates read it under theirs (`reasoning_content`:
Qwen3, GLM; `thinking`: gpt-oss, whose template renders it as the analysis before a
tool call), so it is given under both."""

from __future__ import annotations

import json
from typing import Any


def template_tool_call(call: Any) -> Any:
    """A tool call with its JSON-object `arguments` string parsed; anything else (other
    shapes, arguments that are no JSON object) as given."""
    if not isinstance(call, dict):
        return call
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError:
        return call
    if not isinstance(arguments, dict):
        return call
    return {**call, "function": {**function, "arguments": arguments}}


REASONING_NAMES = ("reasoning_content", "reasoning", "thinking")


def template_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    """The message with its reasoning (the first of REASONING_NAMES it has) also as
    `reasoning_content` and `thinking`; as given when it has none."""
    reasoning = next((message[name] for name in REASONING_NAMES
                      if message.get(name) is not None), None)
    if reasoning is None:
        return message
    return {**message, "reasoning_content": reasoning, "thinking": reasoning}


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with every tool call's arguments parsed and reasoning under the
    templates' names (new dicts where they change: the caller's messages are left as
    they were)."""
    return [template_reasoning(
        {**m, "tool_calls": [template_tool_call(c) for c in m["tool_calls"]]}
        if isinstance(m.get("tool_calls"), list) else m) for m in messages]
