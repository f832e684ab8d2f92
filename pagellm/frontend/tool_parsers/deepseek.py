"""DeepSeek's tool calls, in its special tokens: a section of call blocks,

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

(DeepSeek-V3, R1: `deepseek_v3`), or with the name first and the arguments bare,

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}
    <｜tool▁call▁end｜><｜tool▁calls▁end｜>      (one line)

(DeepSeek-V3.1 and later: `deepseek_v31`), vLLM's names for the two. The section's
tags are no content; each block is judged on its own (blocks.py). The tokens must reach
the parser as text: decoding keeps them where the tokenizer does not mark them special
(else a request passes skip_special_tokens false)."""

from __future__ import annotations

from pagellm.frontend.tool_parsers.base import ToolCall, arguments_json
from pagellm.frontend.tool_parsers.blocks import BlockToolParser

SEP = "<｜tool▁sep｜>"
# The V3 body: a type ("function"), the separator, the name on its line, the arguments
# in a ```json fence
_FENCE, _FENCE_END = "```json\n", "\n```"


def _call(name: str, arguments: str) -> ToolCall | None:
    name = name.strip()
    args = arguments_json(arguments)
    return ToolCall(name=name, arguments=args) if name and args is not None else None


class _DeepSeekBlocks(BlockToolParser):
    START = "<｜tool▁call▁begin｜>"
    END = "<｜tool▁call▁end｜>"
    WRAPPERS = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")


class DeepSeekV3ToolParser(_DeepSeekBlocks):
    """`--tool-call-parser deepseek_v3`: TYPE<｜tool▁sep｜>NAME, then the arguments (a
    JSON object) in a ```json fence."""

    name = "deepseek_v3"

    def parse_body(self, body: str) -> ToolCall | None:
        """TYPE (on the first line)<｜tool▁sep｜>NAME, a newline, the fence: read with
        partitions, in linear time (a regex's lazy type before the separator took
        minutes on a body of 150k spaces)."""
        kind, sep, rest = body.partition(SEP)
        name, newline, rest = rest.partition("\n")
        if not sep or "\n" in kind.lstrip() or not newline or not name \
                or not rest.startswith(_FENCE):
            return None
        fenced = rest[len(_FENCE):].rstrip()
        if not fenced.endswith(_FENCE_END):
            return None
        return _call(name, fenced[:-len(_FENCE_END)])


class DeepSeekV31ToolParser(_DeepSeekBlocks):
    """`--tool-call-parser deepseek_v31`: NAME<｜tool▁sep｜>ARGUMENTS (a JSON object)."""

    name = "deepseek_v31"

    def parse_body(self, body: str) -> ToolCall | None:
        name, sep, arguments = body.partition(SEP)
        return _call(name, arguments) if sep and "\n" not in name.strip() else None
