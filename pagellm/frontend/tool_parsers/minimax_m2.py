"""MiniMax-M2's tool calls (M2, M2.1): a block of one or more invokes, each parameter's
value as text between tags,

    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Paris</parameter>
    <parameter name="days">3</parameter>
    </invoke>
    <invoke name="get_time">
    <parameter name="zone">CET</parameter>
    </invoke>
    </minimax:tool_call>

(vLLM's `minimax_m2`). A name is quoted ("..." or '...') or bare; a value is its text
with the surrounding whitespace removed, typed by the request's tool schema as vLLM's
parser types it (`minimax_value`): every type the schema allows (`type`, a list of
them, the values of an `enum`, the branches of anyOf / oneOf / allOf) is tried in the
order integer, number, boolean, object or array, string, the first that reads winning;
"null", "none" and "nil" are null; a parameter the schema does not declare is text.
A block that is not exactly invokes with their parameters is content (blocks.py)."""

from __future__ import annotations

import json
from typing import Any

from pagellm.frontend.tool_parsers.base import (
    ToolCall,
    call_with,
    only_space,
    read_int,
    read_number,
    reject_json_constant,
    tagged,
    tagged_parameters,
)
from pagellm.frontend.tool_parsers.blocks import BlockToolParser

# The order types are tried in (vLLM's), each with the spellings a schema may use.
_TYPE_ORDER = (("integer", "int"), ("number", "float"), ("boolean", "bool"),
               ("object", "array"), ("string", "str", "text"))
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")
_UNREAD = object()  # a value that does not read as the type tried


def schema_types(schema: Any, depth: int = 0) -> set[str]:
    """The types a parameter's JSON schema allows, lower-cased: its `type` (or list),
    the types of its `enum` values, and those of its anyOf / oneOf / allOf branches;
    {"string"} when it names none. A request's schema may nest without end: past 32
    levels a branch adds nothing."""
    if not isinstance(schema, dict) or depth > 32:
        return {"string"} if depth == 0 else set()
    types: set[str] = set()
    declared = schema.get("type")
    for name in declared if isinstance(declared, list) else [declared]:
        if isinstance(name, str):
            types.add(name.lower())
    enum = schema.get("enum")
    for value in enum if isinstance(enum, list) else ():
        types.add(_json_type(value))
    for key in ("anyOf", "oneOf", "allOf"):
        branches = schema.get(key)
        for branch in branches if isinstance(branches, list) else ():
            types |= schema_types(branch, depth + 1)
    return types or ({"string"} if depth == 0 else set())


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    return {int: "integer", float: "number", str: "string", list: "array",
            dict: "object"}.get(type(value), "string")


def minimax_value(text: str, declared: Any) -> Any:
    """A parameter's text as the first type its schema entry `declared` allows that
    reads (module docstring); None: the tool does not declare it, kept as text."""
    if text.lower() in ("null", "none", "nil"):
        return None
    if declared is None:
        return text
    types = schema_types(declared)
    for spellings in _TYPE_ORDER:
        if types.isdisjoint(spellings):
            continue
        value = _read(text, spellings[0])
        if value is not _UNREAD:
            return value
    value = _json(text)  # a type none of those: JSON if it reads, else the text
    return text if value is _UNREAD else value


def _read(text: str, kind: str) -> Any:
    """`text` as `kind` (integer, number, boolean, object or array, string), or _UNREAD."""
    if kind == "string":
        return text
    if kind in ("integer", "number"):
        number = read_int(text) if kind == "integer" else read_number(text)
        return _UNREAD if number is None else number
    if kind == "boolean":
        lowered = text.strip().lower()
        return True if lowered in _TRUE else False if lowered in _FALSE else _UNREAD
    return _json(text)


def _json(text: str) -> Any:
    try:
        return json.loads(text, parse_constant=reject_json_constant)
    except (ValueError, RecursionError):
        return _UNREAD


def _name(text: str) -> str | None:
    """A quoted or bare name (no whitespace, no tag characters inside), or None."""
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        text = text[1:-1]
    if not text or any(c.isspace() or c in "<>\"'" for c in text):
        return None
    return text


class MiniMaxM2ToolParser(BlockToolParser):
    """`--tool-call-parser minimax_m2` (MiniMax-M2, M2.1): a block is its invokes, each
    a call (`parse_body`), whitespace between them."""

    name = "minimax_m2"
    START = "<minimax:tool_call>"
    END = "</minimax:tool_call>"

    def parse_calls(self, body: str) -> list[ToolCall] | None:
        calls: list[ToolCall] = []
        pos = 0
        while not only_space(body, pos):
            invoke = tagged(body, pos, "<invoke name=", "</invoke>")
            if invoke is None:
                return None
            call = self.parse_body(invoke[0])
            if call is None:
                return None
            calls.append(call)
            pos = invoke[1]
        return calls or None

    def parse_body(self, body: str) -> ToolCall | None:
        """One invoke, between `<invoke name=` and `</invoke>`: its name, `>`, then
        nothing but parameters."""
        head, close, rest = body.partition(">")
        name = _name(head)
        if not close or name is None:
            return None
        arguments = tagged_parameters(
            rest, "<parameter name=", "</parameter>", _name,
            lambda key, value: minimax_value(value.strip(), self.declared(name, key)))
        return None if arguments is None else call_with(name, arguments)
