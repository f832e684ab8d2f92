"""The model runner: turns a `SchedulerOutput` into one forward pass and sampled ids.

It keeps per-request state between steps (vLLM's persistent batch): token ids, block
table and progress arrive once, then only changes; tokens it samples are appended to
its own copy, so a decode step needs no token ids from the scheduler.

Each step builds one flat, unpadded batch (requests in the order cached, then new):

    input_ids     [T]            the tokens computed this step
    positions     [T]            their positions in their requests
    slot_mapping  [T]            block_id * block_size + offset of each token's KV
    block_tables  [R, max_blk]   each request's blocks (rows zero-padded)
    query_start_loc [R + 1]      request i owns rows query_start_loc[i]:[i+1]
    seq_lens      [R]            context length after this step
    logits_indices [S]           last row of each request that samples this step
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from executor.attention import AttentionMetadata
from executor.config import ModelConfig
from executor.loader import load_model
from executor.sampler import Sampler, SamplingMetadata, mix_seed
from protocol.sampling_params import GREEDY_TEMPERATURE, SamplingParams
from protocol.scheduling import ModelRunnerOutput, SchedulerOutput


@dataclass
class CachedRequestState:
    req_id: str
    token_ids: list[int]  # prompt + output so far
    num_prompt_tokens: int
    sampling_params: SamplingParams
    eos_token_id: int | None
    block_ids: list[int]
    num_computed_tokens: int

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass
class _StepInputs:
    req_ids: list[str]
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sampling_rows: list[int]  # index into req_ids of each request that samples


class ModelRunner:
    def __init__(self, model_config: ModelConfig, device: torch.device, block_size: int,
                 seed: int) -> None:
        self.model_config = model_config
        self.device = device
        self.block_size = block_size
        self.model = load_model(model_config, device)
        self.sampler = Sampler(device, seed)
        self.requests: dict[str, CachedRequestState] = {}
        self.kv_caches: list[torch.Tensor] = []

    # -- KV cache ------------------------------------------------------------------

    def kv_cache_bytes_per_block(self) -> int:
        spec = self.model_config.spec
        element = torch.empty((), dtype=self.model_config.dtype).element_size()
        return (spec.num_layers * 2 * self.block_size * spec.num_kv_heads * spec.head_dim
                * element)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        spec = self.model_config.spec
        # [layers, K|V, blocks, block_size, kv_heads, head_dim]. Not zeroed (on the CPU
        # pages are committed as blocks get used): no kernel reads a slot its request has
        # not written.
        cache = torch.empty(spec.num_layers, 2, num_blocks, self.block_size, spec.num_kv_heads,
                            spec.head_dim, dtype=self.model_config.dtype, device=self.device)
        self.kv_caches = list(cache.unbind(0))

    # -- one step ------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        t0 = time.perf_counter()
        self._update_states(scheduler_output)
        if scheduler_output.is_empty:
            return ModelRunnerOutput([], [])
        inputs = self._prepare_inputs(scheduler_output)
        t1 = time.perf_counter()
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches)
        logits = self.model.compute_logits(hidden[inputs.logits_indices])  # [S, V]
        t2 = time.perf_counter()
        sampled: list[int] = []
        if inputs.sampling_rows:
            meta = self._sampling_metadata(inputs)
            sampled = self.sampler(logits, meta).tolist()  # the step's one host sync
        sampled_token_ids: list[list[int]] = [[] for _ in inputs.req_ids]
        for row, token_id in zip(inputs.sampling_rows, sampled, strict=True):
            self.requests[inputs.req_ids[row]].token_ids.append(token_id)
            sampled_token_ids[row] = [token_id]
        t3 = time.perf_counter()
        return ModelRunnerOutput(inputs.req_ids, sampled_token_ids, prepare_inputs_s=t1 - t0,
                                 forward_s=t2 - t1, sample_s=t3 - t2)

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        for req_id in so.preempted_req_ids:
            self.requests.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id, token_ids=new.prompt_token_ids + new.output_token_ids,
                num_prompt_tokens=len(new.prompt_token_ids),
                sampling_params=new.sampling_params, eos_token_id=new.eos_token_id,
                block_ids=list(new.block_ids), num_computed_tokens=new.num_computed_tokens)
        for cached in so.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _prepare_inputs(self, so: SchedulerOutput) -> _StepInputs:
        req_ids = [c.req_id for c in so.scheduled_cached_reqs]
        req_ids += [n.req_id for n in so.scheduled_new_reqs]
        states = [self.requests[r] for r in req_ids]
        counts = [so.num_scheduled_tokens[r] for r in req_ids]
        starts = [s.num_computed_tokens for s in states]

        tokens: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        sampling_rows: list[int] = []
        for i, (state, start, count) in enumerate(zip(states, starts, counts, strict=True)):
            tokens += state.token_ids[start:start + count]
            query_start_loc.append(query_start_loc[-1] + count)
            seq_lens.append(start + count)
            state.num_computed_tokens = start + count
            if start + count == len(state.token_ids):  # caught up: sample the next token
                logits_indices.append(query_start_loc[-1] - 1)
                sampling_rows.append(i)

        max_blocks = max(len(s.block_ids) for s in states)
        block_tables = torch.zeros(len(states), max_blocks, dtype=torch.int32)
        for i, state in enumerate(states):
            block_tables[i, :len(state.block_ids)] = torch.tensor(state.block_ids,
                                                                  dtype=torch.int32)
        count_t = torch.tensor(counts)
        req_index = torch.repeat_interleave(torch.arange(len(states)), count_t)  # [T]
        offsets = torch.arange(len(tokens)) - torch.tensor(query_start_loc[:-1])[req_index]
        positions = torch.tensor(starts)[req_index] + offsets  # [T]
        block_ids = block_tables[req_index, positions // self.block_size].long()
        slot_mapping = block_ids * self.block_size + positions % self.block_size

        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=slot_mapping.to(dev),
            block_tables=block_tables.to(dev),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc_cpu=query_start_loc, seq_lens_cpu=seq_lens,
            max_query_len=max(counts), max_seq_len=max(seq_lens))
        return _StepInputs(req_ids, torch.tensor(tokens, dtype=torch.long, device=dev),
                           positions.to(dev), meta,
                           torch.tensor(logits_indices, dtype=torch.long, device=dev),
                           sampling_rows)

    def _sampling_metadata(self, inputs: _StepInputs) -> SamplingMetadata:
        states = [self.requests[inputs.req_ids[row]] for row in inputs.sampling_rows]
        params = [s.sampling_params for s in states]
        vocab = self.model_config.vocab_size
        greedy = [p.temperature < GREEDY_TEMPERATURE for p in params]
        temperature = [0.0 if g else p.temperature for g, p in zip(greedy, params, strict=True)]
        random_params = [p for g, p in zip(greedy, params, strict=True) if not g]
        top_k = top_p = min_p = None
        dev = self.device
        if any(p.top_k > 0 for p in random_params):
            top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=dev)
        if any(p.top_p < 1.0 for p in random_params):
            top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
        if any(p.min_p > 0.0 for p in random_params):
            min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev)
        seeds = {row: mix_seed(p.seed, len(s.token_ids))
                 for row, (s, p, g) in enumerate(zip(states, params, greedy, strict=True))
                 if p.seed is not None and not g}
        banned = []
        for row, state in enumerate(states):
            p = state.sampling_params
            if state.num_output_tokens < p.min_tokens:
                stop_ids = list(p.stop_token_ids or ())
                if state.eos_token_id is not None and not p.ignore_eos:
                    stop_ids.append(state.eos_token_id)
                if stop_ids:
                    banned.append((row, stop_ids))
        return SamplingMetadata(
            temperature=torch.tensor(temperature, dtype=torch.float32, device=dev),
            all_greedy=all(greedy), any_greedy=any(greedy), top_k=top_k, top_p=top_p,
            min_p=min_p, seeds=seeds, banned=banned)
