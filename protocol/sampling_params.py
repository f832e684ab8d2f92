"""Sampling parameters, with vLLM's field names and semantics.

`SamplingParams` crosses the process boundary inside every `EngineCoreRequest`, so it
is a msgspec Struct; it validates itself on construction (and again when decoded), so
a bad value is rejected in the frontend with a message naming the field, long before
it could reach the GPU.
"""

from __future__ import annotations

import enum
import math
from typing import Any

import msgspec

GREEDY_TEMPERATURE = 1e-5


class RequestOutputKind(enum.IntEnum):
    """What each streamed `RequestOutput` holds."""

    CUMULATIVE = 0  # everything generated so far
    DELTA = 1  # only what is new since the last output
    FINAL_ONLY = 2  # a single output when the request finishes


def _is_int(value: Any) -> bool:
    # bool is a subclass of int; `max_tokens=True` is a bug in the caller, not 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_int(name: str, value: Any, *, minimum: int | None = None, allow_none: bool = False,
              maximum: int | None = None) -> None:
    """Raise TypeError/ValueError naming `name` unless `value` is an int in range."""
    if value is None and allow_none:
        return
    if not _is_int(value):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")


def check_float(name: str, value: Any, *, minimum: float | None = None,
                maximum: float | None = None, min_exclusive: bool = False) -> None:
    """Raise TypeError/ValueError naming `name` unless `value` is a finite number in range."""
    if not _is_number(value):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    if minimum is not None:
        if min_exclusive and value <= minimum:
            raise ValueError(f"{name} must be > {minimum}, got {value}")
        if not min_exclusive and value < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")


def check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """How to sample one request's completion (vLLM's names and defaults).

    temperature 0 means greedy. top_k 0 or -1 and top_p 1 mean "off". max_tokens None
    means "up to max_model_len"; the frontend resolves it before the engine sees it.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        check_int("n", self.n, minimum=1)
        check_float("temperature", self.temperature, minimum=0.0)
        check_float("top_p", self.top_p, minimum=0.0, maximum=1.0, min_exclusive=True)
        check_int("top_k", self.top_k, minimum=-1)
        check_float("min_p", self.min_p, minimum=0.0, maximum=1.0)
        check_int("seed", self.seed, allow_none=True)
        check_int("max_tokens", self.max_tokens, minimum=1, allow_none=True)
        check_int("min_tokens", self.min_tokens, minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        check_bool("ignore_eos", self.ignore_eos)
        check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        check_bool("skip_special_tokens", self.skip_special_tokens)
        if not isinstance(self.output_kind, RequestOutputKind):
            raise TypeError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        if isinstance(self.stop, str):  # vLLM accepts a single string
            self.stop = [self.stop]
        if self.stop is not None:
            if not isinstance(self.stop, list):
                raise TypeError(f"stop must be a string or a list of strings, got {self.stop!r}")
            for s in self.stop:
                if not isinstance(s, str):
                    raise TypeError(f"stop entries must be strings, got {type(s).__name__} {s!r}")
                if not s:
                    raise ValueError("stop entries must be non-empty strings")
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, list):
                raise TypeError(
                    f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}")
            for t in self.stop_token_ids:
                check_int("stop_token_ids entry", t, minimum=0)

    @property
    def greedy(self) -> bool:
        # vLLM treats temperatures below 1e-5 as greedy too: dividing by them overflows.
        return self.temperature < GREEDY_TEMPERATURE

    def clone(self, **changes: Any) -> SamplingParams:
        """A copy with `changes` applied (and validated again)."""
        return msgspec.structs.replace(self, **changes)
