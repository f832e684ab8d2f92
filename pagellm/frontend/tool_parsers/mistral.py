"""Mistral's tool calls (Mistral 7B v0.3, Mixtral, Mistral Small / Nemo, Ministral,
Devstral, Magistral): after the `[TOOL_CALLS]` token, either a JSON array of calls (the
tokenizers before v11),

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]

or one call per `[TOOL_CALLS]`, its name, then its arguments' JSON object (v11 and later:
Mistral Small 3.2, Devstral, Magistral), `[ARGS]` (and `[CALL_ID]` with an id) between
them where the tokenizer has those tokens,

    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}

(vLLM's `mistral`, which reads the array with a Hugging Face tokenizer and the second
form with mistral_common's). The tags are special tokens: the server decodes these
requests with them. Calls get Mistral's ids, nine letters or digits, which its chat
templates require back in the next turn's tool messages (a model's own `[CALL_ID]` of
that shape is kept).

What is a call and what is content: the text before the first `[TOOL_CALLS]` is
content; from there, calls are read in order while each is well formed (a name without
spaces or brackets and an object of arguments, or a non-empty array of
`{"name": str, "arguments": {...}}`); the first that is not, and everything after it, is
content verbatim, as is any text after the last call but whitespace. Each call streams
as soon as its JSON closes."""

from __future__ import annotations

import json
import random
import string
from collections.abc import Mapping, Sequence
from typing import Any

from pagellm.frontend.tool_parsers.base import (
    DeltaList,
    ExtractedToolCalls,
    GapContent,
    JsonObjectEnd,
    ToolCall,
    ToolParser,
    arguments_json,
    call_of_object,
    join_gaps,
    partial_tag_length,
    reject_json_constant,
    skip_space,
)

BOT, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_ALPHANUMERIC = string.ascii_letters + string.digits

_BEFORE, _CALL, _BETWEEN, _CONTENT = range(4)


def mistral_call_id() -> str:
    """A fresh id as Mistral's templates check it: nine letters or digits."""
    return "".join(random.choices(_ALPHANUMERIC, k=9))


def _with_id(call: ToolCall | None, call_id: str = "") -> ToolCall | None:
    """`call` with Mistral's id: the model's `call_id` where it has that shape, else a
    fresh one."""
    if call is None:
        return None
    valid = len(call_id) == 9 and call_id.isascii() and call_id.isalnum()
    call.id = call_id if valid else mistral_call_id()
    return call


def _call_of_head(head: str, arguments: str) -> ToolCall | None:
    """A v11 call: `head` (NAME, then [CALL_ID]ID and [ARGS] where present) and the
    arguments' text (a JSON object), or None."""
    name, has_id, rest = head.partition(CALL_ID)
    call_id = ""
    if has_id:
        call_id, _, rest = rest.partition(ARGS)
        call_id = call_id.strip()
    else:
        name, _, rest = head.partition(ARGS)
    name = name.strip()
    if not name or rest.strip() or any(c.isspace() or c in "[]{}" for c in name):
        return None
    args = arguments_json(arguments)
    return None if args is None else _with_id(ToolCall(name=name, arguments=args), call_id)


def _mode(tail: str) -> str | None:
    """How a call reads, from its first visible character on (`tail`): "array" (before
    v11), "v11", or None while a partial [ARGS] / [CALL_ID] leaves it open."""
    if not tail:
        return None
    if tail[0] != "[" or tail.startswith((ARGS, CALL_ID)):
        return "v11"
    return None if ARGS.startswith(tail) or CALL_ID.startswith(tail) else "array"


def _calls_of_array(text: str) -> list[ToolCall] | None:
    """The pre-v11 array's calls, or None unless every item is a call."""
    try:
        items = json.loads(text, parse_constant=reject_json_constant)
    except (ValueError, RecursionError):
        return None
    if not isinstance(items, list) or not items:
        return None
    calls = []
    for item in items:
        call = _with_id(call_of_object(item, ("arguments",)))
        if call is None:
            return None
        calls.append(call)
    return calls


