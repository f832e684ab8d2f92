"""Qwen3-Coder's tool calls (also Qwen3.5's and Seed-OSS's): XML-like blocks with the
function's name and each parameter in tags,

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

(vLLM's `qwen3_coder` and `qwen3_xml`; Seed-OSS writes the same body inside
`<seed:tool_call>` ... `</seed:tool_call>`: `seed_oss`). A value is text, one newline
after its opening tag and one before its closing tag not part of it; the request's tool
schema types it as vLLM's parser does (`typed_value`): kept as text for a string (or
an undeclared parameter), read as an integer, a number, a boolean, or JSON (else a
Python literal) for an object or array, "null" as null; a value that does not read as
its type stays text. A block that is not exactly a function with its parameters is
content (blocks.py)."""

from __future__ import annotations

from typing import Any

from pagellm.frontend.tool_parsers.base import (
    ToolCall,
    call_with,
    json_or_literal,
    python_literal,
    read_int,
    read_number,
    tagged_parameters,
)
from pagellm.frontend.tool_parsers.blocks import BlockToolParser

_STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")
_INTEGER_PREFIXES = ("int", "uint", "long", "short", "unsigned")


def typed_value(text: str, declared: Any) -> Any:
    """A parameter's text as the type its schema entry `declared` names (the rules of
    vLLM's Qwen3CoderToolParser._convert_param_value; None: the tool does not declare
    the parameter, kept as text)."""
    if text.lower() == "null":
        return None
    if declared is None:
        return text
    kind = str(declared.get("type", "string")).strip().lower() \
        if isinstance(declared, dict) else "string"
    if kind in _STRING_TYPES:
        return text
    if kind.startswith(_INTEGER_PREFIXES) or kind.startswith(("num", "float")):
        number = read_int(text) if kind.startswith(_INTEGER_PREFIXES) else read_number(text)
        return text if number is None else number
    if kind in ("boolean", "bool", "binary"):
        return text.lower() == "true"
    if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
        return json_or_literal(text)
    return python_literal(text)


class Qwen3CoderToolParser(BlockToolParser):
    """`--tool-call-parser qwen3_coder` (Qwen3-Coder, Qwen3.5): a block is a call when
    its body is one `<function=NAME>` holding nothing but parameters."""

    name = "qwen3_coder"
    START = "<tool_call>"
    END = "</tool_call>"

    def parse_body(self, body: str) -> ToolCall | None:
        body = body.strip()
        if not body.startswith("<function=") or not body.endswith("</function>"):
            return None
        name, close, rest = body[len("<function="):-len("</function>")].partition(">")
        name = name.strip()
        if not close or not name or "\n" in name:
            return None
        arguments = tagged_parameters(
            rest, "<parameter=", "</parameter>", _key,
            lambda key, value: typed_value(value.removeprefix("\n").removesuffix("\n"),
                                           self.declared(name, key)))
        return None if arguments is None else call_with(name, arguments)


def _key(text: str) -> str | None:
    """A parameter's name: one line, not empty."""
    key = text.strip()
    return key if key and "\n" not in key else None


class Qwen3XmlToolParser(Qwen3CoderToolParser):
    """`--tool-call-parser qwen3_xml`: vLLM's other name for the same format."""

    name = "qwen3_xml"


class SeedOssToolParser(Qwen3CoderToolParser):
    """`--tool-call-parser seed_oss` (Seed-OSS): the same body in Seed's tags."""

    name = "seed_oss"
    START = "<seed:tool_call>"
    END = "</seed:tool_call>"
