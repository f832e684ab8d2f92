"""`StructuredOutputManager`: grammars for the engine core's constrained requests.

A request with `structured_outputs` does not enter the scheduler until its grammar is
compiled (vLLM's WAITING_FOR_FSM): compiling runs in a small thread pool, so a slow
schema holds up only its own request, never the busy loop. Each step the engine core
asks for the token bitmask of the constrained requests that sample in it (one row
each, filled by their matchers in native code); the worker applies it to the logits
before sampling. The scheduler advances each request's `RequestGrammar` with the token
it sampled: a token the grammar refuses (possible only where the request's own bans
left nothing the grammar allows) fails that request alone, and a completed grammar
finishes it.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from pagellm.enginecore.structured_output.backends import Backends
from pagellm.enginecore.structured_output.request_grammar import RequestGrammar
from pagellm.enginecore.structured_output.spec import choose_backend
from pagellm.protocol.reasoning import REASONING_TAGS
from pagellm.protocol.scheduling import GrammarOutput

if TYPE_CHECKING:
    from pagellm.enginecore.request import Request

# A grammar that has not compiled in this long fails its request (the thread finishes
# in the background; input bounds keep that rare and short).
COMPILE_TIMEOUT_S = 30.0
# Requests waiting for a grammar at once; more are refused (a flood of distinct
# schemas queues no unbounded work).
MAX_PENDING = 1024


class StructuredOutputManager:
    def __init__(self, tokenizer_path: str | None, vocab_size: int, backend: str = "auto",
                 any_whitespace: bool = True, reasoning_parser: str | None = None,
                 enable_in_reasoning: bool = False) -> None:
        """`tokenizer_path` None: the engine has no tokenizer (skip_tokenizer_init), and
        constrained requests are refused."""
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.backend = backend
        self.any_whitespace = any_whitespace
        self.reasoning_tags = None if reasoning_parser is None or enable_in_reasoning \
            else REASONING_TAGS[reasoning_parser]
        threads = max(1, min(4, (os.cpu_count() or 2) // 2))
        self._backends = Backends(tokenizer_path or "", vocab_size, threads)
        self._threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._pending: dict[str, tuple[Request, Future[RequestGrammar], float]] = {}
        self._done = threading.Event()
        self.on_ready: Callable[[], None] | None = None  # a compile finished (any thread)
        self._bitmask: np.ndarray | None = None  # [rows, ceil(V / 32)] int32, reused
        self.active = False  # a constrained request was ever admitted

    # -- compiling ------------------------------------------------------------------

    def submit(self, request: Request) -> None:
        """Start compiling the request's grammar; `take_ready` hands it back."""
        if self.tokenizer_path is None:
            raise ValueError("structured outputs need a tokenizer: this engine was started "
                             "with skip_tokenizer_init")
        if len(self._pending) >= MAX_PENDING:
            raise ValueError(f"too many requests waiting for a grammar to compile "
                             f"({MAX_PENDING}); try again later")
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="grammar")
        future = self._pool.submit(self._compile, request)
        self._pending[request.request_id] = (request, future,
                                             time.monotonic() + COMPILE_TIMEOUT_S)
        future.add_done_callback(self._on_done)

    def _on_done(self, _: Future[RequestGrammar]) -> None:
        self._done.set()
        if self.on_ready is not None:
            self.on_ready()

    def _compile(self, request: Request) -> RequestGrammar:
        params = request.sampling_params.structured_outputs
        assert params is not None
        name, spec = choose_backend(params, self.backend, self.any_whitespace)
        backend = self._backends.get(name)
        compiled = backend.compile(spec)
        eos = request.eos_token_id
        stop = sorted({eos, *(request.sampling_params.stop_token_ids or ())}) \
            if eos is not None else []
        matcher = backend.matcher(compiled, stop)
        if self.reasoning_tags is None:
            return RequestGrammar(matcher)
        start, end = (self._backends.token_ids(tag) for tag in self.reasoning_tags)
        return RequestGrammar(matcher, end, not _reasoning_done(request.prompt_token_ids,
                                                                start, end))

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def has_ready(self) -> bool:
        """A compile finished or timed out (`take_ready` has something)."""
        if not self._pending:
            return False
        now = time.monotonic()
        return any(f.done() or now > deadline for _, f, deadline in self._pending.values())

    def take_ready(self) -> list[tuple[Request, str | None]]:
        """The requests whose grammar is ready (with `request.grammar` set), or failed or
        timed out (with the error message)."""
        ready: list[tuple[Request, str | None]] = []
        now = time.monotonic()
        self._done.clear()
        for request_id, (request, future, deadline) in list(self._pending.items()):
            if future.done():
                del self._pending[request_id]
                try:
                    request.grammar = future.result()
                    self.active = True
                    ready.append((request, None))
                except Exception as e:  # the request's grammar, not the engine
                    ready.append((request, _compile_error(e)))
            elif now > deadline:
                del self._pending[request_id]
                future.cancel()
                ready.append((request, f"structured outputs: the grammar did not compile "
                                       f"within {COMPILE_TIMEOUT_S:.0f} s"))
        return ready

    def wait(self, timeout: float) -> None:
        """Block until a compile finishes (an in-process engine with nothing else to do)."""
        self._done.wait(timeout)

    def cancel(self, request_ids: Iterable[str]) -> list[Request]:
        """Forget pending requests (aborted); returns those that were pending."""
        dropped = []
        for request_id in request_ids:
            entry = self._pending.pop(request_id, None)
            if entry is not None:
                entry[1].cancel()
                dropped.append(entry[0])
        return dropped

    def pending(self, request_id: str) -> Request | None:
        """The request if its grammar is still compiling."""
        entry = self._pending.get(request_id)
        return None if entry is None else entry[0]

    def pending_requests(self) -> list[Request]:
        return [entry[0] for entry in self._pending.values()]

    # -- each step --------------------------------------------------------------------

    def bitmask(self, requests: list[Request], proposals: dict[str, list[int]]
                ) -> GrammarOutput | None:
        """The step's bitmask rows for `requests` (constrained ones that sample in it)
        whose grammar applies now; stop tokens are cleared for a request short of its
        min_tokens (the sampler bans them). A row that allows nothing (an unsatisfiable
        grammar, or one that could only stop) is opened fully, and the request fails when
        its token comes back.

        With speculative decoding a request with k `proposals` (which its grammar
        allows: `RequestGrammar.valid_proposals`) has k + 1 rows, one per position the
        runner samples: row j is the grammar's after the first j proposals (the matcher
        advanced through them, a position at a time for all requests, then rolled
        back)."""
        rows = [r for r in requests if r.grammar is not None and r.grammar.needs_mask]
        if not rows:
            return None
        drafts = [proposals.get(r.request_id, ()) if proposals else () for r in rows]
        counts = [len(d) + 1 for d in drafts]
        first = [0, *itertools.accumulate(counts)]
        words = -(-self.vocab_size // 32)
        if self._bitmask is None or self._bitmask.shape[0] < first[-1]:
            self._bitmask = np.empty((max(first[-1], 64), words), dtype=np.int32)
        bitmask = self._bitmask[:first[-1]]
        for j in range(max(counts)):
            by_kind: dict[Any, list[tuple[Any, int]]] = {}
            for i, request in enumerate(rows):
                if j < counts[i]:
                    assert request.grammar is not None
                    matcher = request.grammar.matcher
                    by_kind.setdefault(type(matcher), []).append((matcher, first[i] + j))
                    if j:  # the proposal before this position
                        matcher.accept(drafts[i][j - 1])
            for kind, pairs in by_kind.items():  # one call per backend (llguidance: parallel)
                kind.fill_rows(pairs, bitmask)
        for i, request in enumerate(rows):
            assert request.grammar is not None
            if counts[i] > 1:
                request.grammar.matcher.rollback(counts[i] - 1)
            for j in range(counts[i]):
                if len(request.output_token_ids) + j < request.min_tokens:
                    _clear_bits(bitmask, first[i] + j, request.stopping_ids)  # (sampler too)
        empty = (bitmask == 0).all(axis=1)
        if empty.any():
            for row in np.flatnonzero(empty).tolist():
                if row in first:  # a request's own position (not one after a proposal)
                    grammar = rows[first.index(row)].grammar
                    assert grammar is not None
                    grammar.dead_end = True
                bitmask[row] = -1
        return GrammarOutput([r.request_id for r in rows], bitmask.tobytes(),
                             counts if len(counts) < first[-1] else [])

    def shutdown(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None and not sys.is_finalizing():  # at exit, threads stop anyway
            pool.shutdown(wait=False, cancel_futures=True)


def _clear_bits(bitmask: np.ndarray, row: int, token_ids: Iterable[int]) -> None:
    """Disallow `token_ids` in one bitmask row (its int32 words read as unsigned)."""
    words = bitmask[row].view(np.uint32)
    for token_id in token_ids:
        words[token_id >> 5] &= np.uint32(~(1 << (token_id & 31)) & 0xFFFFFFFF)


def _reasoning_done(prompt: list[int], start: tuple[int, ...], end: tuple[int, ...]
                    ) -> bool:
    """The prompt closes a reasoning block it opened (a template that turned thinking
    off writes an empty one; a Harmony prompt prefilled to its final message): the
    answer, and so the grammar, starts at once."""
    last_start = _last_index(prompt, start)
    return last_start >= 0 and _last_index(prompt, end) > last_start


def _last_index(ids: list[int], seq: tuple[int, ...]) -> int:
    """Where the last occurrence of `seq` in `ids` begins, or -1."""
    n = len(seq)
    for i in range(len(ids) - n, -1, -1):
        if ids[i] == seq[0] and tuple(ids[i:i + n]) == seq:
            return i
    return -1


def _compile_error(e: BaseException) -> str:
    text = str(e)
    return text if text.startswith("structured_outputs") else \
        f"structured_outputs: {text}" if isinstance(e, ValueError) else \
        f"structured_outputs: the grammar could not be compiled: {type(e).__name__}: {text}"

