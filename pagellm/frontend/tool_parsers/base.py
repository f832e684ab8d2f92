"""What every tool-call parser shares: the call it finds, the result of parsing a whole
output, the interface the server drives per choice, and the small pieces of streaming
bookkeeping each format needs (held-back text, whitespace between calls, incremental
searches that never rescan what they have already looked at).

A parser reads model output, which may be anything up to max_model_len tokens long: it
never raises on it (text that is no valid call is content), and its streaming side does
work proportional to the text fed, not to the text fed so far on every delta."""

from __future__ import annotations

import abc
import ast
import json
import math
import re
import uuid
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar


def make_tool_call_id() -> str:
    """A fresh id in the shape OpenAI's clients expect (vLLM's `chatcmpl-tool-` prefix),
    random so that two calls in one conversation never collide."""
    return "chatcmpl-tool-" + uuid.uuid4().hex[:24]


@dataclass
class ToolCall:
    """One function call the model made: `arguments` is the JSON text of an object, as
    OpenAI's API carries it (clients parse it themselves)."""

    name: str
    arguments: str
    id: str = field(default_factory=make_tool_call_id)

    def to_openai(self) -> dict[str, Any]:
        """The call as a chat completion message's `tool_calls` entry."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ExtractedToolCalls:
    """A whole output split into its calls and the text around them. `content` is None
    when that text is empty or only whitespace, so a pure call answers with
    `content: null` as OpenAI's does."""

    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None
    reasoning: str | None = None  # a format that also carries reasoning (Harmony)


class ToolParser(abc.ABC):
    """Finds a model's tool calls in its output. One instance per generated choice: the
    streaming methods keep state between deltas.

    Streaming contract: `feed(delta_text)` returns zero or more OpenAI chat-chunk
    `delta` dicts, `{"content": ...}` or `{"tool_calls": [{"index", "id", "type",
    "function": {"name", "arguments"}}]}` (each call whole, once it is complete, with
    indices 0, 1, ... per choice); `finish()` returns the rest at the end of the stream.
    Text that could still turn into a call is held back, never sent as content; the
    content sent, joined, is `extract_tool_calls(full_text).content` (or "" for None),
    and the calls sent are the calls extracted (ids apart)."""

    name: str = ""
    # The format's tags are special tokens: the server decodes a request's output with
    # them (skip_special_tokens false), or the parser would never see them.
    special_tokens_in_text: ClassVar[bool] = False

    def __init__(self, tools: Sequence[Mapping[str, Any]] = ()) -> None:
        """`tools`: the request's (OpenAI's `{"type": "function", "function": {...}}`),
        for a format whose arguments are typed by their schemas (GLM-4.5's)."""
        self.tools = tools
        self._next_index = 0

    @abc.abstractmethod
    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        """The calls and the content of a whole output; touches no streaming state, so
        it is safe to call on a parser that is also streaming."""

    @abc.abstractmethod
    def feed(self, delta_text: str) -> list[dict[str, Any]]:
        """The deltas that the next piece of output makes certain."""

    @abc.abstractmethod
    def finish(self) -> list[dict[str, Any]]:
        """The deltas still held back when the output has ended."""

    def declared(self, tool: str, key: str) -> Any:
        """The schema the request's tool `tool` gives its parameter `key` (its entry in
        `parameters.properties`), or None where the tools do not declare it: for the
        formats whose values are text, typed by their schemas (GLM's, Qwen3-Coder's)."""
        for spec in self.tools:
            function = spec.get("function") or {}
            if function.get("name") == tool:
                properties = (function.get("parameters") or {}).get("properties") or {}
                return properties.get(key) if isinstance(properties, dict) else None
        return None

    def _call_delta(self, call: ToolCall) -> dict[str, Any]:
        """A streamed call's delta, numbered in the order the choice made its calls."""
        index = self._next_index
        self._next_index += 1
        return {"tool_calls": [{"index": index, **call.to_openai()}]}


def parse_call_object(text: str, argument_keys: Iterable[str]) -> ToolCall | None:
    """A JSON object `{"name": str, <argument key>: {...}}` as a call, else None.
    The first of `argument_keys` present names the arguments, which must be an object:
    anything else (an array, a double-encoded string, NaN/Infinity that JSON does not
    allow) is no call, so the server never sends arguments a client cannot parse."""
    try:
        obj = json.loads(text, parse_constant=reject_json_constant)
    except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
        return None
    return call_of_object(obj, argument_keys)


def call_of_object(obj: Any, argument_keys: Iterable[str]) -> ToolCall | None:
    """`parse_call_object` of an object already decoded (Mistral's array holds several):
    a dict with a non-empty string `name` and an object under the first of
    `argument_keys` present, else None."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    for key in argument_keys:
        if key in obj:
            arguments = obj[key]
            break
    else:
        return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False))


def arguments_json(text: str) -> str | None:
    """A JSON object's text as a call's arguments (re-serialized: json.dumps, unicode
    kept), or None for anything else: not JSON, not an object, NaN/Infinity."""
    try:
        obj = json.loads(text, parse_constant=reject_json_constant)
    except (ValueError, RecursionError):
        return None
    return json.dumps(obj, ensure_ascii=False) if isinstance(obj, dict) else None


def reject_json_constant(constant: str) -> Any:
    """json's hook for NaN/Infinity/-Infinity: Python accepts them, JSON does not."""
    raise ValueError(f"{constant} is not JSON")


