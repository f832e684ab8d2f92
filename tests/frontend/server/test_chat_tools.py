"""frontend/server/chat_tools.py: an "auto" choice hands the request's tools to its
tool-call parser, for the formats whose arguments the tools' schemas type (GLM-4.5's
values are text: a parameter declared a string stays one), whole and streamed."""

from __future__ import annotations

import json

from pagellm.frontend.server.chat_tools import (
    ChoiceStream,
    ToolMode,
    ToolSetup,
    chat_message,
    resolve_tool_mode,
)

TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"zip": {"type": "string"}, "limit": {"type": "integer"}}}}}]
TEXT = ("<tool_call>lookup\n<arg_key>zip</arg_key>\n<arg_value>2139</arg_value>\n"
        "<arg_key>limit</arg_key>\n<arg_value>5</arg_value>\n</tool_call>")
EXPECTED = {"zip": "2139", "limit": 5}  # the schema's string stays text


def test_an_auto_choice_types_glm45_arguments_by_the_requests_tools():
    setup = ToolSetup(enable_auto_tool_choice=True, tool_call_parser="glm45")
    mode = resolve_tool_mode(TOOLS, "auto", setup)
    message, reason = chat_message(TEXT, "stop", mode, setup)
    (call,) = message["tool_calls"]
    assert reason == "tool_calls" and message["content"] is None
    assert call["function"]["name"] == "lookup"
    assert json.loads(call["function"]["arguments"]) == EXPECTED
    stream = ChoiceStream(mode, setup)
    deltas = [d for piece in TEXT.split("\n") for d in stream.feed(piece + "\n")]
    deltas += stream.finish()
    (streamed,) = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert json.loads(streamed["function"]["arguments"]) == EXPECTED
    # without the tools, the value is read as a number: the schema is what kept it text
    untyped, _ = chat_message(TEXT, "stop", ToolMode("auto"), setup)
    assert json.loads(untyped["tool_calls"][0]["function"]["arguments"])["zip"] == 2139
