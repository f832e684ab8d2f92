"""Hermes-style tool calls (Hermes 2 Pro, Qwen2.5, Qwen3): each call is a JSON object
between `<tool_call>` and `</tool_call>`,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

possibly several, possibly after some text."""

from __future__ import annotations

from typing import Any

from pagellm.frontend.tool_parsers.base import (
    DeltaList,
    ExtractedToolCalls,
    GapContent,
    TagSearch,
    ToolCall,
    ToolParser,
    join_gaps,
    parse_call_object,
    partial_tag_length,
)

START = "<tool_call>"
END = "</tool_call>"


def _block_call(body: str, terminated: bool) -> ToolCall | None:
    """The call a block's body spells, or None. An unterminated block (the model stopped
    at EOS, or was cut off, before `</tool_call>`) counts when its JSON is complete; a
    partial `</tool_call>` at its end is ignored."""
    if not terminated:
        body = body[:len(body) - partial_tag_length(body, END)]
    return parse_call_object(body, ("arguments",))


class HermesToolParser(ToolParser):
    """`--tool-call-parser hermes`.

    Each `<tool_call>` block is judged on its own: one whose body is a JSON object with a
    string `name` and an object `arguments` is a call; any other block stays in the
    content, tags and all (vLLM instead drops every call and returns the whole output as
    content when one block fails: judging blocks one by one lets a call be streamed as
    soon as its block closes, which all-or-nothing could not without holding back
    everything after the first tag until the end). Content is the text outside the
    calls, verbatim, except that a gap between/around calls that is only whitespace (the
    newlines a model puts between blocks) is dropped; vLLM returns only the text before
    the first call and drops the rest, which loses text a model writes after its calls.
    """

    name = "hermes"

    def __init__(self) -> None:
        super().__init__()
        self._inside = False
        self._held = ""  # outside a block: a trailing partial "<tool_call>"
        self._body = TagSearch(END)
        self._gap = GapContent()

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        """See the class docstring for what is a call and what is content."""
        calls: list[ToolCall] = []
        gaps: list[str] = []  # the current gap's pieces
        kept: list[str] = []  # finished gaps with visible text
        pos = 0
        while True:
            start = text.find(START, pos)
            if start < 0:
                gaps.append(text[pos:])
                break
            gaps.append(text[pos:start])
            body_start = start + len(START)
            end = text.find(END, body_start)
            terminated = end >= 0
            block_end = end + len(END) if terminated else len(text)
            call = _block_call(text[body_start:end if terminated else len(text)], terminated)
            if call is None:
                gaps.append(text[start:block_end])
            else:
                kept.append("".join(gaps))
                gaps.clear()
                calls.append(call)
            pos = block_end
            if not terminated:
                break
        kept.append("".join(gaps))
        return ExtractedToolCalls(tools_called=bool(calls), tool_calls=calls,
                                  content=join_gaps(kept))

    def feed(self, delta_text: str) -> list[dict[str, Any]]:
        """Content up to any possible `<tool_call>`; a call once its block closes."""
        out = DeltaList()
        text = delta_text
        while text:
            if self._inside:
                found = self._body.feed(text)
                if found is None:
                    break
                body, text = found
                self._inside = False
                self._close_block(body, True, out)
            else:
                window = self._held + text
                start = window.find(START)
                if start < 0:
                    keep = partial_tag_length(window, START)
                    self._gap.add(window[:len(window) - keep], out)
                    self._held = window[len(window) - keep:]
                    break
                self._gap.add(window[:start], out)
                self._held = ""
                self._inside = True
                text = window[start + len(START):]
        return out.deltas

    def finish(self) -> list[dict[str, Any]]:
        """An unterminated last block (a call if its JSON is complete), or the held
        partial tag as content."""
        out = DeltaList()
        if self._inside:
            self._inside = False
            self._close_block(self._body.take(), False, out)
        else:
            self._gap.add(self._held, out)
            self._held = ""
        self._gap.close()
        return out.deltas

    def _close_block(self, body: str, terminated: bool, out: DeltaList) -> None:
        """A finished block: a call delta, or its text as content."""
        call = _block_call(body, terminated)
        if call is None:
            self._gap.add(START + body + (END if terminated else ""), out)
        else:
            self._gap.close()
            out.add(self._call_delta(call))
