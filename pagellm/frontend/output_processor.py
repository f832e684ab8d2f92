"""`OutputProcessor`: engine-core outputs in, `RequestOutput`s out.

A request with `n` completions runs in the engine core as `n` child requests (the
`InputProcessor` fans it out); here each child is a `CompletionState` (incremental
detokenization, stop strings) and the request a `RequestState` that assembles the
children's completions into one `RequestOutput` as CUMULATIVE, DELTA or FINAL_ONLY
asks. A stop-string hit finishes the child here and is reported so the caller aborts
it in the engine core at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import msgspec

from pagellm.frontend.detokenizer import IncrementalDetokenizer, TokenTexts, byte_pieces
from pagellm.frontend.input_processor import ProcessedRequest
from pagellm.frontend.output_collector import RequestOutputCollector
from pagellm.frontend.outputs import (
    CompletionOutput,
    Logprob,
    PositionLogprobs,
    RequestOutput,
    RequestStateStats,
)
from pagellm.protocol.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    TokenLogprobs,
)
from pagellm.protocol.sampling_params import RequestOutputKind


class EngineUnavailableError(ValueError):
    """The engine refused a request for its state (paused or asleep), not for the
    request: the same request may succeed after resume_generation() / wake_up()."""


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput] = field(default_factory=list)
    reqs_to_abort: list[str] = field(default_factory=list)  # engine ids stopped by a string
    errors: dict[str, str] = field(default_factory=dict)  # request_id -> engine's message


class CompletionState:
    """One completion: its tokens, text and stop state."""

    def __init__(self, index: int, request: EngineCoreRequest, stop: list[str],
                 tokenizer: Any, token_text: Callable[[int], str] | None) -> None:
        """`stop`: the request's stop strings (they stay here: the engine's copy of the
        params has none). `token_text`: a token's text alone, for logprobs
        (`TokenTexts`)."""
        params = request.sampling_params
        if not params.detokenize:  # token ids only: no text, no decoded logprob tokens
            tokenizer, token_text = None, None
        self.token_text = token_text
        self.index = index
        self.min_tokens = params.min_tokens
        self.stop = stop
        self.include_stop = params.include_stop_str_in_output
        self.eos_token_id = request.eos_token_id
        # Streamed text holds back what could still turn out to start a stop string.
        self.stop_buffer = max((len(s) for s in self.stop), default=1) - 1
        self.detokenizer = IncrementalDetokenizer(tokenizer, request.prompt_token_ids,
                                                  params.skip_special_tokens,
                                                  params.spaces_between_special_tokens)
        self.logprobs: list[PositionLogprobs] | None = (
            [] if params.logprobs is not None else None)
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.sent_logprobs = 0
        self.text_end: int | None = None  # text length after a stop string cut it
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        self.sent_text = 0  # DELTA bookkeeping
        self.sent_tokens = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, output: EngineCoreOutput) -> bool:
        """Absorb one step's tokens; True when a stop string finished it here.

        A step that emitted a run of tokens (speculative decoding) is taken one token at
        a time, as that many steps: a stop string ends the output at the token that
        completed it, and the run's later tokens are dropped."""
        tokens = output.new_token_ids
        if not self.stop or len(tokens) < 2:
            return self._update(output)
        logprobs = output.new_logprobs
        for j, token_id in enumerate(tokens):
            last = j == len(tokens) - 1
            if self._update(msgspec.structs.replace(
                    output, new_token_ids=[token_id],
                    finish_reason=output.finish_reason if last else None,
                    stop_reason=output.stop_reason if last else None,
                    new_logprobs=logprobs[j:j + 1] if logprobs else None)):
                return True
        return False

    def _update(self, output: EngineCoreOutput) -> bool:
        detokenizer = self.detokenizer
        tokens = output.new_token_ids
        if tokens and output.finish_reason == FinishReason.STOP and not self.include_stop \
                and (isinstance(output.stop_reason, int) or (
                    output.stop_reason is None and tokens[-1] == self.eos_token_id)):
            # The engine stopped on EOS or a stop token: its text is not output (vLLM's
            # rule, whatever skip_special_tokens says), unless include_stop_str_in_output.
            # (A grammar that completes without one stops on its last token: kept.)
            delta = detokenizer.update(tokens[:-1])
            detokenizer.add_silent(tokens[-1])
        else:
            delta = detokenizer.update(tokens)
        if self.logprobs is not None and output.new_logprobs:
            for position in output.new_logprobs:
                self.logprobs.append(logprob_dict(position, self.token_text))
                self.cumulative_logprob = (self.cumulative_logprob or 0.0) + \
                    position.logprobs[0]
        if output.finish_reason is not None:
            self.finish_reason, self.stop_reason = output.finish_reason, output.stop_reason
            delta += detokenizer.flush()
        if self.stop and delta and len(detokenizer.token_ids) > self.min_tokens:
            # Only the new text and the stop_buffer characters before it can hold a hit.
            start = max(0, detokenizer.length - len(delta) - self.stop_buffer)
            hit = find_stop_string(detokenizer.text_between(start, detokenizer.length),
                                   len(delta), self.stop, self.include_stop)
            if hit is not None:
                self.stop_reason, cut = hit
                self.text_end = None if cut is None else start + cut
                stopped_here = self.finish_reason is None
                self.finish_reason = FinishReason.STOP
                return stopped_here
        return False

    def completion(self, delta: bool) -> CompletionOutput:
        detokenizer = self.detokenizer
        end = detokenizer.length if self.text_end is None else self.text_end
        if not self.finished and self.stop_buffer:
            end = min(end, max(end - self.stop_buffer, self.sent_text))
        token_ids = detokenizer.token_ids
        logprobs = self.logprobs
        if delta:  # slices are copies already; the text is read from where it was sent
            text, self.sent_text = detokenizer.text_between(self.sent_text, end), end
            token_ids, self.sent_tokens = token_ids[self.sent_tokens:], len(token_ids)
            if logprobs is not None:
                logprobs, self.sent_logprobs = logprobs[self.sent_logprobs:], len(logprobs)
        else:
            text = detokenizer.text[:end]
            token_ids = list(token_ids)
            logprobs = list(logprobs) if logprobs is not None else None
        return CompletionOutput(  # positional, the fields' order: once per stream per step
            self.index, text, token_ids, self.cumulative_logprob, logprobs,
            None if self.finish_reason is None else str(self.finish_reason),
            self.stop_reason)


