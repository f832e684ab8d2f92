"""Llama 3.x JSON tool calls (the JSON-based tool chat templates): the output opens with
an optional `<|python_tag|>`, then one or more objects
`{"name": "f", "parameters": {...}}` (or `"arguments"`) separated by `;`.

An output that does not open (after whitespace and the tag) with "{" is plain content,
decided as soon as its first visible character arrives."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from pagellm.frontend.tool_parsers.base import (
    DeltaList,
    ExtractedToolCalls,
    JsonObjectEnd,
    LeadMatcher,
    ToolCall,
    ToolParser,
    content_or_none,
    parse_call_object,
    strip_lead,
)

PYTHON_TAG = "<|python_tag|>"
ARGUMENT_KEYS = ("arguments", "parameters")  # "arguments" first when both, as vLLM
_SEPARATOR = re.compile(r"\s*(?:;\s*)?")

_LEAD, _OBJECT, _SEPARATING, _CONTENT = range(4)


class Llama3JsonToolParser(ToolParser):
    """`--tool-call-parser llama3_json`.

    Objects are read in order while each is a valid call (a JSON object with a string
    `name` and an object `parameters`/`arguments`). If the first is not, the whole
    output is content (a model answering with plain JSON is answering, not calling).
    After at least one call, whatever follows the last call, unless it is only
    whitespace and `;`, is content verbatim. vLLM instead looks for objects anywhere
    in the text when not streaming (while streaming only an output that opens with the
    tag or "{"), returns content None whenever a call is found, and fails the whole
    output when any object is no call; reading a prefix of calls the same way in both
    modes is what lets each call stream as soon as its closing brace arrives."""

    name = "llama3_json"

    def __init__(self, tools: Sequence[Mapping[str, Any]] = ()) -> None:
        super().__init__(tools)
        self._phase = _LEAD
        self._lead = LeadMatcher(PYTHON_TAG, "{")
        self._held: list[str] = []  # text since the output began or the last call ended
        self._object = JsonObjectEnd()
        self._object_text: list[str] = []
        self._after_semicolon = False

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        """See the class docstring for what is a call and what is content."""
        rest = strip_lead(text, PYTHON_TAG)
        calls: list[ToolCall] = []
        if rest.startswith("{"):
            pos = len(text) - len(rest)
            last_end = pos
            while True:
                end = JsonObjectEnd().feed(text, pos)
                call = None if end is None else parse_call_object(text[pos:end],
                                                                  ARGUMENT_KEYS)
                if end is None or call is None:
                    break
                calls.append(call)
                last_end = end
                match = _SEPARATOR.match(text, end)
                assert match is not None  # the pattern matches the empty string
                pos = match.end()
                if not text.startswith("{", pos):
                    break
        if not calls:
            return ExtractedToolCalls(tools_called=False, tool_calls=[],
                                      content=content_or_none(text))
        tail = text[last_end:]
        return ExtractedToolCalls(tools_called=True, tool_calls=calls,
                                  content=None if _SEPARATOR.fullmatch(tail) else tail)

    def feed(self, delta_text: str) -> list[dict[str, Any]]:
        """Content once the output cannot be calls; each call once its object closes."""
        out = DeltaList()
        text = delta_text
        while text:
            if self._phase == _CONTENT:
                out.content(text)
                break
            if self._phase != _OBJECT:  # before the first call, or between calls
                opener = self._lead.feed(text) if self._phase == _LEAD \
                    else self._separator(text)
                if opener == LeadMatcher.UNDECIDED:
                    self._held.append(text)
                    break
                if opener == LeadMatcher.CONTENT:
                    self._to_content(text, out)
                    break
                self._held.append(text[:opener])
                text = text[opener:]
                self._start_object()
            else:
                end = self._object.feed(text)
                if end is None:
                    self._held.append(text)
                    self._object_text.append(text)
                    break
                call = parse_call_object("".join(self._object_text) + text[:end],
                                         ARGUMENT_KEYS)
                if call is None:
                    self._to_content(text, out)
                    break
                out.add(self._call_delta(call))
                self._held.clear()
                self._phase = _SEPARATING
                self._after_semicolon = False
                text = text[end:]
        return out.deltas

    def finish(self) -> list[dict[str, Any]]:
        """Held text that never became a call, as content (a separator alone is none)."""
        out = DeltaList()
        if self._phase in (_LEAD, _OBJECT):
            out.content(content_or_none("".join(self._held)) or "")
        self._held.clear()
        self._phase = _CONTENT
        return out.deltas

    def _start_object(self) -> None:
        """The next text opens an object."""
        self._phase = _OBJECT
        self._object = JsonObjectEnd()
        self._object_text = []

    def _to_content(self, text: str, out: DeltaList) -> None:
        """What is held, and `text`, turn out to be content; so is the rest."""
        self._held.append(text)
        out.content("".join(self._held))
        self._held.clear()
        self._phase = _CONTENT

    def _separator(self, text: str) -> int:
        """After a call: the index of the next object's "{", or UNDECIDED while the
        text is still whitespace and at most one ";", or CONTENT."""
        for i, char in enumerate(text):
            if char.isspace():
                continue
            if char == ";" and not self._after_semicolon:
                self._after_semicolon = True
            elif char == "{":
                return i
            else:
                return LeadMatcher.CONTENT
        return LeadMatcher.UNDECIDED
