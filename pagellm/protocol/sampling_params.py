"""Sampling parameters, with vLLM's field names and semantics.

`SamplingParams` crosses the process boundary inside every `EngineCoreRequest`, so it
is a msgspec Struct; it validates itself on construction (and again when decoded), so
a bad value is rejected in the frontend with a message naming the field, long before
it could reach the GPU.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from pagellm.protocol.validation import (
    FLOAT32_MAX,
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    check_bool,
    check_float,
    check_int,
)

GREEDY_TEMPERATURE = 1e-5
# logprobs / prompt_logprobs / max_logprobs: vLLM's "the whole vocabulary".
ALL_LOGPROBS = -1
MAX_STRINGS = 1024  # stop strings, bad words
MAX_STRING_CHARS = 2**16  # characters in all of a request's stop strings (or bad words)
# Entries of a token-id list or of logit_bias: four times the largest released
# vocabulary (Gemma's 262k). Refused before any entry is looked at: a 14 MB list took
# 2 s to check entry by entry on the server's event loop. The engine then bounds them
# by the model's vocabulary.
MAX_TOKEN_IDS = 2**20


class RequestOutputKind(enum.IntEnum):
    """What each streamed `RequestOutput` holds."""

    CUMULATIVE = 0  # everything generated so far
    DELTA = 1  # only what is new since the last output
    FINAL_ONLY = 2  # a single output when the request finishes


# Structured outputs: a grammar's text (JSON schema, regex, EBNF/Lark, structural tag,
# all choices together) and a schema's nesting are bounded where they enter. Compile
# time and memory grow with them, and a request could otherwise make the engine's
# compile threads (shared by every request) work for minutes: 64k characters is far
# beyond the schemas and tool lists real clients send (a few KB).
MAX_GRAMMAR_CHARS = 2**16
MAX_SCHEMA_DEPTH = 64  # nested objects and arrays of a JSON schema (or a choice list)
MAX_CHOICES = MAX_STRINGS
_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """One constraint on a request's output (vLLM's names): a JSON schema (`json`, as a
    dict or its text), a `regex`, one of `choice`, a `grammar` (EBNF, or Lark), any JSON
    object (`json_object=True`) or an xgrammar `structural_tag` (JSON text). Exactly
    one must be set. `disable_any_whitespace` makes a JSON schema's output compact
    (no free whitespace between tokens: a small or random model may otherwise emit
    whitespace until max_tokens). The backend that compiles it is the engine's
    (`structured_outputs_config`)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    disable_fallback: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in _CONSTRAINTS if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs takes exactly one constraint of {list(_CONSTRAINTS)}, "
                f"got {len(given)}" + (f": {given}" if given else ""))
        for name in ("disable_any_whitespace", "disable_additional_properties",
                     "disable_fallback"):
            check_bool(f"structured_outputs.{name}", getattr(self, name))
        if self.whitespace_pattern is not None:
            raise ValueError("structured_outputs.whitespace_pattern is not supported "
                             "(use disable_any_whitespace)")
        if self.json_object is not None and self.json_object is not True:
            raise ValueError("structured_outputs.json_object must be true when given")
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, str) or not value:
                raise TypeError(f"structured_outputs.{name} must be a non-empty string")
            _check_grammar_chars(name, len(value))
        if self.choice is not None:
            if not isinstance(self.choice, list) or not self.choice or not all(
                    isinstance(c, str) for c in self.choice):
                raise TypeError("structured_outputs.choice must be a non-empty list of "
                                "strings")
            if len(self.choice) > MAX_CHOICES:
                raise ValueError(f"structured_outputs.choice has {len(self.choice)} "
                                 f"entries, more than {MAX_CHOICES}")
            _check_grammar_chars("choice", sum(len(c) for c in self.choice))
        if self.json is not None:
            self.json = _checked_schema(self.json)

    @property
    def kind(self) -> str:
        """The constraint given: one of "json", "regex", "choice", "grammar",
        "json_object", "structural_tag"."""
        return next(name for name in _CONSTRAINTS if getattr(self, name) is not None)


def _check_grammar_chars(name: str, chars: int) -> None:
    if chars > MAX_GRAMMAR_CHARS:
        raise ValueError(f"structured_outputs.{name} is {chars} characters, more than "
                         f"{MAX_GRAMMAR_CHARS}")


