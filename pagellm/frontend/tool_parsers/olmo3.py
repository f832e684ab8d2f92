"""OLMo 3's tool calls: Python calls, one per line, in a block,

    <function_calls>
    get_weather(city="Paris", days=3)
    get_time(zone=null)
    </function_calls>

(vLLM's `olmo3`): each line is a call `name(keyword=literal, ...)` read with `ast`, never
evaluated (pythonic.py's `python_calls`), JSON's null, true and false allowed as values
(its chat template describes the tools in JSON). A block that is not exactly such lines
is content (blocks.py). Deviation: vLLM also reads an output without the tags as
calls when not streaming (never when streaming); here only blocks hold calls, so both
modes agree and an answer that happens to look like a call stays an answer."""

from __future__ import annotations

from pagellm.frontend.tool_parsers.base import ToolCall
from pagellm.frontend.tool_parsers.blocks import BlockToolParser
from pagellm.frontend.tool_parsers.pythonic import python_calls


class Olmo3ToolParser(BlockToolParser):
    """`--tool-call-parser olmo3`: a block is its lines' calls (`parse_body` each)."""

    name = "olmo3"
    START = "<function_calls>"
    END = "</function_calls>"

    def parse_calls(self, body: str) -> list[ToolCall] | None:
        calls = []
        for line in body.splitlines():
            if line.strip():
                call = self.parse_body(line)
                if call is None:
                    return None
                calls.append(call)
        return calls or None

    def parse_body(self, body: str) -> ToolCall | None:
        """One line: exactly one call."""
        calls = python_calls(f"[{body.strip()}]", json_names=True)
        return calls[0] if calls is not None and len(calls) == 1 else None
