"""Incremental detokenization: text grows as tokens arrive, never splitting a character.

Byte-level tokenizers can split one UTF-8 character over several tokens; decoding
each token alone would print replacement characters. For a tokenizer whose decoder is
ByteLevel alone (GPT-2, Llama 3, Qwen, SmolLM) the text is the UTF-8 decoding of its
tokens' bytes, so each token's bytes are looked up (`BytePieces`, made once per
tokenizer) and fed to Python's incremental UTF-8 decoder, which holds back a
character's first bytes until it is whole. Other fast tokenizers (SentencePiece-style
decoders, whose output depends on context) use the tokenizers library's
`DecodeStream`, primed with the tail of the prompt so that the first generated token
decodes as it would in context (leading spaces, merges across the boundary). At 256
streams the DecodeStream was the largest part of the frontend's step (60% of
`process_outputs`, benchmarks/engine_overhead.py).

The text is kept as the pieces it was decoded in, joined only when read whole: a
stream's delta and a stop-string search read the last few pieces (`text_between`).
Appending to one string copied the whole text at every token, which at 256 streams and
a thousand tokens each was 13% of `process_outputs`, and grows with the output. Every
`_FOLD_PIECES` pieces are joined into one, so a long text is not a million small
objects (freeing 256 finished requests of 1024 one-token pieces took 10 ms).
"""

from __future__ import annotations

import codecs
import random
from typing import Any

# Prompt tokens used to prime the stream: enough context for any decoder's look-back.
_PRIME_TOKENS = 6
# Tokens whose lone decode is checked against their bytes when a tokenizer's pieces are
# made (every added token is checked too).
_CHECKED_TOKENS = 2000
# Loose text pieces joined into one: each piece is copied once more, and a text of
# n pieces is about n / _FOLD_PIECES objects.
_FOLD_PIECES = 64


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as the printable character that stands
    for it in the vocabulary."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    chars, extra = dict(zip(printable, printable, strict=True)), 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {b: chr(c) for b, c in chars.items()}


class BytePieces:
    """Each token id's bytes, and which ids are special, for a tokenizer whose decoder
    is ByteLevel alone: the text of any ids is then `b"".join(pieces)` decoded as UTF-8
    (invalid bytes as U+FFFD), which is what the tokenizers library computes."""

    def __init__(self, pieces: list[bytes], special: frozenset[int]) -> None:
        self.pieces = pieces
        self.special = special

    @classmethod
    def of(cls, backend: Any) -> BytePieces | None:
        """None unless the tokenizer is byte-level through and through: its decoder is
        ByteLevel, and its own decode agrees with the bytes on every added token and
        on a sample of the others (else DecodeStream stays in charge)."""
        from tokenizers.decoders import ByteLevel

        if not isinstance(backend.decoder, ByteLevel):
            return None
        # Alphabet character -> the byte it stands for, as one translate table: ~0.3 us a
        # token, so a 150k vocabulary takes tens of milliseconds, once.
        to_bytes = {ord(c): chr(b) for b, c in _bytes_to_unicode().items()}
        vocab: dict[str, int] = backend.get_vocab(with_added_tokens=True)
        pieces = [b""] * (max(vocab.values(), default=-1) + 1)
        for token, token_id in vocab.items():
            try:
                pieces[token_id] = token.translate(to_bytes).encode("latin-1")
            except UnicodeEncodeError:  # not in the alphabet: the decoder keeps its
                pieces[token_id] = token.encode()  # UTF-8 (the checks below agree)
        added = backend.get_added_tokens_decoder()
        special = frozenset(i for i, token in added.items() if token.special)
        sample = random.Random(0).sample(range(len(pieces)),
                                         min(_CHECKED_TOKENS, len(pieces)))
        for token_id in [*added, *sample]:
            text = pieces[token_id].decode("utf-8", "replace")
            if backend.decode([token_id], skip_special_tokens=False) != text:
                return None
        return cls(pieces, special)


# Made once per tokenizer (a backend object lives as long as its tokenizer; the cache
# holds it, so its id cannot be reused). Few tokenizers per process: bounded anyway.
_PIECES: dict[int, tuple[Any, BytePieces | None]] = {}
_MAX_TOKENIZERS = 8


def byte_pieces(backend: Any) -> BytePieces | None:
    """The tokenizer backend's `BytePieces` (None: not byte-level), made on first use:
    building and checking them decodes a few thousand tokens, too much per stream."""
    cached = _PIECES.get(id(backend))
    if cached is None:
        if len(_PIECES) >= _MAX_TOKENIZERS:
            _PIECES.pop(next(iter(_PIECES)))
        cached = _PIECES[id(backend)] = (backend, BytePieces.of(backend))
    return cached[1]


