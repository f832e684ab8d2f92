"""Splitting a model's reasoning from its answer: the interface the server drives per
choice, and the think-tag parser the families in pagellm/protocol/reasoning.py share.

The tags come from REASONING_TAGS, the same table the engine core reads to hold back a
request's grammar until the end tag, so the two sides cannot disagree on where the
reasoning stops."""

from __future__ import annotations

import abc
from typing import Any, ClassVar

from pagellm.protocol.reasoning import REASONING_TAGS


class ReasoningParser(abc.ABC):
    """Splits one choice's output into `reasoning_content` and `content`. One instance
    per generated choice: streaming keeps state between deltas.

    `thinking_enabled` is the request's chat_template_kwargs `enable_thinking` (default
    True, as the templates default to it); parsers whose family has no such switch
    ignore it.

    Streaming contract: `feed(delta_text)` returns a delta dict with a
    `reasoning_content` and/or a `content` key (non-empty strings), or None when nothing
    is certain yet (text that may be the start of a tag is held back); `finish()`
    flushes at the end of the stream. The pieces, joined per key, equal
    `extract_reasoning(full_text)` (with None as "")."""

    # The format's tags are special tokens: the server decodes a request's output with
    # them (skip_special_tokens false), or the parser would never see them.
    special_tokens_in_text: ClassVar[bool] = False

    def __init__(self, *, thinking_enabled: bool = True) -> None:
        self.thinking_enabled = thinking_enabled

    @abc.abstractmethod
    def extract_reasoning(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a whole output, None for either when empty;
        touches no streaming state."""

    @abc.abstractmethod
    def feed(self, delta_text: str) -> dict[str, Any] | None:
        """The delta that the next piece of output makes certain, or None."""

    @abc.abstractmethod
    def finish(self) -> dict[str, Any] | None:
        """What is still held back when the output has ended, or None."""

    @property
    @abc.abstractmethod
    def reasoning_ended(self) -> bool:
        """Whether the output fed so far has left the reasoning (what follows is the
        answer: the point where a tool parser or a grammar takes over)."""


def _partial_tag_length(text: str, tag: str) -> int:
    """How many trailing characters of `text` are a proper prefix of `tag` (to hold
    back until the next delta shows whether the tag completes)."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


def _delta(reasoning: str, content: str) -> dict[str, Any] | None:
    """A delta with the non-empty parts, or None."""
    delta = {}
    if reasoning:
        delta["reasoning_content"] = reasoning
    if content:
        delta["content"] = content
    return delta or None


class ThinkTagReasoningParser(ReasoningParser):
    """Reasoning between a start and an end tag (`<think>`...`</think>`), the model
    thinking first. The text before the first end tag is reasoning, the text after it
    content (verbatim: the newlines after `</think>` stay, as in vLLM); the first start
    tag before the end tag is removed. The start tag may be missing altogether: newer
    chat templates put it in the prompt. With no end tag the whole output is reasoning
    (the model was cut off, or stopped, mid-thought).

    Deviations from vLLM's BaseThinkingReasoningParser, which removes the first start
    tag found anywhere and drops the text before it: here only a start tag before the
    end tag is removed and text before it stays reasoning, so nothing the model wrote is
    lost and `<think>` mentioned in the answer stays in the answer; an empty reasoning is
    None rather than "". Both modes follow the same rule, which vLLM's streaming and
    non-streaming paths do not quite share."""

    name: ClassVar[str]

    def __init__(self, *, thinking_enabled: bool = True) -> None:
        super().__init__(thinking_enabled=thinking_enabled)
        self.start_tag, self.end_tag = REASONING_TAGS[self.name]
        self._ended = False
        self._start_seen = False
        self._held = ""  # a trailing partial tag, at most a tag's length

    @property
    def reasoning_ended(self) -> bool:
        """True once the end tag has been fed."""
        return self._ended

    def extract_reasoning(self, text: str) -> tuple[str | None, str | None]:
        """See the class docstring."""
        end = text.find(self.end_tag)
        reasoning = text if end < 0 else text[:end]
        start = reasoning.find(self.start_tag)
        if start >= 0:
            reasoning = reasoning[:start] + reasoning[start + len(self.start_tag):]
        content = None if end < 0 else text[end + len(self.end_tag):]
        return reasoning or None, content or None

    def feed(self, delta_text: str) -> dict[str, Any] | None:
        """Reasoning up to any possible tag; content once the end tag has passed."""
        if self._ended:
            return _delta("", delta_text)
        text = self._held + delta_text
        self._held = ""
        reasoning: list[str] = []
        while True:
            end = text.find(self.end_tag)
            start = -1 if self._start_seen else text.find(self.start_tag)
            # "</think>" contains "<think>" one character in: the end tag wins a tie.
            if start >= 0 and (end < 0 or start < end):
                reasoning.append(text[:start])
                text = text[start + len(self.start_tag):]
                self._start_seen = True
                continue
            if end >= 0:
                reasoning.append(text[:end])
                self._ended = True
                return _delta("".join(reasoning), text[end + len(self.end_tag):])
            keep = _partial_tag_length(text, self.end_tag)
            if not self._start_seen:
                keep = max(keep, _partial_tag_length(text, self.start_tag))
            reasoning.append(text[:len(text) - keep])
            self._held = text[len(text) - keep:]
            return _delta("".join(reasoning), "")

    def finish(self) -> dict[str, Any] | None:
        """A held partial tag was reasoning after all."""
        held, self._held = self._held, ""
        return None if self._ended else _delta(held, "")
