"""Pythonic tool calls (Llama 3.2/4, ToolACE): the output is a Python list of calls,

    [get_weather(city="Paris"), get_time()]

optionally wrapped in `<|python_start|>`/`<|python_end|>`. It is read with `ast` and
`ast.literal_eval` only, never evaluated: model output is untrusted."""

from __future__ import annotations

import ast
import json
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from pagellm.frontend.tool_parsers.base import (
    DeltaList,
    ExtractedToolCalls,
    LeadMatcher,
    ToolCall,
    ToolParser,
    content_or_none,
    strip_lead,
)

PYTHON_START = "<|python_start|>"
PYTHON_END = "<|python_end|>"

_LEAD, _HOLD, _CONTENT = range(3)


_JSON_NAMES = {"null": None, "true": True, "false": False}


class _JsonNames(ast.NodeTransformer):
    """JSON's null, true and false written as bare names (OLMo 3's calls) as the
    constants they stand for."""

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if node.id in _JSON_NAMES:
            return ast.copy_location(ast.Constant(_JSON_NAMES[node.id]), node)
        return node


def python_calls(source: str, json_names: bool = False) -> list[ToolCall] | None:
    """The calls of a Python list `[name(keyword=literal, ...), ...]`, or None when
    `source` is not exactly that: a positional argument, `**kwargs`, a repeated
    keyword, a dotted name, or any value that is not a literal (a variable, an
    expression, a call), as is a literal JSON cannot carry (a set, bytes, a complex
    number, NaN). `json_names`: null, true and false are literals too."""
    if not source.startswith("["):
        return None
    try:
        with warnings.catch_warnings():
            # An invalid escape in a string ("\<") warns at parse time (Deprecation-
            # then SyntaxWarning): model output, not our code, so not worth a log line.
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.simplefilter("ignore", SyntaxWarning)
            tree = ast.parse(source, mode="eval")
        if not isinstance(tree.body, ast.List):
            return None
        calls: list[ToolCall] = []
        for node in tree.body.elts:
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and not node.args):
                return None
            arguments: dict[str, Any] = {}
            for keyword in node.keywords:
                if keyword.arg is None or keyword.arg in arguments:
                    return None
                value = _JsonNames().visit(keyword.value) if json_names else keyword.value
                arguments[keyword.arg] = ast.literal_eval(value)
            calls.append(ToolCall(name=node.func.id, arguments=json.dumps(
                arguments, ensure_ascii=False, allow_nan=False)))
        return calls
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
        # ast.parse: SyntaxError (and ValueError on NUL bytes), MemoryError/
        # RecursionError on absurd nesting; literal_eval: ValueError on a non-literal
        # (also oversized int strings); json.dumps: TypeError on sets, bytes, complex,
        # tuple keys, ValueError on NaN/Infinity.
        return None


def _parse_calls(text: str) -> list[ToolCall] | None:
    """The calls of a whole output (`python_calls` of it, without the wrapping tags)."""
    source = strip_lead(text, PYTHON_START).rstrip()
    return python_calls(source.removesuffix(PYTHON_END).strip())


class PythonicToolParser(ToolParser):
    """`--tool-call-parser pythonic`.

    All or nothing, as vLLM: an output that is a list of calls is all calls (content
    None); anything else is all content. Streaming holds an output that opens with "["
    (after whitespace and `<|python_start|>`) to the end and parses it once then
    (vLLM streams argument fragments by re-parsing the growing text on every delta;
    the list is the whole output, so its end is the stream's end and nothing is sent
    later than it could be confirmed); any other output streams as content from its
    first visible character. Tuples become JSON arrays."""

    name = "pythonic"

    def __init__(self, tools: Sequence[Mapping[str, Any]] = ()) -> None:
        super().__init__(tools)
        self._phase = _LEAD
        self._lead = LeadMatcher(PYTHON_START, "[")
        self._held: list[str] = []

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        """See the class docstring for what is a call and what is content."""
        calls = _parse_calls(text)
        if not calls:  # [] is no call either
            return ExtractedToolCalls(tools_called=False, tool_calls=[],
                                      content=content_or_none(text))
        return ExtractedToolCalls(tools_called=True, tool_calls=calls, content=None)

    def feed(self, delta_text: str) -> list[dict[str, Any]]:
        """Content once the output cannot be a list of calls; nothing while it can."""
        out = DeltaList()
        if self._phase == _CONTENT:
            out.content(delta_text)
            return out.deltas
        self._held.append(delta_text)
        if self._phase == _LEAD:
            opener = self._lead.feed(delta_text)
            if opener == LeadMatcher.CONTENT:
                out.content("".join(self._held))
                self._held.clear()
                self._phase = _CONTENT
            elif opener != LeadMatcher.UNDECIDED:
                self._phase = _HOLD
        return out.deltas

    def finish(self) -> list[dict[str, Any]]:
        """The calls of a held list, or the held text as content."""
        out = DeltaList()
        if self._phase != _CONTENT:
            result = self.extract_tool_calls("".join(self._held))
            for call in result.tool_calls:
                out.add(self._call_delta(call))
            out.content(result.content or "")
        self._held.clear()
        self._phase = _CONTENT
        return out.deltas
