"""gpt-oss's tool calls: Harmony messages to `functions.NAME` (harmony.py)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from pagellm.frontend.tool_parsers.base import (
    DeltaList,
    ExtractedToolCalls,
    GapContent,
    ToolCall,
    ToolParser,
    content_or_none,
)
from pagellm.frontend.tool_parsers.harmony import CONTENT, REASONING, HarmonySplitter


class OpenAIToolParser(ToolParser):
    """`--tool-call-parser openai` (vLLM's name, for gpt-oss): each message to
    `functions.NAME` is a call, its JSON body the arguments; final messages and
    preambles are the content, joined by a newline in the order written (vLLM's parser
    shows the final message alone, or the preamble where there is none: here nothing
    the model meant for the user is dropped, and the stream can send a preamble before
    the call it announces). Analysis is left out, unless `with_reasoning`: chat_tools
    sets it when the server's reasoning parser is openai_gptoss, so one reading of the
    output reports `reasoning_content` deltas too (and ExtractedToolCalls.reasoning)."""

    name = "openai"
    special_tokens_in_text: ClassVar[bool] = True

    def __init__(self, tools: Sequence[Mapping[str, Any]] = (), *,
                 with_reasoning: bool = False) -> None:
        super().__init__(tools)
        self.with_reasoning = with_reasoning
        self._splitter = HarmonySplitter()
        self._gap = GapContent()  # whitespace-only content is no content

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        reasoning, content, calls = HarmonySplitter.split(text)
        return ExtractedToolCalls(bool(calls), calls, content_or_none(content or ""),
                                  reasoning if self.with_reasoning else None)

    def feed(self, delta_text: str) -> list[dict[str, Any]]:
        return self._deltas(self._splitter.feed(delta_text))

    def finish(self) -> list[dict[str, Any]]:
        return self._deltas(self._splitter.finish())

    def _deltas(self, events: list[tuple[str, Any]]) -> list[dict[str, Any]]:
        out = DeltaList()
        for kind, payload in events:
            if isinstance(payload, ToolCall):
                out.add(self._call_delta(payload))
            elif kind == CONTENT:
                self._gap.add(payload, out)
            elif kind == REASONING and self.with_reasoning:
                out.add({"reasoning_content": payload})
        return out.deltas
