"""ERNIE 4.5 reasoning: `<think>`...`</think>`, then the answer, wrapped in
`<response>`...`</response>` by the thinking models."""

from __future__ import annotations

from typing import Any

from pagellm.frontend.reasoning.base import (
    ThinkTagReasoningParser,
    _delta,
    _partial_tag_length,
)

RESPONSE_START, RESPONSE_END = "<response>", "</response>"


def unwrap_response(answer: str) -> str:
    """The answer after `</think>` without its wrapping: leading newlines dropped; where
    it opens with `<response>`, that tag dropped and the answer ends at the first
    `</response>` (what follows, a newline, dropped too)."""
    answer = answer.lstrip("\n")
    if not answer.startswith(RESPONSE_START):
        return answer
    inner = answer[len(RESPONSE_START):]
    end = inner.find(RESPONSE_END)
    return inner if end < 0 else inner[:end]


class _StreamedAnswer:
    """`unwrap_response` over an answer fed in pieces: what is certain of it so far,
    holding back leading newlines and a possible tag."""

    def __init__(self) -> None:
        self.phase = "lead"  # lead (undecided) | plain | inside (wrapped) | done
        self.held = ""

    def feed(self, text: str) -> str:
        if self.phase == "done":
            return ""
        text, self.held = self.held + text, ""
        if self.phase == "lead":
            stripped = text.lstrip("\n")
            if len(stripped) < len(RESPONSE_START) and RESPONSE_START.startswith(stripped):
                self.held = text  # only newlines, or a prefix of the tag: undecided
                return ""
            if not stripped.startswith(RESPONSE_START):
                self.phase = "plain"
                return stripped
            self.phase, text = "inside", stripped[len(RESPONSE_START):]
        if self.phase == "plain":
            return text
        end = text.find(RESPONSE_END)
        if end >= 0:
            self.phase = "done"
            return text[:end]
        keep = _partial_tag_length(text, RESPONSE_END)
        self.held = text[len(text) - keep:]
        return text[:len(text) - keep]

    def finish(self) -> str:
        held, self.held = self.held, ""
        if self.phase == "lead":
            return held.lstrip("\n")  # a tag's prefix that never completed is answer
        return held if self.phase == "inside" else ""


class Ernie45ReasoningParser(ThinkTagReasoningParser):
    """`--reasoning-parser ernie45` (vLLM's name): ERNIE 4.5's thinking models write
    `reasoning</think>\\n\\n<response>\\nanswer\\n</response>\\n` (or the answer bare after
    the end tag). The think-tag rule, then the content unwrapped (`unwrap_response`).
    vLLM's parser strips the tags per streamed delta and its two paths differ on the
    newlines; here both follow the one rule."""

    name = "ernie45"

    def __init__(self, *, thinking_enabled: bool = True) -> None:
        super().__init__(thinking_enabled=thinking_enabled)
        self._answer = _StreamedAnswer()

    def extract_reasoning(self, text: str) -> tuple[str | None, str | None]:
        reasoning, content = super().extract_reasoning(text)
        return reasoning, unwrap_response(content or "") or None

    def feed(self, delta_text: str) -> dict[str, Any] | None:
        delta = super().feed(delta_text)
        if delta is None or "content" not in delta:
            return delta
        return _delta(delta.get("reasoning_content", ""),
                      self._answer.feed(delta["content"]))

    def finish(self) -> dict[str, Any] | None:
        delta = super().finish() or {}
        return _delta(delta.get("reasoning_content", ""), self._answer.finish())
