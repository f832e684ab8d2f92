"""The reasoning parsers a server can name (`--reasoning-parser`), and the tags that
delimit a model's reasoning. One table for both sides: the frontend splits reasoning
from content with it, and the engine core holds back a request's grammar until the end
tag has been generated (vLLM's `enable_in_reasoning=False`: the constraint applies to the
answer, not the thinking)."""

from __future__ import annotations

# name -> (start tag, end tag), as the model's tokenizer spells them (one token each in
# the families that use them).
REASONING_TAGS: dict[str, tuple[str, str]] = {
    "qwen3": ("<think>", "</think>"),
    "deepseek_r1": ("<think>", "</think>"),
    "glm45": ("<think>", "</think>"),
}


def check_reasoning_parser(name: str | None) -> None:
    """None, or a parser named in REASONING_TAGS (ValueError naming the choices)."""
    if name is not None and name not in REASONING_TAGS:
        raise ValueError(f"reasoning_parser must be one of {sorted(REASONING_TAGS)}, "
                         f"got {name!r}")