class MistralToolParser(ToolParser):
    """`--tool-call-parser mistral` (module docstring)."""

    name = "mistral"
    special_tokens_in_text = True

    def __init__(self, tools: Sequence[Mapping[str, Any]] = ()) -> None:
        super().__init__(tools)
        self._phase = _BEFORE
        self._held = ""  # a partial [TOOL_CALLS] (whitespace goes to the gap)
        self._gap = GapContent()
        # The current call: its text since its [TOOL_CALLS], as pieces, their length,
        # where its first visible character is and the first few of them (while its
        # form is undecided), and its JSON's end once that has begun.
        self._call: list[str] = []
        self._call_len = 0
        self._first: int | None = None
        self._lead = ""
        self._value: JsonObjectEnd | None = None

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        """See the module docstring for what is a call and what is content."""
        start = text.find(BOT)
        calls: list[ToolCall] = []
        gap_start = read = start  # after the last call; where the next [TOOL_CALLS] is
        while start >= 0 and text.startswith(BOT, read):
            end, found = _read_call(text, read + len(BOT))
            if found is None:
                break
            calls.extend(found)
            gap_start = end
            read = skip_space(text, end)
        if not calls:
            return ExtractedToolCalls(tools_called=False, tool_calls=[],
                                      content=join_gaps([text]))
        return ExtractedToolCalls(tools_called=True, tool_calls=calls,
                                  content=join_gaps([text[:start], text[gap_start:]]))

    def feed(self, delta_text: str) -> list[dict[str, Any]]:
        """Content up to a possible [TOOL_CALLS]; each call once its JSON closes."""
        out = DeltaList()
        text = delta_text
        while text:
            if self._phase == _CONTENT:
                self._gap.add(text, out)
                break
            if self._phase == _CALL:
                text = self._feed_call(text, out)
                continue
            if self._phase == _BETWEEN and not self._held:  # whitespace: the gap's
                visible = skip_space(text, 0)
                self._gap.add(text[:visible], out)
                text = text[visible:]
                if not text:
                    break
            window = self._held + text
            self._held = ""
            at = window.find(BOT)
            if self._phase == _BETWEEN and at != 0:  # the next call, or the end
                if BOT.startswith(window):
                    self._held = window
                else:  # the calls have ended: the rest is content
                    self._phase = _CONTENT
                    self._gap.add(window, out)
                break
            if at < 0:
                keep = partial_tag_length(window, BOT)
                self._gap.add(window[:len(window) - keep], out)
                self._held = window[len(window) - keep:]
                break
            self._gap.add(window[:at], out)
            self._phase, self._value = _CALL, None
            self._call, self._call_len, self._first, self._lead = [], 0, None, ""
            text = window[at + len(BOT):]
        return out.deltas

    def _feed_call(self, text: str, out: DeltaList) -> str:
        """More of the current call's text; what follows the call once it has ended.
        Each character is looked at a bounded number of times, however long the call's
        name, whitespace or JSON (a hostile output of 200k characters streams in
        linear time)."""
        if self._value is None:  # its JSON has not begun: the array's "[" or the "{"
            offset = self._call_len
            if self._first is None:
                visible = skip_space(text, 0)
                if visible < len(text):
                    self._first = offset + visible
            if self._first is not None and len(self._lead) < len(CALL_ID):
                start = max(0, self._first - offset)
                self._lead += text[start:start + len(CALL_ID) - len(self._lead)]
            mode = _mode(self._lead)
            begin = -1
            if mode == "array":
                assert self._first is not None
                begin = self._first
            elif mode == "v11":
                brace = text.find("{")
                begin = -1 if brace < 0 else offset + brace
            if begin < 0:
                self._call.append(text)
                self._call_len += len(text)
                return ""
            self._value = JsonObjectEnd("[]" if mode == "array" else "{}")
            joined = "".join(self._call) + text
            self._call, text = [joined[:begin]], joined[begin:]
        end = self._value.feed(text)
        if end is None:
            self._call.append(text)
            return ""
        call_text = "".join(self._call) + text[:end]
        _, found = _read_call(call_text, 0)
        if found is None:  # no call: it, and everything after it, is content
            self._phase = _CONTENT
            self._gap.add(BOT + call_text, out)
        else:
            self._gap.close()
            for call in found:
                out.add(self._call_delta(call))
            self._phase = _BETWEEN
        return text[end:]

    def finish(self) -> list[dict[str, Any]]:
        """A call cut off, or what is held, as content."""
        out = DeltaList()
        if self._phase == _CALL:
            self._gap.add(BOT + "".join(self._call), out)
        else:
            self._gap.add(self._held, out)
        self._held, self._call, self._phase = "", [], _CONTENT
        self._gap.close()
        return out.deltas


def _read_call(text: str, pos: int) -> tuple[int, list[ToolCall] | None]:
    """The call(s) after a [TOOL_CALLS] ending at `pos`: (where they end, the calls),
    or (pos, None) where the text there is none."""
    first = skip_space(text, pos)
    mode = _mode(text[first:first + len(CALL_ID)])
    if mode is None:
        return pos, None
    if mode == "array":
        end = JsonObjectEnd("[]").feed(text, first)
        found = None if end is None else _calls_of_array(text[first:end])
    else:
        brace = text.find("{", pos)
        end = None if brace < 0 else JsonObjectEnd().feed(text, brace)
        call = None if end is None else _call_of_head(text[pos:brace], text[brace:end])
        found = None if call is None else [call]
    return (pos, None) if end is None or found is None else (end, found)