class RequestState:
    """A user's request: its completions, and where its outputs go."""

    def __init__(self, processed: ProcessedRequest, tokenizer: Any,
                 token_text: Callable[[int], str] | None) -> None:
        self.request_id = processed.request_id
        self.prompt = processed.prompt
        self.prompt_token_ids = processed.prompt_token_ids
        self.output_kind = processed.params.output_kind
        self.collector: RequestOutputCollector | None = None  # a stream's (AsyncLLM)
        # Completions with news the stream has not been given yet (DELTA).
        self.unsent: list[CompletionState] = []
        self.engine_ids = [r.request_id for r in processed.engine_requests]
        stop = processed.params.stop or []
        self.completions = [CompletionState(i, r, stop, tokenizer, token_text)
                            for i, r in enumerate(processed.engine_requests)]
        self.token_text = token_text if processed.params.detokenize else None
        self.prompt_logprobs: list[PositionLogprobs | None] | None = (
            [None] if processed.params.prompt_logprobs is not None else None)
        self.sent_prompt_logprobs = 0
        self.stats = RequestStateStats(arrival_time=processed.engine_requests[0].arrival_time)
        self.num_cached_tokens: int | None = None

    def update_stats(self, output: EngineCoreOutput, completion: CompletionState,
                     now: float) -> None:
        """Token times (`now`: when the frontend received the output) and the
        prefix-cache hit, from one engine output."""
        if not output.new_token_ids:
            return
        if self.num_cached_tokens is None and completion.index == 0:
            self.num_cached_tokens = output.num_cached_tokens
        stats = self.stats
        if stats.num_generation_tokens == 0:
            stats.first_token_ts = now
            stats.first_token_latency = max(time.time() - stats.arrival_time, 0.0)
        stats.last_token_ts = now
        stats.num_generation_tokens += len(output.new_token_ids)

    def add_prompt_logprobs(self, positions: list[TokenLogprobs]) -> None:
        if self.prompt_logprobs is not None:
            self.prompt_logprobs += [logprob_dict(p, self.token_text) for p in positions]

    @property
    def finished(self) -> bool:
        # A loop, not all(genexpr): asked twice per stream per step, and the generator
        # cost 10% of a consumer's take (benchmarks/engine_overhead.py --frontend-only).
        for c in self.completions:  # noqa: SIM110
            if c.finish_reason is None:
                return False
        return True

    def notify(self, changed: CompletionState) -> None:
        """A stream's news: `changed` goes into an output built when the consumer takes
        it (`take_output`). FINAL_ONLY has news only at the end."""
        if self.output_kind == RequestOutputKind.DELTA:
            if changed not in self.unsent:
                self.unsent.append(changed)
        elif self.output_kind == RequestOutputKind.FINAL_ONLY and not self.finished:
            return
        assert self.collector is not None
        self.collector.notify()

    def take_output(self) -> RequestOutput | None:
        """For a stream: everything it has not been given yet. A DELTA output carries
        one completion (the one whose news waited longest, with all of it); any other
        completion with news is ready for the next take at once."""
        if self.output_kind != RequestOutputKind.DELTA:
            return self.make_output(None)
        if not self.unsent:
            return None
        changed = self.unsent.pop(0)
        if self.unsent:
            assert self.collector is not None
            self.collector.notify()
        return self.make_output(changed)

    def make_output(self, changed: CompletionState | None) -> RequestOutput | None:
        """DELTA: what `changed` added since its last output. A stream's output is final
        only once no other completion's news waits behind it."""
        finished = self.finished and not self.unsent
        if self.output_kind == RequestOutputKind.FINAL_ONLY:
            if not finished:
                return None
            outputs = [c.completion(delta=False) for c in self.completions]
        elif self.output_kind == RequestOutputKind.DELTA:
            assert changed is not None
            outputs = [changed.completion(delta=True)]
        else:  # CUMULATIVE: every completion that has begun
            outputs = [c.completion(delta=False) for c in self.completions
                       if c.detokenizer.token_ids or c.finished]
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is not None and self.output_kind == RequestOutputKind.DELTA:
            prompt_logprobs, self.sent_prompt_logprobs = (
                prompt_logprobs[self.sent_prompt_logprobs:], len(prompt_logprobs))
        stats = self.stats  # a snapshot: the output must not change as the stream goes on
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs,
                             finished, list(prompt_logprobs) if prompt_logprobs is not None
                             else None,
                             RequestStateStats(stats.arrival_time, stats.num_generation_tokens,
                                               stats.first_token_ts, stats.last_token_ts,
                                               stats.first_token_latency),
                             self.num_cached_tokens)

    def fail(self, error: BaseException) -> None:
        """End the stream, if any, with `error`."""
        if self.collector is not None:
            self.collector.fail(error)


