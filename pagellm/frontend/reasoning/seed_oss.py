"""Seed-OSS reasoning: `<seed:think>`...`</seed:think>` then the answer."""

from __future__ import annotations

from pagellm.frontend.reasoning.base import ThinkTagReasoningParser


class SeedOssReasoningParser(ThinkTagReasoningParser):
    """`--reasoning-parser seed_oss` (vLLM's name): the shared think-tag rule with
    Seed's tags. Its chat template's `thinking_budget` only shortens the thinking (the
    model still writes the block, and its budget reflections inside it are reasoning),
    so `thinking_enabled` is ignored."""

    name = "seed_oss"
