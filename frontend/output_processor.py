"""`OutputProcessor`: engine-core outputs in, `RequestOutput`s out.

Per request it detokenizes new tokens incrementally, checks stop strings (a hit
finishes the request here and asks the caller to abort it in the engine core), and
shapes the output as CUMULATIVE, DELTA or FINAL_ONLY.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from frontend.detokenizer import IncrementalDetokenizer
from frontend.outputs import CompletionOutput, RequestOutput
from protocol.messages import EngineCoreOutput, EngineCoreRequest, FinishReason
from protocol.sampling_params import RequestOutputKind


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput] = field(default_factory=list)
    reqs_to_abort: list[str] = field(default_factory=list)  # stopped by a stop string
    errors: dict[str, str] = field(default_factory=dict)  # request_id -> engine's message


# AsyncLLM streams each request through its own queue: outputs, or the exception that
# ends the stream.
OutputQueue = asyncio.Queue[RequestOutput | BaseException]


class RequestState:
    def __init__(self, request: EngineCoreRequest, prompt: str | None, tokenizer: Any,
                 queue: OutputQueue | None = None) -> None:
        params = request.sampling_params
        self.queue = queue
        self.request_id = request.request_id
        self.prompt = prompt
        self.prompt_token_ids = request.prompt_token_ids
        self.output_kind = params.output_kind
        self.min_tokens = params.min_tokens
        self.stop = params.stop or []
        self.include_stop = params.include_stop_str_in_output
        # Streamed text holds back what could still turn out to start a stop string.
        self.stop_buffer = max((len(s) for s in self.stop), default=1) - 1
        self.detokenizer = IncrementalDetokenizer(tokenizer, request.prompt_token_ids,
                                                  params.skip_special_tokens)
        self.text_end: int | None = None  # text length after a stop string cut it
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        self.sent_text = 0  # DELTA bookkeeping
        self.sent_tokens = 0

    @property
    def text(self) -> str:
        return self.detokenizer.text[:self.text_end]

    def update(self, output: EngineCoreOutput) -> bool:
        """Absorb one step's tokens; True when a stop string finished the request."""
        delta = self.detokenizer.update(output.new_token_ids)
        if output.finish_reason is not None:
            self.finish_reason, self.stop_reason = output.finish_reason, output.stop_reason
            delta += self.detokenizer.flush()
        if (self.stop and delta and self.finish_reason != FinishReason.ERROR
                and len(self.detokenizer.token_ids) > self.min_tokens):
            hit = find_stop_string(self.detokenizer.text, len(delta), self.stop,
                                   self.include_stop)
            if hit is not None:
                self.stop_reason, self.text_end = hit
                stopped_here = self.finish_reason is None
                self.finish_reason = FinishReason.STOP
                return stopped_here
        return False

    def make_output(self) -> RequestOutput | None:
        finished = self.finish_reason is not None
        if self.output_kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        text = self.text
        if not finished and self.stop_buffer:
            text = text[:max(len(text) - self.stop_buffer, self.sent_text)]
        token_ids = self.detokenizer.token_ids
        if self.output_kind == RequestOutputKind.DELTA:
            text, self.sent_text = text[self.sent_text:], len(text)
            token_ids, self.sent_tokens = token_ids[self.sent_tokens:], len(token_ids)
        completion = CompletionOutput(
            index=0, text=text, token_ids=list(token_ids),
            finish_reason=str(self.finish_reason) if finished else None,
            stop_reason=self.stop_reason)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                             [completion], finished)


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
        self.requests: dict[str, RequestState] = {}

    def add_request(self, request: EngineCoreRequest, prompt: str | None,
                    queue: OutputQueue | None = None) -> None:
        """Track a request; with a queue its outputs go there instead of into the
        `ProcessedOutputs` that `process_outputs` returns."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = RequestState(request, prompt, self.tokenizer,
                                                         queue)

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forget requests; returns those that were still unfinished here. A queued
        stream ends with a final output whose finish_reason is "abort"."""
        aborted = []
        for request_id in request_ids:
            state = self.requests.pop(request_id, None)
            if state is None:
                continue
            aborted.append(request_id)
            if state.queue is not None:
                state.finish_reason = FinishReason.ABORT
                final = state.make_output()
                if final is not None:
                    state.queue.put_nowait(final)
        return aborted

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        processed = ProcessedOutputs()
        for output in outputs:
            state = self.requests.get(output.request_id)
            if state is None:
                continue  # aborted here while the engine was still stepping it
            if output.finish_reason == FinishReason.ERROR:
                error = output.error or "engine error"
                if state.queue is not None:
                    state.queue.put_nowait(ValueError(f"request {output.request_id} failed "
                                                      f"in the engine: {error}"))
                processed.errors[output.request_id] = error
                del self.requests[output.request_id]
                continue
            if state.update(output):
                processed.reqs_to_abort.append(output.request_id)
            request_output = state.make_output()
            if request_output is not None:
                if state.queue is not None:
                    state.queue.put_nowait(request_output)
                else:
                    processed.request_outputs.append(request_output)
            if state.finish_reason is not None:
                del self.requests[output.request_id]
        return processed

    def fail_all(self, error: BaseException) -> None:
        """End every queued stream with `error` (the engine died) and forget them all."""
        for state in self.requests.values():
            if state.queue is not None:
                state.queue.put_nowait(error)
        self.requests.clear()
