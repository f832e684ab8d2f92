"""GLM-4.5 / 4.6 reasoning: `<think>`...`</think>` then the answer, with Qwen3's switch."""

from __future__ import annotations

from pagellm.frontend.reasoning.qwen3 import Qwen3ReasoningParser


class Glm45ReasoningParser(Qwen3ReasoningParser):
    """`--reasoning-parser glm45` (vLLM's name). GLM's chat template has Qwen3's
    `enable_thinking` switch (off: it closes an empty think block in the prompt) and its
    tags, so Qwen3's rule applies. Deviation: vLLM's glm45 parser files an output
    holding no `</think>` as content; here, as vLLM's qwen3 parser does since its fix
    for truncated output, it is reasoning while thinking is on (the model was cut off
    mid-thought), so streamed and whole results agree."""

    name = "glm45"
