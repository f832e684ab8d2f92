"""Tool calls as tagged blocks, `START body END`, possibly several, possibly among text
(Hermes' `<tool_call>...</tool_call>`, DeepSeek's `<｜tool▁call▁begin｜>...`): the
scanning, content and streaming every such format shares; a format says how a block's
body spells a call (`parse_body`) and which wrapper tags around its blocks are no
content (DeepSeek's `<｜tool▁calls▁begin｜>` / `<｜tool▁calls▁end｜>`)."""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from pagellm.frontend.tool_parsers.base import (
    DeltaList,
    ExtractedToolCalls,
    GapContent,
    TagSearch,
    ToolCall,
    ToolParser,
    join_gaps,
    partial_tag_length,
)


class BlockToolParser(ToolParser):
    """Each block is judged on its own: one whose body spells a call is a call; any
    other block stays in the content, tags and all (vLLM instead drops every call and
    returns the whole output as content when one block fails: judging blocks one by one
    lets a call be streamed as soon as its block closes, which all-or-nothing could not
    without holding back everything after the first tag until the end). An unterminated
    last block (the model stopped at EOS, or was cut off, before END) counts when its
    body is complete; a partial END at its end is ignored. Content is the text outside
    the blocks, verbatim but for the wrapper tags, except that a gap between/around calls
    that is only whitespace (the newlines a model puts between blocks) is dropped; vLLM
    returns only the text before the first call and drops the rest, which loses text a
    model writes after its calls."""

    START: ClassVar[str]
    END: ClassVar[str]
    WRAPPERS: ClassVar[tuple[str, ...]] = ()  # tags outside the blocks, dropped

    def __init__(self, tools: Sequence[Mapping[str, Any]] = ()) -> None:
        super().__init__(tools)
        self._inside = False
        self._held = ""  # outside a block: a trailing partial START or wrapper tag
        self._body = TagSearch(self.END)
        self._gap = GapContent()

    @abc.abstractmethod
    def parse_body(self, body: str) -> ToolCall | None:
        """The call a block's body (between START and END) spells, or None."""

    def parse_calls(self, body: str) -> list[ToolCall] | None:
        """The calls a block's body spells, or None: one (`parse_body`), unless the
        format puts several in a block (MiniMax-M2's invokes)."""
        call = self.parse_body(body)
        return None if call is None else [call]

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        """See the class docstring for what is a call and what is content."""
        calls: list[ToolCall] = []
        gaps: list[str] = []  # the current gap's pieces
        kept: list[str] = []  # finished gaps with visible text
        ahead: dict[str, int] = {}  # each tag's next position found so far (-1: none)
        pos = 0
        while True:
            found = self._next_tag(text, pos, ahead)
            if found is None:
                gaps.append(text[pos:])
                break
            start, tag = found
            gaps.append(text[pos:start])
            if tag != self.START:  # a wrapper: no content
                pos = start + len(tag)
                continue
            body_start = start + len(self.START)
            end = text.find(self.END, body_start)
            terminated = end >= 0
            block_end = end + len(self.END) if terminated else len(text)
            block = self._block_calls(text[body_start:end if terminated else len(text)],
                                      terminated)
            if block is None:
                gaps.append(text[start:block_end])
            else:
                kept.append("".join(gaps))
                gaps.clear()
                calls.extend(block)
            pos = block_end
            if not terminated:
                break
        kept.append("".join(gaps))
        return ExtractedToolCalls(tools_called=bool(calls), tool_calls=calls,
                                  content=join_gaps(kept))

    def feed(self, delta_text: str) -> list[dict[str, Any]]:
        """Content up to any possible START or wrapper tag; a call once its block
        closes."""
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
                continue
            window = self._held + text
            tag_at = self._next_tag(window, 0)
            if tag_at is None:
                keep = max(partial_tag_length(window, tag)
                           for tag in (self.START, *self.WRAPPERS))
                self._gap.add(window[:len(window) - keep], out)
                self._held = window[len(window) - keep:]
                break
            start, tag = tag_at
            self._gap.add(window[:start], out)
            self._held = ""
            self._inside = tag == self.START
            text = window[start + len(tag):]
        return out.deltas

    def finish(self) -> list[dict[str, Any]]:
        """An unterminated last block (a call if its body is complete), or the held
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

    def _next_tag(self, text: str, pos: int, ahead: dict[str, int] | None = None
                  ) -> tuple[int, str] | None:
        """The first START or wrapper tag in `text` from `pos`: (where, which).
        `ahead` remembers where each tag was found (or that it is absent) across calls
        with growing `pos`, so a text of many wrapper tags is searched once per tag
        occurrence, not once per tag per occurrence of another."""
        ahead = {} if ahead is None else ahead
        best: tuple[int, str] | None = None
        for tag in (self.START, *self.WRAPPERS):
            at = ahead.get(tag, pos - 1)
            if 0 <= at < pos or (tag not in ahead):
                at = ahead[tag] = text.find(tag, pos)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, tag)
        return best

    def _block_calls(self, body: str, terminated: bool) -> list[ToolCall] | None:
        if not terminated:
            body = body[:len(body) - partial_tag_length(body, self.END)]
        return self.parse_calls(body)

    def _close_block(self, body: str, terminated: bool, out: DeltaList) -> None:
        """A finished block: its calls' deltas, or its text as content."""
        calls = self._block_calls(body, terminated)
        if calls is None:
            self._gap.add(self.START + body + (self.END if terminated else ""), out)
        else:
            self._gap.close()
            for call in calls:
                out.add(self._call_delta(call))
