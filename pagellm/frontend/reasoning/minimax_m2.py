"""MiniMax-M2's reasoning (M2, M2.1): `<think>`...`</think>` then the answer, the model
writing both tags itself (its chat template opens no think block in the prompt), and
its two parsers in vLLM's names:

- `minimax_m2`: the think-tag rule (ThinkTagReasoningParser), the thinking in
  `reasoning_content`;
- `minimax_m2_append_think`: everything is content, `<think>` put back in front: for
  clients that keep the thinking in the assistant's content, as MiniMax recommends
  (its chat template reads earlier turns' thinking back from their content). Tool calls
  are still found in that content; a grammar still waits for `</think>` (the tags in
  REASONING_TAGS are the think tags: the model thinks first either way)."""

from __future__ import annotations

from typing import Any

from pagellm.frontend.reasoning.base import ReasoningParser, ThinkTagReasoningParser
from pagellm.protocol.reasoning import REASONING_TAGS


class MiniMaxM2ReasoningParser(ThinkTagReasoningParser):
    """`--reasoning-parser minimax_m2`: the shared think-tag rule. The family has no
    thinking switch, so `thinking_enabled` is ignored."""

    name = "minimax_m2"


class MiniMaxM2AppendThinkReasoningParser(ReasoningParser):
    """`--reasoning-parser minimax_m2_append_think`: `<think>` and the output, all of it
    content (vLLM's rule: an empty output is `<think>` alone). The reasoning has ended
    when the last think tag the output wrote is `</think>`."""

    name = "minimax_m2_append_think"

    def __init__(self, *, thinking_enabled: bool = True) -> None:
        super().__init__(thinking_enabled=thinking_enabled)
        self.start_tag, self.end_tag = REASONING_TAGS[self.name]
        self._started = False
        self._ended = False
        self._tail = ""  # the output's last characters, where a split tag begins

    @property
    def reasoning_ended(self) -> bool:
        return self._ended

    def extract_reasoning(self, text: str) -> tuple[str | None, str | None]:
        return None, self.start_tag + text

    def feed(self, delta_text: str) -> dict[str, Any] | None:
        window = self._tail + delta_text
        start, end = window.rfind(self.start_tag), window.rfind(self.end_tag)
        if start != end:  # -1 for a tag not there: whichever came last decides
            self._ended = end > start
        self._tail = window[-(len(self.end_tag) - 1):]
        text = delta_text if self._started else self.start_tag + delta_text
        self._started = True
        return {"content": text} if text else None

    def finish(self) -> dict[str, Any] | None:
        if self._started:
            return None
        self._started = True
        return {"content": self.start_tag}
