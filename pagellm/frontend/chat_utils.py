"""Chat messages as chat templates read them, the same for `LLM.chat` and the server
(vLLM's chat_utils): an assistant's earlier tool calls carry their `arguments` as a
JSON string in OpenAI's format, and templates render them with `tojson`, so a call's
arguments are parsed into the object they spell first."""

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


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with every tool call's arguments parsed (new dicts where they change:
    the caller's messages are left as they were)."""
    return [{**m, "tool_calls": [template_tool_call(c) for c in m["tool_calls"]]}
            if isinstance(m.get("tool_calls"), list) else m for m in messages]
