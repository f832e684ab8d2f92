"""What the scheduler hands the executor, and what comes back.

These are protocol Structs (not torch objects) because with tensor parallelism the
executor's workers live in other processes and receive them over the wire.

The model runner keeps per-request state between steps (vLLM's persistent batch): a
request is sent in full once (`NewRequestData`, also when it resumes after a
preemption, with the tokens it had generated), and afterwards only what changed
(`CachedRequestData`). The runner appends the tokens it samples to its own copy.
"""

from __future__ import annotations

import msgspec

from pagellm.protocol.messages import TokenLogprobs
from pagellm.protocol.sampling_params import SamplingParams


class NewRequestData(msgspec.Struct, array_like=True, gc=False):
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty only when resuming after a preemption
    sampling_params: SamplingParams
    eos_token_id: int | None
    block_ids: list[int]  # the request's whole block table
    num_computed_tokens: int  # tokens whose KV is already in the cache
    bad_words_token_ids: list[list[int]] | None = None
    lora_int_id: int = 0  # its adapter (added to the workers before), 0: the base model


class CachedRequestData(msgspec.Struct, array_like=True, gc=False):
    """The running requests scheduled again this step, as parallel lists: one Struct
    per step rather than one per request (the scheduler fills it for every running
    request every step, and the runner reads the lists whole)."""

    req_ids: list[str]
    num_computed_tokens: list[int]  # per request, tokens whose KV is in the cache
    # Only the requests that grew this step: blocks appended to their block tables.
    new_block_ids: dict[str, list[int]]

    @classmethod
    def empty(cls) -> CachedRequestData:
        return cls([], [], {})


class GrammarOutput(msgspec.Struct, array_like=True, gc=False):
    """The token bitmask of a step's constrained requests that sample in it: without
    proposals row i is `req_ids[i]`'s, ceil(vocab_size / 32) int32 words (native byte
    order), bit j set where token j is allowed. Built by the engine core's StructuredOutputManager,
    applied to the logits by the worker before sampling."""

    req_ids: list[str]
    bitmask: bytes  # [rows, ceil(V / 32)] int32
    # Speculative decoding: each request's rows (1 + its proposals: one per position it
    # samples, in order); empty when every request has one.
    num_rows: list[int] = []


class SchedulerOutput(msgspec.Struct, array_like=True, gc=False):
    """One step's work. Requests run in the order cached, then new."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]  # req_id -> tokens computed this step
    total_num_scheduled_tokens: int
    finished_req_ids: list[str]  # finished or aborted since the last step: forget them
    preempted_req_ids: list[str]  # preempted since the last step: forget them too
    grammar: GrammarOutput | None = None  # set by the engine core after scheduling
    # Speculative decoding: req_id -> the proposed tokens scheduled after its last token
    # (counted in num_scheduled_tokens), which the runner verifies.
    scheduled_spec_decode_tokens: dict[str, list[int]] = {}
    # Speculative decoding with a draft model: the runner drafts the next step's proposals
    # for the requests that sample in this one (the scheduler's batch-size rule says when).
    propose_drafts: bool = False

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


class PromptLogprobsChunk(msgspec.Struct, array_like=True, gc=False):
    """Prompt logprobs computed in one step: entry j is for prompt position start + j
    (predicting prompt token start + j + 1)."""

    start: int
    logprobs: list[TokenLogprobs]


class ModelRunnerOutput(msgspec.Struct, array_like=True, gc=False):
    """Per scheduled request, the token it sampled (-1: none, a partial prefill), and
    logprobs for the requests that asked for them. One int per request, not a list:
    the scheduler reads it for every running request every step; the few that emit more
    (speculative decoding) have the rest in `more_token_ids`."""

    req_ids: list[str]
    sampled_token_ids: list[int]
    logprobs: dict[str, TokenLogprobs] = {}
    prompt_logprobs: dict[str, PromptLogprobsChunk] = {}
    prepare_inputs_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    collective_s: float = 0.0  # of forward_s and sample_s: tensor-parallel collectives
    dispatch_s: float = 0.0  # executor <-> worker processes, beyond the worker's time
    attention_plan_s: float = 0.0  # of prepare_inputs_s: the attention backend's prepare
    # Speculative decoding: the tokens a request emitted after its first (the accepted
    # proposals after the first, then the sample that ended the run), and their logprobs.
    more_token_ids: dict[str, list[int]] = {}
    more_logprobs: dict[str, list[TokenLogprobs]] = {}
    # Speculative decoding with a draft model: each sampling request's proposals for its
    # next step (drafted after this step's tokens), when the step asked for them.
    draft_token_ids: dict[str, list[int]] = {}
