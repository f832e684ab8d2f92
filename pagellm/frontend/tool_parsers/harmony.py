"""OpenAI's Harmony format (gpt-oss), read from a choice's text: the messages a model
writes after the prompt's `<|start|>assistant`, each a header and a body,

    <|channel|>analysis<|message|>The user asks for the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json
    <|message|>{"city": "Paris"}<|call|>                          (one line each)

split into what the chat API reports: the analysis channel is reasoning, a message to
`functions.NAME` is a call of NAME (its body the arguments), the final channel and
commentary without a recipient (a preamble shown to the user) are content. A message to
a built-in tool (`browser.search`, `python`: the Responses API's tools, which the chat
API does not run) is neither, as in vLLM's chat completions. The recipient may stand in
the role's part of the header (`<|start|>assistant to=functions.f<|channel|>commentary
json<|message|>`), as gpt-oss also writes it.

The tags are special tokens, so the text must be decoded with them
(skip_special_tokens false: the parsers that read this format say so, and the server
does it). vLLM parses the token ids with the openai-harmony library instead, whose
tokenizer file is downloaded on first use; reading the text keeps the tags' meaning the
same and needs nothing from the network, with one difference: a tag's characters
written as ordinary tokens (an answer quoting `<|end|>`) read as the tag here, where
the token ids tell them apart. Several messages of one kind are joined with a
newline (vLLM's joining); a message's text streams as it comes, except a call's, which
is sent whole when its message ends.

Robustness: an output with no tag at all is content (nothing the model wrote is lost);
a header left unfinished at the end is dropped (it holds only names); a call whose body
is no JSON object is content, never arguments a client cannot parse; an unterminated
last call counts when its body is complete JSON. Work is linear in the text fed:
each piece is scanned once, holding back at most a partial tag."""

from __future__ import annotations

import re
from dataclasses import dataclass

from pagellm.frontend.tool_parsers.base import ToolCall, arguments_json

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
END, CALL, RETURN, CONSTRAIN = "<|end|>", "<|call|>", "<|return|>", "<|constrain|>"
TAGS = (START, CHANNEL, MESSAGE, END, CALL, RETURN, CONSTRAIN)
_TAG = re.compile("|".join(re.escape(tag) for tag in TAGS))
_RECIPIENT = re.compile(r"\bto=(\S+)")
FUNCTIONS = "functions."

REASONING, CONTENT = "reasoning", "content"


@dataclass(frozen=True)
class Header:
    """One message's header, as parsed from the text between its start and
    `<|message|>` (its content type, `json` or `<|constrain|>json`, is not needed:
    arguments must be a JSON object whatever it says)."""

    channel: str | None
    recipient: str | None

    @property
    def kind(self) -> str | None:
        """REASONING, CONTENT, "call", or None for a message nobody is shown."""
        if self.recipient is not None and self.recipient.startswith(FUNCTIONS):
            return "call"  # in whatever channel (vLLM's openai tool parser)
        if self.channel == "analysis":
            return REASONING  # a built-in tool's call in the analysis channel too (vLLM)
        return CONTENT if self.recipient is None else None


def parse_header(text: str) -> Header:
    """`assistant to=functions.f<|channel|>commentary <|constrain|>json` and its
    variants as (channel, recipient)."""
    role_part, _, channel_part = text.partition(CHANNEL)
    spaced = _TAG.sub(" ", role_part + " " + channel_part)
    found = _RECIPIENT.search(spaced)
    words = [w for w in _TAG.sub(" ", channel_part).split() if not w.startswith("to=")]
    return Header(words[0] if words else None, found.group(1) if found else None)


def _partial_tag(text: str) -> int:
    """How many trailing characters of `text` may begin a tag (held back: the next
    piece may complete it). Every tag starts with "<|" and is at most 13 long."""
    start = text.rfind("<", max(0, len(text) - 12))
    if start < 0:
        return 0
    tail = text[start:]
    return len(tail) if any(tag.startswith(tail) and tag != tail for tag in TAGS) else 0


