"""GLM-4.5 / 4.6's tool calls: a `<tool_call>` block holding the function's name on its
first line, then each argument as a key and a value in tags,

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

(vLLM's `glm45`). The values are text: one whose parameter the request's tool schema
types "string" is kept as written (stripped); any other is read as JSON, else as a
Python literal (GLM writes True and None sometimes), else kept as text, as vLLM's
parser does."""

from __future__ import annotations

from typing import Any

from pagellm.frontend.tool_parsers.base import (
    ToolCall,
    call_with,
    json_or_literal,
    only_space,
    tagged,
)
from pagellm.frontend.tool_parsers.blocks import BlockToolParser


class Glm45ToolParser(BlockToolParser):
    """`--tool-call-parser glm45`: a block is a call when its first line is a name and
    the rest is nothing but key/value pairs (blocks.py: what is content)."""

    name = "glm45"
    START = "<tool_call>"
    END = "</tool_call>"

    def parse_body(self, body: str) -> ToolCall | None:
        cut = body.find("<arg_key>")
        head, rest = (body, "") if cut < 0 else (body[:cut], body[cut:])
        name = head.strip()
        if not name or "\n" in name or "<" in name:
            return None
        arguments: dict[str, Any] = {}
        pos = 0
        while not only_space(rest, pos):  # key/value pairs, whitespace between
            key_tag = tagged(rest, pos, "<arg_key>", "</arg_key>")
            value_tag = None if key_tag is None else \
                tagged(rest, key_tag[1], "<arg_value>", "</arg_value>")
            if key_tag is None or value_tag is None:
                return None
            key = key_tag[0].strip()
            if not key or key in arguments:
                return None
            arguments[key] = self._value(name, key, value_tag[0].strip())
            pos = value_tag[1]
        return call_with(name, arguments)

    def _value(self, tool: str, key: str, text: str) -> Any:
        if self._declared_type(tool, key) == "string":
            return text
        return json_or_literal(text)

    def _declared_type(self, tool: str, key: str) -> Any:
        """The `type` the request's tool `tool` gives parameter `key`, or None."""
        declared = self.declared(tool, key)
        return declared.get("type") if isinstance(declared, dict) else None


class Glm47ToolParser(Glm45ToolParser):
    """`--tool-call-parser glm47` (GLM-4.7, GLM-5: vLLM's name): the same blocks with
    the name run straight into the first key (`<tool_call>get_weather<arg_key>city
    </arg_key>...`), which glm45's parser already reads (the name ends at the first
    `<arg_key>`, the line break is optional), as vLLM now serves both names with one
    parser."""

    name = "glm47"
