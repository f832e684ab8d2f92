"""What `LLM.generate` and `AsyncLLM.generate` return (vLLM's shapes and names)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    """One token's log-probability at one position; rank 1 is the most likely."""

    logprob: float
    rank: int
    decoded_token: str | None = None


# Per position: token id -> Logprob (the sampled or actual token and the top-k).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One completion of a prompt."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None  # sum of the sampled tokens' logprobs
    logprobs: list[PositionLogprobs] | None = None  # one per token, if asked for
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that hit

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestStateStats:
    """A request's timings so far (vLLM V1's `RequestOutput.metrics`, same field names).

    Measured where the frontend sees the request: arrival is when it was submitted
    (wall clock, `time.time()`, as vLLM), token times are when the frontend received
    the tokens (`time.monotonic()`). vLLM's queued_ts / scheduled_ts are engine-core
    events this frontend is not told about, so they are absent rather than made up.
    """

    arrival_time: float  # time.time() when the request was submitted
    num_generation_tokens: int = 0  # over all completions
    first_token_ts: float = 0.0  # time.monotonic() when the first token arrived (0: none yet)
    last_token_ts: float = 0.0  # time.monotonic() when the latest token arrived
    first_token_latency: float = 0.0  # seconds from arrival to the first token


@dataclass
class RequestOutput:
    """A request's prompt and its completions so far (or final)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # With prompt_logprobs: None for the first prompt token, then one per prompt token.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    # Timings (vLLM's field); None only for outputs built outside an engine.
    metrics: RequestStateStats | None = None
    # Prompt tokens the prefix cache already held when the request was first scheduled
    # (whole blocks; completion 0's count with n > 1); None until it is scheduled.
    num_cached_tokens: int | None = None
