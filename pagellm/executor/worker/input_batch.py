"""`InputBatch`: the model runner's persistent per-request state (vLLM's persistent
batch), in preallocated host arrays with one row per running request.

A request gets a row when it is scheduled new (or resumed) and keeps it until it
finishes or is preempted. Each step then touches only what changed (new blocks, one
sampled token per request) and builds the flat batch with a handful of vectorized
numpy operations instead of a Python loop per token:

    token_ids    [rows, max_model_len]   int32   prompt + output tokens
    block_table  [rows, max_blocks]      int32   the request's KV blocks
    num_tokens / num_blocks [rows]
    temperature / top_p / top_k / min_p  [rows]  sampling parameters
"""

from __future__ import annotations

import numpy as np

from pagellm.protocol.sampling_params import SamplingParams
from pagellm.protocol.scheduling import NewRequestData


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int,
                 vocab_size: int) -> None:
        max_blocks = -(-max_model_len // block_size)
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        self.block_table = np.zeros((max_num_reqs, max_blocks), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)
        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)  # 0: greedy
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)  # vocab size: off
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.min_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.presence = np.zeros(max_num_reqs, dtype=np.float32)
        self.frequency = np.zeros(max_num_reqs, dtype=np.float32)
        self.repetition = np.ones(max_num_reqs, dtype=np.float32)
        self.lora_ids = np.zeros(max_num_reqs, dtype=np.int64)  # 0: the base model
        # Per row, Python-side: rarely used fields, keyed by row.
        self.seeds: dict[int, int] = {}
        self.stop_ids: dict[int, list[int]] = {}  # EOS + stop ids, banned before min_tokens
        self.penalized: set[int] = set()
        self.logit_bias: dict[int, dict[int, float]] = {}
        self.allowed: dict[int, list[int]] = {}
        self.bad_words: dict[int, BadWords] = {}
        self.num_logprobs: dict[int, int] = {}
        self.num_prompt_logprobs: dict[int, int] = {}
        self._optional = (self.seeds, self.stop_ids, self.logit_bias, self.allowed,
                          self.bad_words, self.num_logprobs, self.num_prompt_logprobs)
        self.rows: dict[str, int] = {}
        self.generation = 0  # bumped whenever `rows` changes
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))

    def add(self, new: NewRequestData) -> int:
        row = self._free_rows.pop()
        self.rows[new.req_id] = row
        self.generation += 1
        prompt, output = new.prompt_token_ids, new.output_token_ids
        n = len(prompt) + len(output)
        self.token_ids[row, :len(prompt)] = prompt
        self.token_ids[row, len(prompt):n] = output
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = len(prompt)
        self.num_blocks[row] = 0
        self.lora_ids[row] = new.lora_int_id
        self.append_blocks(row, new.block_ids)
        self._set_sampling(row, new.sampling_params, new.eos_token_id)
        if new.bad_words_token_ids:
            self.bad_words[row] = group_bad_words(new.bad_words_token_ids)
        return row

    def remove(self, req_id: str) -> None:
        row = self.rows.pop(req_id, None)
        if row is not None:
            self.generation += 1
            for table in self._optional:
                table.pop(row, None)
            self.penalized.discard(row)
            self._free_rows.append(row)

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        start = self.num_blocks[row]
        self.block_table[row, start:start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def append_tokens(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """One sampled token per row."""
        self.token_ids[rows, self.num_tokens[rows]] = token_ids
        self.num_tokens[rows] += 1

    def _set_sampling(self, row: int, params: SamplingParams, eos_token_id: int | None
                      ) -> None:
        greedy = params.greedy
        self.temperature[row] = 0.0 if greedy else params.temperature
        self.top_p[row] = params.top_p
        # top_k beyond the vocabulary means "all of it": off, like 0 and -1.
        self.top_k[row] = min(params.top_k, self.vocab_size) if params.top_k > 0 \
            else self.vocab_size
        self.min_p[row] = params.min_p
        self.min_tokens[row] = params.min_tokens
        if params.seed is not None and not greedy:
            self.seeds[row] = params.seed
        stop = list(params.stop_token_ids or ())
        if eos_token_id is not None and not params.ignore_eos:
            stop.append(eos_token_id)
        if params.min_tokens and stop:
            self.stop_ids[row] = stop
        self.presence[row] = params.presence_penalty
        self.frequency[row] = params.frequency_penalty
        self.repetition[row] = params.repetition_penalty
        if (params.presence_penalty or params.frequency_penalty
                or params.repetition_penalty != 1.0):
            self.penalized.add(row)
        if params.logit_bias:
            self.logit_bias[row] = params.logit_bias
        if params.allowed_token_ids:
            self.allowed[row] = params.allowed_token_ids
        if params.logprobs is not None:
            self.num_logprobs[row] = params.logprobs
        if params.prompt_logprobs is not None:
            self.num_prompt_logprobs[row] = params.prompt_logprobs


# A request's bad words, grouped for the per-step check: prefix length -> the prefix
# (the tokens that must end the output) -> the last tokens it bans. Checking one output
# costs a lookup per distinct word length, not a comparison per word (1024 words were
# ~2 ms per request per step, for every request in the batch).
BadWords = dict[int, dict[tuple[int, ...], list[int]]]


def group_bad_words(words: list[list[int]]) -> BadWords:
    grouped: BadWords = {}
    for word in words:
        banned = grouped.setdefault(len(word) - 1, {}).setdefault(tuple(word[:-1]), [])
        if word[-1] not in banned:
            banned.append(word[-1])
    return grouped
