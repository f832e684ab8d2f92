"""`InputProcessor`: prompt in, validated `EngineCoreRequest` out.

Everything a client can get wrong is caught here, in the frontend, with a ValueError
(TypeError for a wrong type) that names the problem, before anything reaches the
engine core; nothing is sent for a rejected request, so the engine keeps serving the
rest untouched.
"""

from __future__ import annotations

import copy
import itertools
import secrets
import time
from dataclasses import dataclass
from typing import Any, TypedDict

from pagellm.enginecore.structured_output.spec import choose_backend
from pagellm.protocol.lora import LoRARequest, plain
from pagellm.protocol.messages import (
    MAX_CACHE_SALT_CHARS,
    MAX_REQUEST_ID_CHARS,
    REQUEST_ID_SUFFIX_CHARS,
    EngineCoreRequest,
    EngineInfo,
)
from pagellm.protocol.sampling_params import (
    ALL_LOGPROBS,
    RequestOutputKind,
    SamplingParams,
    check_token_ids,
)
from pagellm.protocol.validation import INT64_MAX, INT64_MIN, check_int


class _Text(TypedDict):
    prompt: str


class _Tokens(TypedDict):
    prompt_token_ids: list[int]


class TextPrompt(_Text, total=False):
    """vLLM's text prompt form: {"prompt": text} (and an optional cache_salt)."""

    cache_salt: str


class TokensPrompt(_Tokens, total=False):
    """vLLM's token-id prompt form: {"prompt_token_ids": [...]} (and a cache_salt); the
    text the ids came from may ride along as "prompt" (vLLM's field: outputs report it,
    the ids are what is computed)."""

    cache_salt: str
    prompt: str


# A prompt: text, or one of the two dict forms.
PromptType = str | TextPrompt | TokensPrompt | dict[str, Any]


