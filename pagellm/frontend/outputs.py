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
class RequestOutput:
    """A request's prompt and its completions so far (or final)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # With prompt_logprobs: None for the first prompt token, then one per prompt token.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
