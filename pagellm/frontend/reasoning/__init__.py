"""Reasoning parsers by the name a server is started with (`--reasoning-parser`, as
vLLM's): each splits a model's output into `reasoning_content` and `content`, whole or
streamed. The names are REASONING_TAGS's (pagellm/protocol/reasoning.py), the table the
engine core also reads, so a name the server accepts is one both sides know."""

from __future__ import annotations

from pagellm.frontend.reasoning.base import ReasoningParser, ThinkTagReasoningParser
from pagellm.frontend.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from pagellm.frontend.reasoning.ernie45 import Ernie45ReasoningParser
from pagellm.frontend.reasoning.glm45 import Glm45ReasoningParser
from pagellm.frontend.reasoning.gptoss import GptOssReasoningParser
from pagellm.frontend.reasoning.minimax_m2 import (
    MiniMaxM2AppendThinkReasoningParser,
    MiniMaxM2ReasoningParser,
)
from pagellm.frontend.reasoning.qwen3 import Qwen3ReasoningParser
from pagellm.frontend.reasoning.seed_oss import SeedOssReasoningParser
from pagellm.protocol.reasoning import check_reasoning_parser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "qwen3": Qwen3ReasoningParser,
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "glm45": Glm45ReasoningParser,
    "openai_gptoss": GptOssReasoningParser,
    "seed_oss": SeedOssReasoningParser,
    "minimax_m2": MiniMaxM2ReasoningParser,
    "minimax_m2_append_think": MiniMaxM2AppendThinkReasoningParser,
    "ernie45": Ernie45ReasoningParser,
}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class a name selects (one instance per choice, constructed with the
    request's `thinking_enabled`); ValueError naming the choices otherwise."""
    check_reasoning_parser(name)
    try:
        return REASONING_PARSERS[name]
    except KeyError:  # a tag table entry without a parser: a bug, named as such
        raise ValueError(f"reasoning_parser {name!r} has tags but no parser; parsers: "
                         f"{sorted(REASONING_PARSERS)}") from None


__all__ = ["REASONING_PARSERS", "DeepSeekR1ReasoningParser", "Ernie45ReasoningParser",
           "Glm45ReasoningParser",
           "GptOssReasoningParser", "MiniMaxM2AppendThinkReasoningParser",
           "MiniMaxM2ReasoningParser", "Qwen3ReasoningParser", "ReasoningParser",
           "SeedOssReasoningParser", "ThinkTagReasoningParser", "get_reasoning_parser"]
