"""Tool calls and reasoning in chat completions: what a request's `tools` and
`tool_choice` constrain, and how each choice's text becomes the assistant's message.

- tool_choice "none": the tools are rendered into the prompt, nothing is parsed.
- a named function: the output is that tool's arguments, constrained by its
  `parameters` schema (structured outputs), so they are valid by construction.
- "required": the output is a JSON array of calls `[{"name": ..., "parameters": {...}}]`
  constrained by a schema built from every tool (one call unless parallel_tool_calls).
- "auto" (the default when tools are given): the model decides; the server's
  `--tool-call-parser` finds calls in its text. Needs `--enable-auto-tool-choice`.
With `--reasoning-parser`, the reasoning is split off first (`reasoning_content`), and
only what follows it is content or calls. `ChoiceStream` does the same for a stream,
delta by delta, with OpenAI's chunk format for tool-call deltas.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pagellm.frontend.reasoning import get_reasoning_parser
from pagellm.frontend.reasoning.base import ReasoningParser
from pagellm.frontend.reasoning.gptoss import GptOssReasoningParser
from pagellm.frontend.tool_parsers import get_tool_parser
from pagellm.frontend.tool_parsers.base import ToolCall, ToolParser
from pagellm.frontend.tool_parsers.openai import OpenAIToolParser
from pagellm.protocol.sampling_params import StructuredOutputsParams

MAX_TOOLS = 1024


@dataclass(frozen=True)
class ToolSetup:
    """The server's side: `--enable-auto-tool-choice`, `--tool-call-parser`,
    `--reasoning-parser`."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None


@dataclass(frozen=True)
class ToolMode:
    """One request's resolved tool choice: "none", "auto", "required" or "named"."""

    mode: str
    name: str | None = None  # the named function
    # "auto": the request's tools, for its parser (not part of the mode's identity)
    tools: tuple[dict[str, Any], ...] = field(default=(), compare=False)

    @property
    def calls_tools(self) -> bool:
        return self.mode != "none"


def resolve_tool_mode(tools: list[dict[str, Any]] | None, tool_choice: Any,
                      setup: ToolSetup) -> ToolMode:
    """Check the tools and the choice (ValueError naming what is wrong)."""
    names = _tool_names(tools)
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise ValueError('tool_choice must be "none", "auto", "required" or '
                             '{"type": "function", "function": {"name": ...}}')
        if name not in names:
            raise ValueError(f"tool_choice names the function {name[:100]!r}, which is not "
                             f"in tools")
        return ToolMode("named", name)
    if tool_choice not in ("none", "auto", "required"):
        raise ValueError(f'tool_choice must be "none", "auto", "required" or a named '
                         f"function, got {str(tool_choice)[:100]!r}")
    if tool_choice != "none" and not tools:
        raise ValueError(f'tool_choice "{tool_choice}" needs tools')
    if tool_choice == "auto" and not (setup.enable_auto_tool_choice
                                      and setup.tool_call_parser):
        raise ValueError('"auto" tool choice requires --enable-auto-tool-choice and '
                         '--tool-call-parser to be set (or send tool_choice "required", '
                         '"none" or a named function)')
    return ToolMode(tool_choice, tools=tuple(tools or ()) if tool_choice == "auto" else ())


