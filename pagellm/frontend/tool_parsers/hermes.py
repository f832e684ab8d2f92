"""Hermes-style tool calls (Hermes 2 Pro, Qwen2.5, Qwen3): each call is a JSON object
between `<tool_call>` and `</tool_call>`,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

possibly several, possibly after some text (blocks.py: what is a call, what is
content)."""

from __future__ import annotations

from pagellm.frontend.tool_parsers.base import ToolCall, parse_call_object
from pagellm.frontend.tool_parsers.blocks import BlockToolParser


class HermesToolParser(BlockToolParser):
    """`--tool-call-parser hermes`: a block whose body is a JSON object with a string
    `name` and an object `arguments` is a call."""

    name = "hermes"
    START = "<tool_call>"
    END = "</tool_call>"

    def parse_body(self, body: str) -> ToolCall | None:
        return parse_call_object(body, ("arguments",))


class Ernie45ToolParser(HermesToolParser):
    """`--tool-call-parser ernie45` (ERNIE 4.5: vLLM's name): Hermes's blocks, which
    ERNIE's thinking models write after `</think>`. The `<response>` tags around an
    answer are the reasoning parser's to remove (`--reasoning-parser ernie45`), as the
    content reaches this parser after it."""

    name = "ernie45"
