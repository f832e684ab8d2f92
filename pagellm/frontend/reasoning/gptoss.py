"""gpt-oss reasoning: the Harmony format's analysis channel (tool_parsers/harmony.py)."""

from __future__ import annotations

from typing import Any, ClassVar

from pagellm.frontend.reasoning.base import ReasoningParser, _delta
from pagellm.frontend.tool_parsers.harmony import CONTENT, REASONING, HarmonySplitter


class GptOssReasoningParser(ReasoningParser):
    """`--reasoning-parser openai_gptoss` (vLLM's name): analysis messages are
    `reasoning_content`, final messages and preambles (commentary to no one) are
    `content`. A call to a function is neither here (as in vLLM's parse_chat_output);
    with `--tool-call-parser openai` as well, chat_tools hands the whole output to that
    parser, which reports reasoning, content and calls from one reading. gpt-oss has no
    switch to turn thinking off (its template's `reasoning_effort` only shortens it), so
    `thinking_enabled` is ignored."""

    name = "openai_gptoss"
    special_tokens_in_text: ClassVar[bool] = True

    def __init__(self, *, thinking_enabled: bool = True) -> None:
        super().__init__(thinking_enabled=thinking_enabled)
        self._splitter = HarmonySplitter()

    @property
    def reasoning_ended(self) -> bool:
        """True once a final-channel message has begun."""
        return self._splitter.final_begun

    def extract_reasoning(self, text: str) -> tuple[str | None, str | None]:
        reasoning, content, _ = HarmonySplitter.split(text)
        return reasoning, content

    def feed(self, delta_text: str) -> dict[str, Any] | None:
        return _joined(self._splitter.feed(delta_text))

    def finish(self) -> dict[str, Any] | None:
        return _joined(self._splitter.finish())


def _joined(events: list[tuple[str, Any]]) -> dict[str, Any] | None:
    """The reasoning and the content text of some events as one delta (calls left out)."""
    return _delta("".join(text for kind, text in events if kind == REASONING),
                  "".join(text for kind, text in events if kind == CONTENT))