def logprob_dict(position: TokenLogprobs, token_text: Callable[[int], str] | None
                 ) -> PositionLogprobs:
    """token id -> Logprob; the chosen token (first) keeps its own rank."""
    result: PositionLogprobs = {}
    for token_id, logprob, rank in zip(position.token_ids, position.logprobs, position.ranks,
                                       strict=True):
        if token_id not in result:
            decoded = token_text(token_id) if token_text is not None else None
            result[token_id] = Logprob(logprob, rank, decoded)
    return result


def find_stop_string(text: str, new_chars: int, stop: list[str], include: bool
                     ) -> tuple[str, int | None] | None:
    """The earliest stop string in the text's new tail: (string, where to cut the text,
    None for no cut). Only the last `new_chars` characters, plus overlap, are searched."""
    best: tuple[int, str] | None = None
    for s in stop:
        index = text.find(s, max(0, len(text) - new_chars - len(s) + 1))
        if index != -1 and (best is None or index < best[0]):
            best = (index, s)
    if best is None:
        return None
    index, s = best
    cut = index + len(s) if include else index
    return s, (None if cut >= len(text) else cut)


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "_tokenizer", None)
        if backend is not None:  # made now, not on the event loop at the first request
            byte_pieces(backend)
        self.token_text = TokenTexts(tokenizer) if tokenizer is not None else None
        self.requests: dict[str, RequestState] = {}
        self._by_engine_id: dict[str, tuple[RequestState, CompletionState]] = {}

    def add_request(self, processed: ProcessedRequest) -> None:
        """Track a request whose outputs `process_outputs` returns (LLM)."""
        self._add(processed)

    def add_stream(self, processed: ProcessedRequest) -> RequestOutputCollector:
        """Track a request whose outputs go to the collector returned (AsyncLLM)."""
        state = self._add(processed)
        state.collector = RequestOutputCollector(state.take_output)
        return state.collector

    def _add(self, processed: ProcessedRequest) -> RequestState:
        if processed.request_id in self.requests:
            raise ValueError(f"request id {processed.request_id!r} is already in use")
        state = RequestState(processed, self.tokenizer, self.token_text)
        self.requests[processed.request_id] = state
        for engine_id, completion in zip(state.engine_ids, state.completions, strict=True):
            self._by_engine_id[engine_id] = (state, completion)
        return state

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forget requests; returns the engine ids of their unfinished completions (to
        abort in the engine core). A stream ends with a final output whose
        finish_reason is "abort"."""
        to_abort: list[str] = []
        for request_id in request_ids:
            state = self._forget(request_id)
            if state is None:
                continue
            for engine_id, completion in zip(state.engine_ids, state.completions,
                                             strict=True):
                if not completion.finished:
                    to_abort.append(engine_id)
                    completion.finish_reason = FinishReason.ABORT
                    if state.collector is not None:
                        state.notify(completion)  # its final output says "abort"
        return to_abort

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        """vLLM's name (OpenRLHF polls it): user requests not yet finished here, each
        counted once whatever its `n`."""
        return len(self.requests)

    @property
    def request_states(self) -> Mapping[str, RequestState]:
        """vLLM's name for the unfinished requests by id (verl lists its keys before a
        pause); read-only: tracking goes through add_request / abort_requests."""
        return MappingProxyType(self.requests)

    def process_outputs(self, message: EngineCoreOutputs) -> ProcessedOutputs:
        """One engine step's outputs (for many requests: this runs for every stream every
        step, so per-output work is kept to what the output needs). The message's plain
        tokens (its columns) become one-token outputs here, and take the same path."""
        processed = ProcessedOutputs()
        now = time.monotonic()
        for output in message.all_outputs():
            found = self._by_engine_id.get(output.request_id)
            if found is None:
                continue  # aborted here while the engine was still stepping it
            state, completion = found
            if output.finish_reason == FinishReason.ERROR:
                error = output.error or "engine error"
                kind = EngineUnavailableError if output.unavailable else ValueError
                state.fail(kind(f"request {state.request_id} failed in the engine: {error}"))
                processed.errors[state.request_id] = error
                processed.reqs_to_abort += [e for e, c in zip(state.engine_ids,
                                                              state.completions, strict=True)
                                            if not c.finished and e != output.request_id]
                self._forget(state.request_id)
                continue
            if output.new_prompt_logprobs:
                state.add_prompt_logprobs(output.new_prompt_logprobs)
            state.update_stats(output, completion, now)
            if completion.update(output):
                processed.reqs_to_abort.append(output.request_id)
            if state.collector is not None:
                state.notify(completion)  # the output is built when the consumer runs
            else:
                request_output = state.make_output(completion)
                if request_output is not None:
                    processed.request_outputs.append(request_output)
            if completion.finish_reason is not None and state.finished:
                self._forget(state.request_id)
        return processed

    def fail_all(self, error: BaseException) -> None:
        """End every stream with `error` (the engine died) and forget them all."""
        for state in self.requests.values():
            state.fail(error)
        self.requests.clear()
        self._by_engine_id.clear()

    def _forget(self, request_id: str) -> RequestState | None:
        state = self.requests.pop(request_id, None)
        if state is not None:
            for engine_id in state.engine_ids:
                self._by_engine_id.pop(engine_id, None)
        return state