def _tool_names(tools: list[dict[str, Any]] | None) -> list[str]:
    if tools is None:
        return []
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"tools: {len(tools)} tools, more than {MAX_TOOLS}")
    names = []
    for tool in tools:
        function = tool.get("function")
        if tool.get("type") != "function" or not isinstance(function, dict) or \
                not isinstance(function.get("name"), str):
            raise ValueError('tools: each tool must be {"type": "function", "function": '
                             '{"name": ..., "parameters": {...}}}')
        if not isinstance(function.get("parameters", {}), dict):
            raise ValueError(f"tools: {function['name'][:100]!r}: parameters must be a "
                             "JSON schema (an object)")
        names.append(function["name"])
    return names


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def tool_constraint(tools: list[dict[str, Any]] | None, mode: ToolMode,
                    parallel_tool_calls: bool) -> StructuredOutputsParams | None:
    """The structured output a named or required tool choice implies (None otherwise)."""
    if mode.mode == "named":
        tool = next(t for t in tools or [] if t["function"]["name"] == mode.name)
        return StructuredOutputsParams(json=_parameters(tool))
    if mode.mode == "required":
        calls = [{"type": "object",
                  "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                 "parameters": _parameters(t)},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for t in tools or []]
        schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                  "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if not parallel_tool_calls:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema)
    return None


def _required_calls(text: str) -> list[ToolCall] | None:
    """A "required" choice's JSON array as calls (None if it did not complete)."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(items, list):
        return None
    return [ToolCall(name=item["name"], arguments=json.dumps(item["parameters"],
                                                             ensure_ascii=False))
            for item in items if isinstance(item, dict) and "name" in item]


def _parsers(setup: ToolSetup, mode: ToolMode, thinking: bool
             ) -> tuple[ReasoningParser | None, ToolParser | None]:
    """One choice's reasoning parser and tool parser (None where the server or the
    tool choice has none). `thinking`: the request's chat_template_kwargs
    enable_thinking (Qwen3's switch). Harmony's two parsers (openai_gptoss, openai)
    read the same messages: together, the tool parser alone reads the whole output and
    reports the reasoning as well."""
    reasoning = None if setup.reasoning_parser is None else \
        get_reasoning_parser(setup.reasoning_parser)(thinking_enabled=thinking)
    if mode.mode != "auto" or setup.tool_call_parser is None:
        return reasoning, None
    parser_class = get_tool_parser(setup.tool_call_parser)
    if parser_class is OpenAIToolParser and isinstance(reasoning, GptOssReasoningParser):
        return None, OpenAIToolParser(mode.tools, with_reasoning=True)
    return reasoning, parser_class(mode.tools)


def special_tokens_in_text(setup: ToolSetup, mode: ToolMode) -> bool:
    """A parser this request uses reads tags that are special tokens: its output must
    be decoded with them (skip_special_tokens false), whatever the request asked."""
    reasoning = setup.reasoning_parser is not None and \
        get_reasoning_parser(setup.reasoning_parser).special_tokens_in_text
    tool = mode.mode == "auto" and setup.tool_call_parser is not None and \
        get_tool_parser(setup.tool_call_parser).special_tokens_in_text
    return reasoning or tool


def chat_message(text: str, finish_reason: str | None, mode: ToolMode, setup: ToolSetup,
                 thinking: bool = True) -> tuple[dict[str, Any], str | None]:
    """(the assistant message, the finish reason: "tool_calls" when an auto or required
    choice called tools) for one choice's whole text."""
    message: dict[str, Any] = {"role": "assistant"}
    reasoning_parser, parser = _parsers(setup, mode, thinking)
    content: str | None = text
    if reasoning_parser is not None:
        reasoning, content = reasoning_parser.extract_reasoning(text)
        message["reasoning_content"] = reasoning
    calls: list[ToolCall] = []
    if mode.mode == "named" and content is not None:
        assert mode.name is not None
        calls, content = [ToolCall(name=mode.name, arguments=content)], None
    elif mode.mode == "required" and content is not None:
        parsed = _required_calls(content)
        if parsed:
            calls, content = parsed, None
    elif mode.mode == "auto" and content is not None:
        assert parser is not None
        extracted = parser.extract_tool_calls(content)
        if isinstance(parser, OpenAIToolParser):  # Harmony's content never holds its tags
            content = extracted.content
            if parser.with_reasoning:
                message["reasoning_content"] = extracted.reasoning
        if extracted.tools_called:
            calls, content = extracted.tool_calls, extracted.content
    message["content"] = content
    if calls:
        message["tool_calls"] = [call.to_openai() for call in calls]
        if mode.mode in ("auto", "required") and finish_reason == "stop":
            finish_reason = "tool_calls"
    return message, finish_reason


class ChoiceStream:
    """One streamed choice: each text delta in, OpenAI chat deltas out (reasoning,
    content, tool-call deltas), and the finish reason to report."""

    def __init__(self, mode: ToolMode, setup: ToolSetup, thinking: bool = True) -> None:
        self.mode = mode
        self.reasoning, self.parser = _parsers(setup, mode, thinking)
        self.buffered = ""  # a required choice's array, parsed at the end
        self.called = False
        self._named_started = False

    def feed(self, text: str) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        if self.reasoning is not None:
            split = self.reasoning.feed(text) if text else None
            text = ""
            if split:
                if split.get("reasoning_content"):
                    deltas.append({"reasoning_content": split["reasoning_content"]})
                text = split.get("content") or ""
        return deltas + self._content(text)

    def finish(self) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        text = ""
        if self.reasoning is not None:
            split = self.reasoning.finish()
            if split:
                if split.get("reasoning_content"):
                    deltas.append({"reasoning_content": split["reasoning_content"]})
                text = split.get("content") or ""
        deltas += self._content(text)
        if self.parser is not None:
            deltas += self._seen(self.parser.finish())
        elif self.mode.mode == "required":
            calls = _required_calls(self.buffered)
            if calls:
                self.called = True
                deltas += [{"tool_calls": [{"index": i, **call.to_openai()}]}
                           for i, call in enumerate(calls)]
            elif self.buffered:
                deltas.append({"content": self.buffered})
        return deltas

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if self.called and reason == "stop" and \
            self.mode.mode in ("auto", "required") else reason

    def _content(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        if self.parser is not None:
            return self._seen(self.parser.feed(text))
        if self.mode.mode == "required":
            self.buffered += text
            return []
        if self.mode.mode == "named":
            deltas: list[dict[str, Any]] = []
            if not self._named_started:
                self._named_started = True
                deltas.append({"tool_calls": [{"index": 0, **ToolCall(
                    name=self.mode.name or "", arguments="").to_openai()}]})
            deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
            return deltas
        return [{"content": text}]

    def _seen(self, deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if any("tool_calls" in d for d in deltas):
            self.called = True
        return deltas
