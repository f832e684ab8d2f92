"""The engine core's per-request state."""

from __future__ import annotations

import enum
import functools
from typing import TYPE_CHECKING

from pagellm.enginecore.block_hash import BlockHash, extend_block_hashes
from pagellm.protocol.lora import LoRARequest
from pagellm.protocol.messages import EngineCoreRequest, FinishReason
from pagellm.protocol.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagellm.enginecore.structured_output.request_grammar import RequestGrammar


@functools.lru_cache(maxsize=256)
def _shared(ids: frozenset[int]) -> frozenset[int]:
    """One object for equal sets (most requests stop on the same EOS): the update
    tests every sampled token against its request's set, and a set shared by all of
    them stays in the cache. Bounded, so distinct sets from clients cannot grow it."""
    return ids


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED = 3
    WAITING_FOR_FSM = 4  # its grammar compiles; not in the scheduler yet (vLLM's name)


class Request:
    """A request's tokens and progress.

    `num_computed_tokens` counts tokens whose KV is in the cache; the scheduler's whole
    job is to move it toward `num_tokens` (prompt plus output) step by step. A prompt,
    a chunk of a prompt and a decode token are all just "tokens not yet computed".
    Slots, not a __dict__: the scheduler reads a few of these fields of every running
    request every step, right after a forward pass has pushed them out of the caches.
    """

    __slots__ = ("arrival_time", "bad_words_token_ids", "block_hashes",
                 "block_size", "cache_salt", "client_index", "eos_token_id",
                 "finish_reason", "grammar", "kv_fits", "lora_key", "lora_request", "max_tokens",
                 "min_tokens",
                 "num_cached_tokens",
                 "num_computed_tokens", "num_output_placeholders",
                 "num_prompt_logprobs_sent", "num_tokens",
                 "output_token_ids", "priority", "prompt_token_ids", "request_id",
                 "sampling_params", "spec_token_ids", "status", "stop_reason",
                 "stop_token_ids", "stopping_ids", "token_bytes")

    def __init__(self, request_id: str, prompt_token_ids: list[int],
                 sampling_params: SamplingParams, eos_token_id: int | None,
                 arrival_time: float = 0.0, priority: int = 0,
                 block_size: int | None = None, cache_salt: str | None = None,
                 client_index: int = 0, bad_words_token_ids: list[list[int]] | None = None,
                 lora_key: tuple[int, int] | None = None) -> None:
        """With a block_size, the hashes of its full blocks are kept up to date (prefix
        caching): the prompt's here, once, and each output block as it fills.
        `client_index` is the frontend it came from, as the engine core's socket knows
        it (never a field the client writes): its outputs go there. `lora_key`: its
        adapter's (lora_int_id, generation), None for the base model (`rehash`)."""
        if sampling_params.max_tokens is None:
            raise ValueError("max_tokens must be resolved before the engine core")
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time
        self.priority = priority
        self.client_index = client_index
        self.bad_words_token_ids = bad_words_token_ids
        self.max_tokens: int = sampling_params.max_tokens
        self.min_tokens: int = sampling_params.min_tokens
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids or ())
        # Every token that can end the request before max_tokens (EOS unless ignored):
        # the one membership test most steps need (Scheduler.update_from_output).
        self.stopping_ids = _shared(self.stop_token_ids | (
            {eos_token_id} if eos_token_id is not None and not sampling_params.ignore_eos
            else set()))
        self.output_token_ids: list[int] = []
        self.num_tokens = len(prompt_token_ids)  # prompt + output
        self.num_computed_tokens = 0
        # Scheduled steps that sample for it whose tokens have not come back yet. The
        # token a step samples is the next step's input, so with asynchronous
        # scheduling (a step scheduled while the one before runs) the request is
        # scheduled that far past `num_tokens`; the runner has the tokens.
        self.num_output_placeholders = 0
        # The context length up to which the KV cache manager has nothing to do for it
        # (every slot held, no block to fill), set by each allocation: the scheduler
        # calls `allocate_slots` only past it (a compare instead of a call, for every
        # running request every step).
        self.kv_fits = -1
        # A draft model's proposals for the next decode step (speculative decoding).
        self.spec_token_ids: list[int] = []
        # Its tokens as 4-byte ints, kept up to date by the n-gram proposer (None: none).
        self.token_bytes: bytearray | None = None
        # Tokens the prefix cache held when first scheduled (None: not yet scheduled).
        self.num_cached_tokens: int | None = None
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        self.num_prompt_logprobs_sent = 0  # prompt positions whose logprobs went out
        # Structured outputs: its matcher (a RequestGrammar, set once compiled), which
        # the scheduler advances with each sampled token. None: unconstrained.
        self.grammar: RequestGrammar | None = None
        if sampling_params.structured_outputs is not None:
            self.status = RequestStatus.WAITING_FOR_FSM
        self.block_size = block_size
        self.cache_salt = cache_salt
        self.lora_key = lora_key
        self.lora_request: LoRARequest | None = None  # as the client sent it
        self.block_hashes: list[BlockHash] = []
        self.rehash(lora_key)

    @property
    def lora_int_id(self) -> int:
        """Its adapter (0: the base model)."""
        return 0 if self.lora_key is None else self.lora_key[0]

    def rehash(self, lora_key: tuple[int, int] | None) -> None:
        """Hash the prompt's blocks for this adapter generation (before scheduling: an
        adapter replaced since the request was hashed has a new one)."""
        self.lora_key = lora_key
        self.block_hashes = []
        if self.block_size is not None:
            extend_block_hashes(self.block_hashes, self.prompt_token_ids, self.block_size,
                                self.cache_salt, lora_key=lora_key)

    @classmethod
    def from_engine_core_request(cls, req: EngineCoreRequest, block_size: int | None = None,
                                 client_index: int = 0,
                                 lora_key: tuple[int, int] | None = None) -> Request:
        request = cls(req.request_id, req.prompt_token_ids, req.sampling_params,
                      req.eos_token_id, req.arrival_time, req.priority, block_size,
                      req.cache_salt, client_index, req.bad_words_token_ids, lora_key)
        request.lora_request = req.lora_request
        return request

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_output_token_id(self, token_id: int) -> None:
        output = self.output_token_ids
        output.append(token_id)
        self.num_tokens += 1
        bs = self.block_size
        if bs is not None and self.num_tokens % bs == 0:  # a block just filled: hash it
            # Its tokens: the output's last, after the prompt's last if the output is short.
            block = output[-bs:] if len(output) >= bs else \
                self.prompt_token_ids[len(output) - bs:] + output
            extend_block_hashes(self.block_hashes, block, bs, self.cache_salt,
                                offset=self.num_tokens - bs, lora_key=self.lora_key)

    def finish(self, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens})")
