"""Messages between the frontend and the engine core.

Everything here is a msgspec Struct encoded with msgpack; `array_like=True` sends
fields by position (no key strings on the wire) and `gc=False` keeps the many small
objects of a busy step out of the cyclic garbage collector. New fields go at the end
with a default so that `omit_defaults` keeps messages short.
"""

from __future__ import annotations

import enum

import msgspec

from protocol.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    """Why a request finished. `str()` gives the OpenAI spelling ("stop", "length")."""

    STOP = 0  # EOS, a stop token id or a stop string
    LENGTH = 1  # max_tokens or max_model_len reached
    ABORT = 2  # aborted by the client
    ERROR = 3  # the request could not be served; `EngineCoreOutput.error` says why

    def __str__(self) -> str:
        return self.name.lower()


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A tokenized, validated request, as the frontend hands it to the engine core."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams  # max_tokens already resolved (never None here)
    eos_token_id: int | None
    arrival_time: float
    priority: int = 0


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one request produced in one engine step."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id (or stop string) that hit
    error: str | None = None  # set with FinishReason.ERROR

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """All outputs of one engine step (possibly empty)."""

    outputs: list[EngineCoreOutput] = []
    timestamp: float = 0.0


class EngineInfo(msgspec.Struct, array_like=True, gc=False):
    """What the frontend learns from the engine core once it is ready."""

    model: str
    max_model_len: int
    vocab_size: int
    block_size: int
    num_kv_blocks: int
    max_num_batched_tokens: int
    device: str
    dtype: str