def _checked_schema(schema: Any) -> str | dict[str, Any]:
    """A JSON schema as given (dict, or its text), bounded in size and nesting: the
    text is parsed once here (a schema that is not JSON is named now, not by a compile
    thread later)."""
    if isinstance(schema, str):
        _check_grammar_chars("json", len(schema))
        try:
            parsed = msgspec.json.decode(schema)
        except msgspec.DecodeError as e:
            raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        except RecursionError:  # the decoder recurses: thousands of levels
            raise ValueError(f"structured_outputs.json nests deeper than "
                             f"{MAX_SCHEMA_DEPTH} levels") from None
    elif isinstance(schema, dict):
        parsed = schema
    else:
        raise TypeError(f"structured_outputs.json must be a JSON schema (an object or its "
                        f"text), got {type(schema).__name__}")
    if not isinstance(parsed, (dict, bool)):
        raise ValueError("structured_outputs.json must be a JSON schema: an object")
    depth = 0
    stack: list[tuple[Any, int]] = [(parsed, 1)]
    while stack:  # iterative: a deep schema must not exhaust Python's stack here
        node, level = stack.pop()
        depth = max(depth, level)
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(f"structured_outputs.json nests deeper than "
                             f"{MAX_SCHEMA_DEPTH} levels")
        children = node.values() if isinstance(node, dict) else \
            node if isinstance(node, list) else ()
        stack.extend((child, level + 1) for child in children
                     if isinstance(child, (dict, list)))
    if isinstance(schema, dict):  # its size, once its depth is known to be sane
        try:
            _check_grammar_chars("json", len(msgspec.json.encode(schema)))
        except (TypeError, OverflowError) as e:
            raise TypeError(f"structured_outputs.json must hold JSON values: {e}") from None
    return schema


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """How to sample one request's completion (vLLM's names, defaults and semantics).

    temperature 0 means greedy. top_k 0 or -1 and top_p 1 mean "off". max_tokens None
    means "up to max_model_len"; the frontend resolves it before the engine sees it.
    Penalties follow vLLM: repetition_penalty over prompt and output (logits > 0
    divided, others multiplied), presence/frequency penalties over the output only.
    logprobs / prompt_logprobs: how many top alternatives to return per position (the
    sampled or actual token is always included), at most the engine's max_logprobs; -1
    (vLLM's spelling) means the whole vocabulary, allowed when max_logprobs is -1 or at
    least the vocabulary size. extra_args: anything a caller wants carried with the
    request (vLLM's hook for custom logits processors); the engine ignores it.
    structured_outputs: a grammar the output must match (`StructuredOutputsParams`);
    the engine masks every token the grammar does not allow before sampling.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    extra_args: dict[str, Any] | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        # Every bound is the width of where the value goes (protocol/validation.py):
        # counts into int32 arrays, seeds into 64-bit generators, floats into float32
        # rows. What needs the model (the vocabulary, max_model_len, max_num_seqs,
        # max_logprobs) is checked by the InputProcessor.
        check_int("n", self.n, minimum=1, maximum=INT32_MAX)
        check_float("temperature", self.temperature, minimum=0.0, maximum=FLOAT32_MAX)
        check_float("top_p", self.top_p, minimum=0.0, maximum=1.0, min_exclusive=True)
        check_int("top_k", self.top_k, minimum=-1, maximum=INT32_MAX)
        check_float("min_p", self.min_p, minimum=0.0, maximum=1.0)
        check_int("seed", self.seed, minimum=INT64_MIN, maximum=INT64_MAX, allow_none=True)
        check_float("presence_penalty", self.presence_penalty, minimum=-2.0, maximum=2.0)
        check_float("frequency_penalty", self.frequency_penalty, minimum=-2.0, maximum=2.0)
        # vLLM takes any positive penalty (> 1 discourages repeats, < 1 encourages them).
        check_float("repetition_penalty", self.repetition_penalty, minimum=0.0,
                    maximum=FLOAT32_MAX, min_exclusive=True)
        check_int("max_tokens", self.max_tokens, minimum=1, maximum=INT32_MAX,
                  allow_none=True)
        check_int("min_tokens", self.min_tokens, minimum=0, maximum=INT32_MAX)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        check_int("logprobs", self.logprobs, minimum=ALL_LOGPROBS, maximum=INT32_MAX,
                  allow_none=True)
        check_int("prompt_logprobs", self.prompt_logprobs, minimum=ALL_LOGPROBS,
                  maximum=INT32_MAX, allow_none=True)
        if self.extra_args is not None and not (
                isinstance(self.extra_args, dict)
                and all(isinstance(k, str) for k in self.extra_args)):
            raise TypeError(f"extra_args must be a dict with string keys, got "
                            f"{self.extra_args!r}")
        if self.extra_args:
            try:  # it crosses to the engine: refused here, named, not when sent
                msgspec.msgpack.encode(self.extra_args)
            except (TypeError, OverflowError) as e:
                raise TypeError(f"extra_args must hold msgpack values (str, int within "
                                f"64 bits, float, bool, None, lists, dicts): {e}") from None
        for name in ("ignore_eos", "detokenize", "skip_special_tokens",
                     "spaces_between_special_tokens", "include_stop_str_in_output"):
            check_bool(name, getattr(self, name))
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens != -1:
            check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, minimum=1,
                      maximum=INT32_MAX)
        if not isinstance(self.output_kind, RequestOutputKind):
            raise TypeError(f"output_kind must be a RequestOutputKind (0 cumulative, 1 delta, "
                            f"2 final only), got {self.output_kind!r}")
        self.stop = _string_list("stop", self.stop)
        self.bad_words = _string_list("bad_words", self.bad_words)
        _token_id_list("stop_token_ids", self.stop_token_ids, allow_empty=True)
        _token_id_list("allowed_token_ids", self.allowed_token_ids, allow_empty=False)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise TypeError(f"logit_bias must be a dict of token id -> bias, got "
                                f"{self.logit_bias!r}")
            if len(self.logit_bias) > MAX_TOKEN_IDS:
                raise ValueError(f"logit_bias has {len(self.logit_bias)} entries, more than "
                                 f"{MAX_TOKEN_IDS}")
            for token, bias in self.logit_bias.items():
                check_int("logit_bias token id", token, minimum=0, maximum=INT32_MAX)
                check_float(f"logit_bias[{token}]", bias, minimum=-100.0, maximum=100.0)
        if self.structured_outputs is not None and not isinstance(
                self.structured_outputs, StructuredOutputsParams):
            raise TypeError(f"structured_outputs must be a StructuredOutputsParams, got "
                            f"{type(self.structured_outputs).__name__}")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True (use stop_token_ids)")

    def check_against_model(self, vocab_size: int, max_logprobs: int) -> None:
        """What needs the model, checked by the frontend and again by the engine core
        (which also serves clients we did not write): token ids within the vocabulary,
        lists of them no longer than it, logprobs within max_logprobs."""
        for name, ids in (("stop_token_ids", self.stop_token_ids or []),
                          ("allowed_token_ids", self.allowed_token_ids or []),
                          ("logit_bias", list(self.logit_bias or ()))):
            check_token_ids(name, ids, vocab_size)
        limit = vocab_size if max_logprobs == ALL_LOGPROBS else max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(self, name)
            if asked == ALL_LOGPROBS:
                asked = vocab_size
            if asked is not None and asked > limit:
                raise ValueError(f"{name}={getattr(self, name)} is more than this engine's "
                                 f"max_logprobs ({max_logprobs}); an engine with "
                                 f"max_logprobs=-1 allows any, up to -1: the whole "
                                 f"vocabulary ({vocab_size})")

    @property
    def greedy(self) -> bool:
        # vLLM treats temperatures below 1e-5 as greedy too: dividing by them overflows.
        return self.temperature < GREEDY_TEMPERATURE

    def clone(self, **changes: Any) -> SamplingParams:
        """A copy with `changes` applied (and validated again)."""
        return msgspec.structs.replace(self, **changes)


def check_token_ids(name: str, ids: list[int], vocab_size: int) -> None:
    """No more ids than the vocabulary has, each within it (non-negative already)."""
    if len(ids) > vocab_size:
        raise ValueError(f"{name} has {len(ids)} entries, more than the vocabulary "
                         f"({vocab_size})")
    bad = [t for t in ids if t >= vocab_size]
    if bad:
        raise ValueError(f"{name}: token ids {bad[:5]} are outside the vocabulary "
                         f"[0, {vocab_size})")


def _string_list(name: str, value: Any) -> list[str] | None:
    """None, or a list of non-empty strings (a single string is accepted, as vLLM).
    At most MAX_STRINGS of them and MAX_STRING_CHARS characters in all: each is
    searched for (stop) or tokenized (bad words) per request, so their number and size
    are work and memory a client could otherwise inflate at will."""
    if value is None:
        return None
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise TypeError(f"{name} must be a string or a list of strings, got {value!r}")
    if len(value) > MAX_STRINGS:
        raise ValueError(f"{name} has {len(value)} entries, more than {MAX_STRINGS}")
    for s in value:
        if not isinstance(s, str):
            raise TypeError(f"{name} entries must be strings, got {type(s).__name__} {s!r}")
        if not s:
            raise ValueError(f"{name} entries must be non-empty strings")
    chars = sum(len(s) for s in value)
    if chars > MAX_STRING_CHARS:
        raise ValueError(f"{name} hold {chars} characters in all, more than "
                         f"{MAX_STRING_CHARS}")
    return value


def _token_id_list(name: str, value: Any, allow_empty: bool) -> None:
    if value is None:
        return
    if not isinstance(value, list):
        raise TypeError(f"{name} must be a list of token ids (integers), got {value!r}")
    if not value and not allow_empty:
        raise ValueError(f"{name} must not be empty")
    if len(value) > MAX_TOKEN_IDS:
        raise ValueError(f"{name} has {len(value)} entries, more than {MAX_TOKEN_IDS}")
    if not all(type(t) is int for t in value) or (  # the fast path; the loop names one
            value and not 0 <= min(value) <= max(value) <= INT32_MAX):
        for t in value:
            check_int(f"{name} entry", t, minimum=0, maximum=INT32_MAX)
