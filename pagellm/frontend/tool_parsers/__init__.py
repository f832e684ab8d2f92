"""Tool-call parsers by the name a server is started with (`--tool-call-parser`, as
vLLM's): each turns a model's raw output into OpenAI `tool_calls` and the content
around them, whole or streamed, in one model family's format."""

from __future__ import annotations

from pagellm.frontend.tool_parsers.base import ExtractedToolCalls, ToolCall, ToolParser
from pagellm.frontend.tool_parsers.deepseek import DeepSeekV3ToolParser, DeepSeekV31ToolParser
from pagellm.frontend.tool_parsers.glm45 import Glm45ToolParser, Glm47ToolParser
from pagellm.frontend.tool_parsers.hermes import Ernie45ToolParser, HermesToolParser
from pagellm.frontend.tool_parsers.llama3_json import Llama3JsonToolParser
from pagellm.frontend.tool_parsers.minimax_m2 import MiniMaxM2ToolParser
from pagellm.frontend.tool_parsers.mistral import MistralToolParser
from pagellm.frontend.tool_parsers.olmo3 import Olmo3ToolParser
from pagellm.frontend.tool_parsers.openai import OpenAIToolParser
from pagellm.frontend.tool_parsers.pythonic import PythonicToolParser
from pagellm.frontend.tool_parsers.qwen3_coder import (
    Qwen3CoderToolParser,
    Qwen3XmlToolParser,
    SeedOssToolParser,
)

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "deepseek_v3": DeepSeekV3ToolParser,
    "deepseek_v31": DeepSeekV31ToolParser,
    "ernie45": Ernie45ToolParser,
    "glm45": Glm45ToolParser,
    "glm47": Glm47ToolParser,
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "minimax_m2": MiniMaxM2ToolParser,
    "mistral": MistralToolParser,
    "olmo3": Olmo3ToolParser,
    "openai": OpenAIToolParser,
    "pythonic": PythonicToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
    "qwen3_xml": Qwen3XmlToolParser,
    "seed_oss": SeedOssToolParser,
}


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class a name selects (one instance per choice); ValueError naming the
    choices, so a typo in a server flag fails at startup rather than per request."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"tool_call_parser must be one of {sorted(TOOL_PARSERS)}, "
                         f"got {name!r}") from None


__all__ = ["TOOL_PARSERS", "DeepSeekV3ToolParser", "DeepSeekV31ToolParser",
           "Ernie45ToolParser", "ExtractedToolCalls", "Glm45ToolParser", "Glm47ToolParser",
           "HermesToolParser",
           "Llama3JsonToolParser", "MiniMaxM2ToolParser", "MistralToolParser",
           "Olmo3ToolParser", "OpenAIToolParser", "PythonicToolParser", "Qwen3CoderToolParser",
           "Qwen3XmlToolParser", "SeedOssToolParser", "ToolCall", "ToolParser",
           "get_tool_parser"]