@dataclass
class ProcessedRequest:
    """A validated request: what the user asked for, and the engine requests (one per
    completion, each with an engine-side id from `InputProcessor.engine_request_id`) that
    serve it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    engine_requests: list[EngineCoreRequest]


def child_request_id(request_id: str, index: int) -> str:
    """The id of part `index` of a request: a completion of n (in the engine) or a
    prompt of a batch (the server's requests with several prompts). Built here only."""
    return f"{request_id}-{index}"


def max_token_chars(tokenizer: Any) -> int:
    """The most characters one token can stand for: the longest entry of the vocabulary
    (added tokens included). Byte-level BPE entries have one character per byte and
    SentencePiece ones one per character, so no token decodes to more characters than
    its entry has."""
    return max((len(token) for token in tokenizer.get_vocab()), default=1)


class InputProcessor:
    def __init__(self, tokenizer: Any | None, info: EngineInfo,
                 generation_eos_ids: list[int] | None = None,
                 default_max_tokens: int | None = None,
                 structured_outputs_backend: str = "auto") -> None:
        """tokenizer None (skip_tokenizer_init): token-id prompts only, and EOS comes from
        generation_config.json alone. `default_max_tokens` (the model's max_new_tokens)
        caps a request that leaves max_tokens unset (else it runs to max_model_len)."""
        self.tokenizer = tokenizer
        self.info = info
        self.default_max_tokens = default_max_tokens
        self.structured_outputs_backend = structured_outputs_backend
        eos_ids = list(generation_eos_ids or ())
        self.eos_token_id: int | None = (tokenizer.eos_token_id if tokenizer is not None
                                         else (eos_ids[0] if eos_ids else None))
        # EOS ids from generation_config.json beyond the tokenizer's own.
        self.extra_eos_ids = sorted(set(eos_ids) - {self.eos_token_id})
        # A text longer than this cannot fit in max_model_len tokens: refuse it before
        # spending time tokenizing it.
        self.max_prompt_chars = info.max_model_len * (max_token_chars(tokenizer)
                                                      if tokenizer is not None else 1)
        # Engine-side request ids: unique across this frontend's requests (whatever ids
        # its users choose) and, with a random part, across the frontends of one engine.
        self._id_nonce = secrets.token_hex(4)
        self._id_counter = itertools.count()

    def engine_request_id(self, request_id: str, index: int) -> str:
        """The engine's id for completion `index` of the user's request `request_id`."""
        return f"{child_request_id(request_id, index)}-{self._id_nonce}" \
               f"{next(self._id_counter):x}"

    def process_inputs(self, request_id: str, prompt: PromptType, params: SamplingParams,
                       arrival_time: float | None = None, priority: int = 0,
                       output_kind: RequestOutputKind | None = None,
                       lora_request: LoRARequest | None = None) -> ProcessedRequest:
        """Validate and tokenize; a request with n > 1 becomes n engine requests that
        share the prompt (and, through the prefix cache, its KV blocks). With a seed,
        completion i samples with seed + i: distinct and reproducible streams.
        `output_kind` overrides the params' (LLM only needs final outputs).
        `lora_request`: the adapter it runs with (None: the base model)."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got "
                            f"{type(params).__name__}")
        if lora_request is not None:
            if not isinstance(lora_request, LoRARequest):
                raise TypeError(f"lora_request must be a LoRARequest, got "
                                f"{type(lora_request).__name__}")
            lora_request = plain(lora_request)
        longest = MAX_REQUEST_ID_CHARS - REQUEST_ID_SUFFIX_CHARS
        if not isinstance(request_id, str) or not 0 < len(request_id) <= longest:
            raise ValueError(f"request_id must be a non-empty string of at most {longest} "
                             f"characters, got {str(request_id)[:40]!r}"
                             + ("..." if len(str(request_id)) > 40 else ""))
        check_int("priority", priority, minimum=INT64_MIN, maximum=INT64_MAX)
        if priority != 0 and self.info.scheduling_policy != "priority":
            # vLLM refuses it too: under fcfs the value would be silently ignored
            raise ValueError(f"priority={priority} needs an engine started with "
                             f"scheduling_policy='priority'; this one schedules "
                             f"{self.info.scheduling_policy!r}")
        # The one validation of the request's params (SamplingParams are mutable: the
        # caller's object may have changed since it was built); later copies derive
        # from it with values valid by construction.
        params = params.clone(**({} if output_kind is None else {"output_kind": output_kind}))
        self._check_params(params)
        prompt_text, prompt_ids, cache_salt = self._tokenize(prompt)
        truncate = params.truncate_prompt_tokens
        if truncate is not None:  # keep the last tokens; -1: as many as the model takes
            keep = self.info.max_model_len if truncate == -1 else truncate
            prompt_ids = prompt_ids[-keep:]
        params = self._resolve_params(params, len(prompt_ids))
        arrival = time.time() if arrival_time is None else arrival_time
        # Stop strings are matched here (OutputProcessor) and bad words go as token ids:
        # neither travels to the engine, n times over.
        engine_params = _derived(params, stop=None, bad_words=None)
        if params.n == 1:
            children = [(self.engine_request_id(request_id, 0), engine_params)]
        else:
            # The prompt's logprobs are the same for every completion: compute them once.
            children = [(self.engine_request_id(request_id, i),
                         _derived(engine_params, n=1, seed=_child_seed(params.seed, i),
                                  prompt_logprobs=params.prompt_logprobs if i == 0 else None))
                        for i in range(params.n)]
        bad_words = self._bad_words(params.bad_words)
        engine_requests = [EngineCoreRequest(
            request_id=child_id, prompt_token_ids=prompt_ids, sampling_params=child_params,
            eos_token_id=self.eos_token_id, arrival_time=arrival, priority=priority,
            cache_salt=cache_salt, bad_words_token_ids=bad_words, lora_request=lora_request)
            for child_id, child_params in children]
        return ProcessedRequest(request_id, prompt_text, prompt_ids, params, engine_requests)

    def _check_params(self, params: SamplingParams) -> None:
        """What needs this engine and its tokenizer."""
        if params.n > self.info.max_num_seqs:
            raise ValueError(f"n={params.n} is more than this engine runs at once "
                             f"(max_num_seqs={self.info.max_num_seqs})")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer (skip_tokenizer_init=True); "
                             "use stop_token_ids")
        params.check_against_model(self.info.vocab_size, self.info.max_logprobs)
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise ValueError("structured outputs need a tokenizer "
                                 "(skip_tokenizer_init=True)")
            # The engine core decides again (it serves other clients too); here a
            # grammar no backend takes is refused before it is sent.
            choose_backend(params.structured_outputs, self.structured_outputs_backend)

    def _tokenize(self, prompt: Any) -> tuple[str | None, list[int], str | None]:
        """(prompt text or None, token ids, cache_salt); `prompt` is what a caller
        passed, checked here whatever its type."""
        cache_salt = None
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"}
            if unknown or not {"prompt", "prompt_token_ids"} & set(prompt):
                raise ValueError("a prompt dict takes 'prompt' or 'prompt_token_ids' (a "
                                 "token prompt may carry its 'prompt' text too; and "
                                 f"optionally 'cache_salt'), got keys {sorted(prompt)}")
            cache_salt = prompt.get("cache_salt")
            if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt
                                           or len(cache_salt) > MAX_CACHE_SALT_CHARS):
                raise ValueError(f"cache_salt must be a non-empty string of at most "
                                 f"{MAX_CACHE_SALT_CHARS} characters, got "
                                 f"{str(cache_salt)[:40]!r}")
            if "prompt_token_ids" in prompt:
                text = prompt.get("prompt")
                if text is not None and not (isinstance(text, str)
                                             and len(text) <= self.max_prompt_chars):
                    raise ValueError(f"a token prompt's 'prompt' must be its text, at most "
                                     f"{self.max_prompt_chars} characters")
                return text, self._check_token_ids(prompt["prompt_token_ids"]), cache_salt
            prompt = prompt["prompt"]
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a string or a dict with 'prompt' or "
                            f"'prompt_token_ids', got {type(prompt).__name__}")
        if not prompt:
            raise ValueError("prompt must not be empty")
        if len(prompt) > self.max_prompt_chars:
            raise ValueError(f"prompt is {len(prompt)} characters: more than "
                             f"max_model_len={self.info.max_model_len} tokens can hold "
                             f"({self.max_prompt_chars} characters at most)")
        if self.tokenizer is None:
            raise ValueError("text prompts need a tokenizer, and this engine was started with "
                             "skip_tokenizer_init=True: pass {'prompt_token_ids': [...]}")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"prompt is not valid text (position {e.start}: {e.reason})"
                             ) from None
        ids = self.tokenizer.encode(prompt)
        if not ids:
            raise ValueError("prompt tokenized to zero tokens")
        return prompt, ids, cache_salt

    def _check_token_ids(self, ids: Any) -> list[int]:
        if not isinstance(ids, list):
            raise TypeError(f"prompt_token_ids must be a list of integers, got "
                            f"{type(ids).__name__}")
        if not ids:
            raise ValueError("prompt_token_ids must not be empty")
        vocab = self.info.vocab_size
        for i, t in enumerate(ids):
            if not isinstance(t, int) or isinstance(t, bool):
                raise TypeError(f"prompt_token_ids[{i}] must be an integer, got "
                                f"{type(t).__name__} {t!r}")
            if not 0 <= t < vocab:
                raise ValueError(f"prompt_token_ids[{i}] = {t} is outside the vocabulary "
                                 f"[0, {vocab})")
        return list(ids)

    def _resolve_params(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        """Settle max_tokens and the stop-token list (generation_config.json's extra EOS
        ids stop too, as in vLLM)."""
        max_len = self.info.max_model_len
        if prompt_len >= max_len:
            raise ValueError(f"prompt is {prompt_len} tokens, but max_model_len is {max_len} "
                             "(at least one token must be generated)")
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = max_len - prompt_len
            if self.default_max_tokens is not None:
                max_tokens = min(max_tokens, self.default_max_tokens)
        elif prompt_len + max_tokens > max_len:
            raise ValueError(f"prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) "
                             f"exceeds max_model_len ({max_len})")
        if params.min_tokens > max_tokens:  # SamplingParams checked only a given max_tokens
            raise ValueError(f"min_tokens ({params.min_tokens}) must be <= max_tokens "
                             f"({max_tokens}: what max_model_len leaves after the prompt)")
        # Each id once: the client's (checked against the vocabulary) and the extra EOS
        # ids, so the list stays within the vocabulary's size as the engine requires.
        extra = () if params.ignore_eos else self.extra_eos_ids
        stop_ids = list(dict.fromkeys([*(params.stop_token_ids or ()), *extra]))
        # logprobs=-1 (the whole vocabulary) travels as the count it means.
        whole_vocab = {name: self.info.vocab_size for name in ("logprobs", "prompt_logprobs")
                       if getattr(params, name) == ALL_LOGPROBS}
        return _derived(params, max_tokens=max_tokens, stop_token_ids=stop_ids or None,
                        **whole_vocab)

    def _bad_words(self, words: list[str] | None) -> list[list[int]] | None:
        """Each bad word's token ids, alone and after a space (vLLM's rule: a word can
        start a text or follow one)."""
        if not words:
            return None
        if self.tokenizer is None:
            raise ValueError("bad_words need a tokenizer (skip_tokenizer_init=True)")
        sequences: list[list[int]] = []
        for word in words:
            for variant in (word, " " + word):
                ids = self.tokenizer.encode(variant, add_special_tokens=False)
                if ids and ids not in sequences:
                    check_token_ids("bad_words entry", ids, self.info.vocab_size)
                    sequences.append(ids)
        return sequences


def _derived(params: SamplingParams, **changes: Any) -> SamplingParams:
    """A copy of validated params with changes that are valid by construction: no
    second validation (msgspec.structs.replace would run __post_init__ again)."""
    derived = copy.copy(params)
    for name, value in changes.items():
        setattr(derived, name, value)
    return derived


def _child_seed(seed: int | None, index: int) -> int | None:
    """Completion `index` samples with seed + index, wrapped into int64."""
    if seed is None:
        return None
    return (seed + index - INT64_MIN) % 2**64 + INT64_MIN
