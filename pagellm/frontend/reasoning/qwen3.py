"""Qwen3 (and QwQ, Qwen3.5) reasoning: `<think>`...`</think>` then the answer."""

from __future__ import annotations

from typing import Any

from pagellm.frontend.reasoning.base import ThinkTagReasoningParser


class Qwen3ReasoningParser(ThinkTagReasoningParser):
    """`--reasoning-parser qwen3`.

    vLLM's current rule (its Qwen3ReasoningParser since the fix for truncated output,
    vllm-project/vllm#35230): a `<think>` in the output is stripped; the text before
    `</think>` is reasoning, the text after it content; with no `</think>` the whole
    output is reasoning while thinking is enabled (the default: the chat template put
    `<think>` in the prompt and the model was cut off mid-thought), and the whole output
    is content when the request disabled thinking (`chat_template_kwargs:
    {"enable_thinking": false}`: the template closed an empty think block in the prompt).
    (Older vLLM required both tags and otherwise returned everything as content; that
    misfiled every answer of the templates that put `<think>` in the prompt.)

    Deviations: with thinking disabled the output is content whatever it holds, in both
    modes; vLLM's non-streaming path would still split at a stray `</think>`, but its
    streaming path passes the deltas through untouched (the serving layer sees the
    reasoning ended in the prompt), and one rule for both is what lets streamed and
    whole results agree. vLLM (for Qwen3.5) also ends the reasoning at a `<tool_call>`
    followed by `<function=` (qwen3_coder's XML calls) when `</think>` is missing;
    pagellm has no parser for that call format, so that is not done here. The rest is
    the shared think-tag rule (ThinkTagReasoningParser)."""

    name = "qwen3"

    @property
    def reasoning_ended(self) -> bool:
        """True once `</think>` has been fed, and from the start with thinking off."""
        return not self.thinking_enabled or super().reasoning_ended

    def extract_reasoning(self, text: str) -> tuple[str | None, str | None]:
        """See the class docstring."""
        if not self.thinking_enabled:
            return None, text or None
        return super().extract_reasoning(text)

    def feed(self, delta_text: str) -> dict[str, Any] | None:
        """See ThinkTagReasoningParser.feed; all content with thinking off."""
        if not self.thinking_enabled:
            return {"content": delta_text} if delta_text else None
        return super().feed(delta_text)