Event = tuple[str, "str | ToolCall"]  # (REASONING | CONTENT, text) or ("call", ToolCall)


class HarmonySplitter:
    """One choice's Harmony text, fed in pieces: `feed` and `finish` return the events
    each piece makes certain, in order: (REASONING, text), (CONTENT, text) or ("call",
    ToolCall). `split` does a whole text."""

    def __init__(self) -> None:
        self._held = ""  # a trailing partial tag
        self._header: list[str] = []  # the current header's text, tags included
        self._header_open = True  # between messages: reading a header
        self._tagged = False  # a tag has been seen (else the text so far is content)
        self._message: Header | None = None
        self._body: list[str] = []  # a call's body, sent at its end
        self._message_text = False  # the current message has emitted text
        self._kinds_with_text: set[str] = set()  # for the newline between messages
        # A final-channel message has begun: the reasoning is over (the point the engine
        # core's grammar waits for, REASONING_TAGS["openai_gptoss"]).
        self.final_begun = False

    @classmethod
    def split(cls, text: str) -> tuple[str | None, str | None, list[ToolCall]]:
        """(reasoning, content, calls) of a whole output; None for empty text."""
        splitter = cls()
        parts: dict[str, list[str]] = {REASONING: [], CONTENT: []}
        calls: list[ToolCall] = []
        for kind, payload in splitter.feed(text) + splitter.finish():
            if isinstance(payload, ToolCall):
                calls.append(payload)
            else:
                parts[kind].append(payload)
        return ("".join(parts[REASONING]) or None, "".join(parts[CONTENT]) or None, calls)

    def feed(self, piece: str) -> list[Event]:
        text = self._held + piece
        keep = _partial_tag(text)
        self._held = text[len(text) - keep:]
        return self._scan(text[:len(text) - keep])

    def finish(self) -> list[Event]:
        events = self._scan(self._held)
        self._held = ""
        if not self._tagged:  # no Harmony at all: the text is the answer
            events += self._text(CONTENT, "".join(self._header))
        elif self._message is not None:
            events += self._end_message()
        return events

    def _scan(self, text: str) -> list[Event]:
        events: list[Event] = []
        pos = 0
        for match in _TAG.finditer(text):
            events += self._plain(text[pos:match.start()])
            events += self._tag(match.group())
            pos = match.end()
        events += self._plain(text[pos:])
        return events

    def _plain(self, text: str) -> list[Event]:
        if not text:
            return []
        if self._header_open:
            self._header.append(text)
            return []
        assert self._message is not None
        kind = self._message.kind
        if kind == "call":
            self._body.append(text)
            return []
        return self._text(kind, text) if kind is not None else []

    def _tag(self, tag: str) -> list[Event]:
        self._tagged = True
        if self._header_open:
            if tag == MESSAGE:
                self._message = parse_header("".join(self._header))
                self._header, self._header_open, self._message_text = [], False, False
                self.final_begun = self.final_begun or self._message.channel == "final"
            elif tag in (START, END, CALL, RETURN):
                self._header = []  # a new message begins (or a stray end): names only
            else:
                self._header.append(tag)
            return []
        if tag in (END, CALL, RETURN, START):
            events = self._end_message()
            self._header_open = True
            return events
        return self._plain(tag)  # a tag inside a body is its text

    def _end_message(self) -> list[Event]:
        message, body = self._message, "".join(self._body)
        self._message, self._body = None, []
        if message is None or message.kind != "call":
            return []
        arguments = arguments_json(body)
        if arguments is None:  # not a JSON object: shown, never sent as arguments
            return self._text(CONTENT, body)
        name = message.recipient[len(FUNCTIONS):] if message.recipient else ""
        return [("call", ToolCall(name=name, arguments=arguments))] if name else \
            self._text(CONTENT, body)

    def _text(self, kind: str, text: str) -> list[Event]:
        """A message's text, after a newline if an earlier message of its kind had
        text."""
        if not text:
            return []
        if not self._message_text and kind in self._kinds_with_text:
            text = "\n" + text
        self._message_text = True
        self._kinds_with_text.add(kind)
        return [(kind, text)]
