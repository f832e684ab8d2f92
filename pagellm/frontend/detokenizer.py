"""Incremental detokenization: text grows as tokens arrive, never splitting a character.

Byte-level tokenizers can split one UTF-8 character over several tokens; decoding
each token alone would print replacement characters. The tokenizers library's
`DecodeStream` buffers such pieces and emits text only once it is valid. It is primed
with the tail of the prompt so that the first generated token decodes as it would in
context (leading spaces, merges across the boundary).
"""

from __future__ import annotations

from typing import Any

# Prompt tokens used to prime the stream: enough context for any decoder's look-back.
_PRIME_TOKENS = 6


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
        self.text = ""
        backend = getattr(tokenizer, "_tokenizer", None)
        self._backend = backend
        self._stream: Any = None
        if backend is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(ids=prompt_token_ids[-_PRIME_TOKENS:],
                                        skip_special_tokens=skip_special_tokens)

    def update(self, new_token_ids: list[int]) -> str:
        """Add tokens; return the text they completed (possibly empty)."""
        self.token_ids += new_token_ids
        if self.tokenizer is None:
            return ""
        if self._stream is not None:  # usually one token: no list, no join
            step, backend = self._stream.step, self._backend
            delta = ""
            for token_id in new_token_ids:
                piece = step(backend, token_id)
                if piece:
                    delta += piece
        else:  # a tokenizer without a fast backend: decode all, hold back partial chars
            full = self.tokenizer.decode(self.token_ids, **self.decode_kwargs)
            if full.endswith("\ufffd"):
                return ""
            delta = full[len(self.text):]
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of a request, emit what the stream still holds back (trailing
        bytes of an incomplete character decode to U+FFFD, as `tokenizer.decode` does)."""
        if self.tokenizer is None:
            return ""
        full = self.tokenizer.decode(self.token_ids, **self.decode_kwargs)
        if len(full) <= len(self.text) or not full.startswith(self.text):
            return ""
        delta = full[len(self.text):]
        self.text = full
        return delta
