"""DeepSeek-R1 reasoning: `<think>`...`</think>` then the answer."""

from __future__ import annotations

from pagellm.frontend.reasoning.base import ThinkTagReasoningParser


class DeepSeekR1ReasoningParser(ThinkTagReasoningParser):
    """`--reasoning-parser deepseek_r1`.

    R1 always thinks first, and its later chat templates (R1-0528, the distills) put
    `<think>\\n` in the prompt, so the output often holds only `</think>`: the text before
    it is reasoning, the text after it content, and an output with no `</think>` is all
    reasoning (cut off mid-thought), as vLLM's DeepSeekR1ReasoningParser. The family has
    no thinking switch, so `thinking_enabled` is ignored (vLLM ignores it too). The rest
    is the shared think-tag rule (ThinkTagReasoningParser)."""

    name = "deepseek_r1"