class TokenTexts:
    """Each token's text alone, as `tokenizer.decode([id])` gives it: a logprob's
    `decoded_token` (vLLM's). Remembered, since it depends on the id alone: a request
    with `logprobs=k` asks for k + 1 of them every token, at 1.8 us each through
    transformers (256 streams with k = 5: 2.7 ms a step). At most one entry per id the
    engine sends, which are ids of its vocabulary."""

    def __init__(self, tokenizer: Any) -> None:
        self._decode = tokenizer.decode
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._decode([token_id])
        return text


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any | None, prompt_token_ids: list[int],
                 skip_special_tokens: bool, spaces_between_special_tokens: bool = True
                 ) -> None:
        """With no tokenizer (skip_tokenizer_init, detokenize=False) it only collects
        token ids. spaces_between_special_tokens matters to slow tokenizers only: fast
        ones never add spaces (as in transformers)."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.decode_kwargs = {"skip_special_tokens": skip_special_tokens}
        if self.tokenizer is not None and getattr(tokenizer, "_tokenizer", None) is None:
            self.decode_kwargs["spaces_between_special_tokens"] = spaces_between_special_tokens
        self.token_ids: list[int] = []
        self._shown = 0  # how many of token_ids are text (all but a silent stop token)
        self._parts: list[str] = []  # the text, in the pieces it was decoded in
        self._loose = 0  # pieces at the end of _parts not folded yet
        self.length = 0  # len(text)
        backend = getattr(tokenizer, "_tokenizer", None)
        self._backend = backend
        self._stream: Any = None
        self._pieces: list[bytes] | None = None
        if backend is not None:
            pieces = byte_pieces(backend)
            if pieces is not None:  # no context needed: the output's own bytes
                self._pieces = pieces.pieces
                self._skip = pieces.special if skip_special_tokens else frozenset()
                self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
            else:
                from tokenizers.decoders import DecodeStream

                self._stream = DecodeStream(ids=prompt_token_ids[-_PRIME_TOKENS:],
                                            skip_special_tokens=skip_special_tokens)

    def update(self, new_token_ids: list[int]) -> str:
        """Add tokens; return the text they completed (possibly empty)."""
        self.token_ids += new_token_ids
        self._shown = len(self.token_ids)
        if self.tokenizer is None:
            return ""
        if self._pieces is not None:  # usually one token: no list, no join
            pieces, skip = self._pieces, self._skip
            # Ids past the tokenizer's vocabulary (a model's padded embedding rows)
            # decode to nothing, as in the tokenizers library.
            if len(new_token_ids) == 1:
                token_id = new_token_ids[0]
                data = pieces[token_id] if token_id < len(pieces) and token_id not in skip \
                    else b""
            else:
                data = b"".join(pieces[t] for t in new_token_ids
                                if t < len(pieces) and t not in skip)
            delta = self._utf8.decode(data)
        elif self._stream is not None:
            step, backend = self._stream.step, self._backend
            delta = ""
            for token_id in new_token_ids:
                piece = step(backend, token_id)
                if piece:
                    delta += piece
        else:  # a tokenizer without a fast backend: decode all, hold back partial chars
            full = self.tokenizer.decode(self.token_ids[:self._shown], **self.decode_kwargs)
            if full.endswith("\ufffd"):
                return ""
            delta = full[self.length:]
        self._append(delta)
        return delta

    def add_silent(self, token_id: int) -> None:
        """The stop token that ended the request: generated, not text (the last)."""
        self.token_ids.append(token_id)

    def flush(self) -> str:
        """At the end of a request, emit what the stream still holds back (trailing
        bytes of an incomplete character decode to U+FFFD, as `tokenizer.decode` does)."""
        if self.tokenizer is None:
            return ""
        if self._pieces is not None:  # what the UTF-8 decoder holds back, nothing else
            delta = self._utf8.decode(b"", True)
            self._append(delta)
            return delta
        full = self.tokenizer.decode(self.token_ids[:self._shown], **self.decode_kwargs)
        text = self.text
        if len(full) <= len(text) or not full.startswith(text):
            return ""
        delta = full[len(text):]
        self._append(delta)
        return delta

    @property
    def text(self) -> str:
        """The whole text so far (joins the pieces, once: later reads are free until
        more text comes)."""
        if len(self._parts) > 1:
            self._parts, self._loose = ["".join(self._parts)], 0
        return self._parts[0] if self._parts else ""

    def text_between(self, start: int, end: int) -> str:
        """`text[start:end]` (0 <= start, end <= length), joining only the pieces from
        the one that holds `start` on."""
        if start >= end:
            return ""
        parts, i, offset = self._parts, len(self._parts), self.length
        while offset > start:  # back to the piece that holds `start`
            i -= 1
            offset -= len(parts[i])
        if i == len(parts) - 1:  # usually: one piece, no join
            return parts[i][start - offset:end - offset]
        return "".join(parts[i:])[start - offset:end - offset]

    def _append(self, delta: str) -> None:
        if delta:
            parts = self._parts
            parts.append(delta)
            self.length += len(delta)
            self._loose += 1
            if self._loose == _FOLD_PIECES:
                parts[-_FOLD_PIECES:] = ["".join(parts[-_FOLD_PIECES:])]
                self._loose = 0
