"""The two grammar backends behind one small interface: compile a `GrammarSpec` for
the engine's tokenizer, then one matcher per request that accepts sampled tokens and
fills that request's row of the step's token bitmask (int32 words, bit j of a row set
where token j is allowed: the layout both libraries and xgrammar's apply kernel use).

xgrammar compiles ahead (its compiler caches compiled grammars by key, bounded in
bytes); llguidance compiles lazily as the matcher runs. Both fill masks in native code.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import numpy as np

from pagellm.enginecore.structured_output.spec import GrammarSpec, guidance_grammar

# xgrammar's compiled-grammar cache (bytes; vLLM's default is 512 MiB). A distinct
# schema per request cannot grow memory past it.
XGRAMMAR_CACHE_BYTES = 256 * 2**20


class Matcher(Protocol):
    """One request's position in its grammar."""

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar does not allow it."""
        ...

    def is_terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculative decoding's proposals:
        the bitmask rows after each, then back)."""
        ...

    def validate(self, token_ids: list[int]) -> int:
        """How many of `token_ids`, in a row from the start, the grammar allows; the
        matcher is left as it was."""
        ...

    @classmethod
    def fill_rows(cls, pairs: list[tuple[Any, int]], bitmask: np.ndarray) -> None:
        """bitmask [rows, ceil(V/32)] int32 (C-contiguous): for each (matcher of this
        class, row), that row := the matcher's allowed next tokens."""
        ...


class Backend(Protocol):
    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar (slow part; runs in a compile thread)."""
        ...

    def matcher(self, compiled: Any, stop_token_ids: list[int]) -> Matcher:
        ...


class XgrammarMatcher:
    __slots__ = ("_matcher",)

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def accept(self, token_id: int) -> bool:
        return bool(self._matcher.accept_token(token_id))

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)

    def validate(self, token_ids: list[int]) -> int:
        count = 0  # a refused token leaves xgrammar's matcher as it was
        for token_id in token_ids:
            if not self._matcher.accept_token(token_id):
                break
            count += 1
        if count:
            self._matcher.rollback(count)
        return count

    @classmethod
    def fill_rows(cls, pairs: list[tuple[Any, int]], bitmask: np.ndarray) -> None:
        # (any DLPack array: numpy too) ~15-50 us a row at a 49k vocabulary
        for matcher, row in pairs:
            matcher._matcher.fill_next_token_bitmask(bitmask, row)


class XgrammarBackend:
    def __init__(self, tokenizer: Any, vocab_size: int, threads: int) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=True,
                                            cache_limit_bytes=XGRAMMAR_CACHE_BYTES)

    def compile(self, spec: GrammarSpec) -> Any:
        c = self.compiler
        if spec.kind == "json":
            return c.compile_json_schema(spec.text, any_whitespace=spec.any_whitespace)
        if spec.kind == "regex":
            return c.compile_regex(spec.text)
        if spec.kind == "ebnf":
            return c.compile_grammar(spec.text)
        if spec.kind == "lark":
            return c.compile_lark(spec.text)
        return c.compile_structural_tag(spec.text)

    def matcher(self, compiled: Any, stop_token_ids: list[int]) -> Matcher:
        return XgrammarMatcher(self._xgr.GrammarMatcher(
            compiled, override_stop_tokens=stop_token_ids or None))


class GuidanceMatcher:
    """llguidance fills masks straight into the bitmask's memory, all of a step's rows in
    one call on its own thread pool (`LLExecutor`); `llguidance.torch`, which wraps the
    same calls, is not imported: it pulls in torch._dynamo (3.6 s on the first request)."""

    __slots__ = ("_matcher",)
    _executor: Any = None

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def accept(self, token_id: int) -> bool:
        return bool(self._matcher.consume_token(token_id)) and not self._matcher.is_error()

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_stopped())

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)

    def validate(self, token_ids: list[int]) -> int:
        # (consume_token on a refused token would leave the matcher in its error state)
        return int(self._matcher.validate_tokens(token_ids))

    @classmethod
    def fill_rows(cls, pairs: list[tuple[Any, int]], bitmask: np.ndarray) -> None:
        from llguidance import LLExecutor

        assert bitmask.dtype == np.int32 and bitmask.flags.c_contiguous
        if cls._executor is None:
            cls._executor = LLExecutor()
        cls._executor.unsafe_compute_mask_ptr(
            [(matcher._matcher, row) for matcher, row in pairs], bitmask.ctypes.data,
            bitmask.shape[1] * 4, bitmask.shape[0])


class GuidanceBackend:
    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import llguidance.hf

        self._llg_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)

    def compile(self, spec: GrammarSpec) -> Any:
        return guidance_grammar(spec)  # llguidance builds its parser lazily, per matcher

    def matcher(self, compiled: Any, stop_token_ids: list[int]) -> Matcher:
        from llguidance import LLMatcher

        matcher = LLMatcher(self._llg_tokenizer, compiled, log_level=0)
        if matcher.is_error():
            raise ValueError(f"guidance: {matcher.get_error()}")
        return GuidanceMatcher(matcher)


class Backends:
    """Each backend built on first use (a tokenizer's vocabulary is scanned once: about
    a second for a 150k vocabulary), from any compile thread."""

    def __init__(self, tokenizer_path: str, vocab_size: int, threads: int) -> None:
        self._path = tokenizer_path
        self._vocab_size = vocab_size
        self._threads = threads
        self._lock = threading.Lock()
        self._tokenizer: Any = None
        self._built: dict[str, Backend] = {}

    def get(self, name: str) -> Backend:
        with self._lock:
            backend = self._built.get(name)
            if backend is None:
                if self._tokenizer is None:
                    self._tokenizer = _load_tokenizer(self._path)
                backend = XgrammarBackend(self._tokenizer, self._vocab_size, self._threads) \
                    if name == "xgrammar" else GuidanceBackend(self._tokenizer, self._vocab_size)
                self._built[name] = backend
            return backend

    def token_ids(self, text: str) -> tuple[int, ...]:
        """The ids a reasoning tag encodes to (one for a think tag, a few for Harmony's);
        ValueError for a tag this tokenizer has no special token of (spelled out in
        ordinary tokens it would take many, and a model would not write it so)."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = _load_tokenizer(self._path)
            tokenizer = self._tokenizer
            ids = tokenizer.encode(text, add_special_tokens=False)
            special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
        if not ids or ids[0] not in special:
            raise ValueError(f"the reasoning tag {text!r} does not begin with a special "
                             f"token of this model's tokenizer (encoded as {len(ids)} "
                             f"tokens): is the reasoning parser the model's?")
        return tuple(int(i) for i in ids)


def _load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"structured outputs need the model's tokenizer; could not load "
                         f"it from {path}: {e}") from e