def call_with(name: str, arguments: dict[str, Any]) -> ToolCall | None:
    """A call of `name` with `arguments` read from a model's text, or None where JSON
    cannot carry a value they hold (a set, bytes, NaN from a Python literal)."""
    try:
        return ToolCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False,
                                                        allow_nan=False))
    except (TypeError, ValueError):
        return None


def read_int(text: str) -> int | None:
    """`text` as an integer (Python's int(): spaces and underscores allowed), or None."""
    try:
        return int(text)
    except ValueError:
        return None


def read_number(text: str) -> int | float | None:
    """`text` as a number, an integral one as an int ("2.0" is 2), or None where it is
    no number or not finite (JSON has no NaN or infinity)."""
    try:
        number = float(text)
    except ValueError:
        return None
    if not math.isfinite(number):
        return None
    return int(number) if number.is_integer() else number


def python_literal(text: str) -> Any:
    """`text` as a Python literal (a model writes True, None, 'quoted' at times), else
    the text itself; never raises, whatever the model wrote."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SyntaxWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            return ast.literal_eval(text)
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
        return text


def json_or_literal(text: str) -> Any:
    """`text` as JSON, else as a Python literal, else the text itself."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return python_literal(text)


_SPACE = re.compile(r"\s*")


def tagged(text: str, pos: int, open_tag: str, close_tag: str) -> tuple[str, int] | None:
    """After any whitespace from `pos`, `open_tag` ... `close_tag`: (the text between,
    the position after close_tag), or None when the text there is not that. One find
    per tag, so a body read tag by tag is read in linear time whatever it holds (a
    regex finding each opening tag's close anew is quadratic in a run of opening
    tags)."""
    start = skip_space(text, pos)
    if not text.startswith(open_tag, start):
        return None
    inner = start + len(open_tag)
    end = text.find(close_tag, inner)
    return None if end < 0 else (text[inner:end], end + len(close_tag))


def tagged_parameters(text: str, open_tag: str, close_tag: str,
                      key_of: Callable[[str], str | None],
                      value_of: Callable[[str, str], Any]) -> dict[str, Any] | None:
    """The parameters `text` holds as `open_tag KEY>VALUE close_tag`, whitespace
    between them and nothing else (Qwen3-Coder's `<parameter=KEY>`, MiniMax-M2's
    `<parameter name="KEY">`): {key_of(KEY): value_of(key, VALUE)}, or None when the
    text holds anything else, a KEY that key_of refuses (None), or a key twice."""
    arguments: dict[str, Any] = {}
    pos = 0
    while not only_space(text, pos):
        parameter = tagged(text, pos, open_tag, close_tag)
        if parameter is None:
            return None
        head, close, value = parameter[0].partition(">")
        key = key_of(head) if close else None
        if key is None or key in arguments:
            return None
        arguments[key] = value_of(key, value)
        pos = parameter[1]
    return arguments


def skip_space(text: str, pos: int) -> int:
    """The first position from `pos` that is not whitespace (len(text) if none): one
    regex step, never a copy of the rest (as text[pos:].lstrip() would be)."""
    return _SPACE.match(text, pos).end()  # type: ignore[union-attr]


def only_space(text: str, pos: int) -> bool:
    """Whether `text` from `pos` is nothing but whitespace."""
    return skip_space(text, pos) == len(text)


def content_or_none(text: str) -> str | None:
    """Content as ExtractedToolCalls carries it: None when nothing but whitespace."""
    return text if text.strip() else None


def partial_tag_length(text: str, tag: str) -> int:
    """How many trailing characters of `text` are a proper prefix of `tag`: the text
    to hold back because the next delta may complete the tag. At most len(tag) - 1
    comparisons of at most len(tag) characters, whatever the length of `text`."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


class DeltaList:
    """The deltas of one feed/finish, in order, with adjacent content joined so a client
    gets one content delta per step rather than a fragment per internal stage."""

    def __init__(self) -> None:
        self.deltas: list[dict[str, Any]] = []

    def content(self, text: str) -> None:
        """Appends content (nothing for empty text)."""
        if not text:
            return
        if self.deltas and "content" in self.deltas[-1]:
            self.deltas[-1]["content"] += text
        else:
            self.deltas.append({"content": text})

    def add(self, delta: dict[str, Any]) -> None:
        """Appends a tool-call delta."""
        self.deltas.append(delta)


class GapContent:
    """Streaming side of "text between calls that is only whitespace is no content":
    whitespace is held until the gap shows a visible character (then all of it is sent,
    verbatim) or a call closes the gap (then it is dropped). A gap is the text before
    the first call, between two calls, or after the last."""

    def __init__(self) -> None:
        self._pending: list[str] = []
        self._visible = False

    def add(self, text: str, out: DeltaList) -> None:
        """More text of the current gap."""
        if not text:
            return
        if self._visible:
            out.content(text)
        elif text.isspace():
            self._pending.append(text)
        else:
            self._pending.append(text)
            out.content("".join(self._pending))
            self._pending.clear()
            self._visible = True

    def close(self) -> None:
        """A call (or the end of the output) ends the gap; whitespace still held is
        dropped."""
        self._pending.clear()
        self._visible = False


def join_gaps(gaps: Iterable[str]) -> str | None:
    """Non-streaming side of GapContent: the gaps with a visible character, joined."""
    return content_or_none("".join(gap for gap in gaps if gap.strip()))


class TagSearch:
    """Accumulates text until `tag` appears in it, looking at each character a bounded
    number of times however the text is split into deltas (the held text itself is kept
    as a list of pieces and joined once, when the tag is found or the stream ends)."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self._pieces: list[str] = []
        self._tail = ""  # the last len(tag) - 1 characters, where a split tag starts

    def feed(self, text: str) -> tuple[str, str] | None:
        """Adds text; once the tag has appeared, (text before it, text after it) with
        the search reset, else None."""
        window = self._tail + text
        found = window.find(self.tag)
        if found < 0:
            self._pieces.append(text)
            self._tail = window[-(len(self.tag) - 1):] if len(self.tag) > 1 else ""
            return None
        before_in_text = found - len(self._tail)  # may be negative: tag began earlier
        held = "".join(self._pieces)
        self.reset()
        if before_in_text >= 0:
            return held + text[:before_in_text], text[before_in_text + len(self.tag):]
        return held[:len(held) + before_in_text], text[before_in_text + len(self.tag):]

    def take(self) -> str:
        """Everything held (the stream ended without the tag), resetting the search."""
        held = "".join(self._pieces)
        self.reset()
        return held

    def reset(self) -> None:
        """Forgets the held text."""
        self._pieces.clear()
        self._tail = ""


class LeadMatcher:
    """Decides, one character at a time, whether an output opens with a structure:
    optional whitespace, an optional marker token (`<|python_tag|>`), optional
    whitespace, then `opener` ("{" or "["). Streaming needs this to know when leading
    text is plain content without rescanning what it has held."""

    UNDECIDED = -1
    CONTENT = -2

    def __init__(self, marker: str, opener: str) -> None:
        self._marker = marker
        self._opener = opener
        self._stage = 0  # 0: leading space, 1: inside the marker, 2: space after it
        self._matched = 0

    def feed(self, text: str) -> int:
        """UNDECIDED, CONTENT, or the index in `text` of the opener."""
        for i, char in enumerate(text):
            if self._stage == 1:
                if char != self._marker[self._matched]:
                    return self.CONTENT
                self._matched += 1
                if self._matched == len(self._marker):
                    self._stage = 2
            elif char.isspace():
                continue
            elif char == self._opener:
                return i
            elif self._stage == 0 and char == self._marker[0]:
                self._stage, self._matched = 1, 1
            else:
                return self.CONTENT
        return self.UNDECIDED


def strip_lead(text: str, marker: str) -> str:
    """Non-streaming side of LeadMatcher: `text` without leading whitespace, one leading
    marker and the whitespace after it."""
    text = text.lstrip()
    if text.startswith(marker):
        text = text[len(marker):].lstrip()
    return text


_JSON_INSIDE = re.compile(r'["\\]')


class JsonObjectEnd:
    """Finds where a JSON object that starts with "{" ends (or, with `brackets` "[]", an
    array that starts with "["), fed in pieces: the brackets are counted outside strings
    (escapes honoured), jumping between the characters that matter with a regex, so each
    character is looked at once. It only delimits the value; json.loads judges it."""

    def __init__(self, brackets: str = "{}") -> None:
        self._open = brackets[0]
        self._outside = re.compile(f'[{re.escape(brackets)}"]')
        self._depth = 0
        self._in_string = False
        self._escape = False

    def feed(self, text: str, start: int = 0) -> int | None:
        """The index in `text` just past the object's closing brace, or None if the
        object goes on; `text[start:]` is the next piece (an offset rather than a slice,
        so a whole output holding many objects is never copied once per object)."""
        pos = start
        while pos < len(text):
            if self._escape:
                self._escape = False
                pos += 1
                continue
            if self._in_string:
                match = _JSON_INSIDE.search(text, pos)
                if match is None:
                    return None
                pos = match.end()
                if match.group() == "\\":
                    self._escape = True
                else:
                    self._in_string = False
                continue
            match = self._outside.search(text, pos)
            if match is None:
                return None
            pos = match.end()
            char = match.group()
            if char == '"':
                self._in_string = True
            elif char == self._open:
                self._depth += 1
            else:
                self._depth -= 1
                if self._depth <= 0:
                    return pos
        return None
