"""The model runner: turns a `SchedulerOutput` into one forward pass and sampled ids.

Per-request state persists between steps in an `InputBatch` (vLLM's persistent
batch): token ids, block table and progress arrive once, then only changes; tokens it
samples are appended to its own copy, so a decode step needs no token ids from the
scheduler. Each step builds one flat, unpadded batch (requests in the order cached,
then new) with vectorized numpy:

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

import numpy as np
import torch

from executor.attention import AttentionMetadata, get_attention_backend, num_kv_segments
from executor.config import ModelConfig
from executor.input_batch import InputBatch
from executor.loader import load_model
from executor.sampler import Sampler, SamplingMetadata, mix_seed
from protocol.scheduling import ModelRunnerOutput, SchedulerOutput


@dataclass
class _StepInputs:
    req_ids: list[str]
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sampling: np.ndarray  # indices into req_ids of the requests that sample
    sampling_rows: np.ndarray  # their InputBatch rows


class ModelRunner:
    def __init__(self, model_config: ModelConfig, device: torch.device, block_size: int,
                 max_num_seqs: int, seed: int, attention_backend: str = "auto") -> None:
        self.model_config = model_config
        self.device = device
        self.block_size = block_size
        self.attention = get_attention_backend(attention_backend, device)
        if self.attention.name == "triton":
            from kernels.triton_attention import SUPPORTED_BLOCK_SIZES, SUPPORTED_HEAD_SIZES

            if block_size not in SUPPORTED_BLOCK_SIZES:
                raise ValueError(f"block_size={block_size} is not supported by the Triton "
                                 f"attention kernels (supported: {SUPPORTED_BLOCK_SIZES})")
            if model_config.spec.head_dim not in SUPPORTED_HEAD_SIZES:
                raise ValueError(f"head_dim={model_config.spec.head_dim} is not supported by "
                                 f"the Triton attention kernels ({SUPPORTED_HEAD_SIZES}); use "
                                 "attention_backend='torch'")
        self.num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
                        if device.type == "cuda" else 0)
        self.model = load_model(model_config, device)
        self.sampler = Sampler(device, seed)
        self.batch = InputBatch(max_num_seqs, model_config.max_model_len, block_size,
                                model_config.vocab_size)
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
        sampled_token_ids: list[list[int]] = [[] for _ in inputs.req_ids]
        if len(inputs.sampling):
            sampled = self.sampler(logits, self._sampling_metadata(inputs.sampling_rows))
            sampled_np = sampled.cpu().numpy()  # the step's one host sync
            self.batch.append_tokens(inputs.sampling_rows, sampled_np)
            for i, token_id in zip(inputs.sampling.tolist(), sampled_np.tolist(),
                                   strict=True):
                sampled_token_ids[i] = [token_id]
        t3 = time.perf_counter()
        return ModelRunnerOutput(inputs.req_ids, sampled_token_ids, prepare_inputs_s=t1 - t0,
                                 forward_s=t2 - t1, sample_s=t3 - t2)

    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.batch
        for req_id in so.finished_req_ids:
            batch.remove(req_id)
        for req_id in so.preempted_req_ids:
            batch.remove(req_id)
        for new in so.scheduled_new_reqs:
            batch.add(new)
        for cached in so.scheduled_cached_reqs:
            row = batch.rows[cached.req_id]
            if cached.new_block_ids:
                batch.append_blocks(row, cached.new_block_ids)
            batch.num_computed_tokens[row] = cached.num_computed_tokens

    def _prepare_inputs(self, so: SchedulerOutput) -> _StepInputs:
        batch, bs = self.batch, self.block_size
        req_ids = [c.req_id for c in so.scheduled_cached_reqs]
        req_ids += [n.req_id for n in so.scheduled_new_reqs]
        num_reqs = len(req_ids)
        rows = np.fromiter((batch.rows[r] for r in req_ids), np.int64, num_reqs)
        counts = np.fromiter((so.num_scheduled_tokens[r] for r in req_ids), np.int64,
                             num_reqs)
        starts = batch.num_computed_tokens[rows].astype(np.int64)
        ends = starts + counts
        cu = np.cumsum(counts)
        req_index = np.repeat(np.arange(num_reqs), counts)  # [T] request of each token
        positions = starts[req_index] + np.arange(cu[-1]) - (cu - counts)[req_index]
        input_ids = batch.token_ids[rows[req_index], positions].astype(np.int64)
        block_tables = batch.block_table[rows, :batch.num_blocks[rows].max()]
        slot_mapping = (block_tables[req_index, positions // bs].astype(np.int64) * bs
                        + positions % bs)
        batch.num_computed_tokens[rows] = ends
        sampling = np.flatnonzero(ends == batch.num_tokens[rows])  # caught up: sample
        query_start_loc = np.concatenate(([0], cu))

        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=_to(slot_mapping, dev), block_tables=_to(block_tables, dev),
            query_start_loc=_to(query_start_loc.astype(np.int32), dev),
            seq_lens=_to(ends.astype(np.int32), dev),
            query_start_loc_cpu=query_start_loc.tolist(), seq_lens_cpu=ends.tolist(),
            max_query_len=int(counts.max()), max_seq_len=int(ends.max()),
            backend=self.attention,
            num_segments=num_kv_segments(num_reqs, self.model_config.spec.num_kv_heads,
                                         int(counts.max()), int(ends.max()), self.num_sms))
        return _StepInputs(req_ids, _to(input_ids, dev), _to(positions, dev), meta,
                           _to(cu[sampling] - 1, dev), sampling, rows[sampling])

    def _sampling_metadata(self, rows: np.ndarray) -> SamplingMetadata:
        """Per-row parameters for the sampling rows, gathered from the batch; a mask
        nobody needs stays None."""
        batch, dev = self.batch, self.device
        temperature = batch.temperature[rows]
        random = temperature > 0
        top_k = batch.top_k[rows]
        top_p = batch.top_p[rows]
        min_p = batch.min_p[rows]
        seeds = {}
        if batch.seeds:
            seeds = {i: mix_seed(batch.seeds[r], int(batch.num_tokens[r]))
                     for i, r in enumerate(rows.tolist()) if r in batch.seeds}
        banned = []
        if batch.stop_ids:
            outputs = batch.num_tokens[rows] - batch.num_prompt_tokens[rows]
            for i, r in enumerate(rows.tolist()):
                if r in batch.stop_ids and outputs[i] < batch.min_tokens[r]:
                    banned.append((i, batch.stop_ids[r]))
        return SamplingMetadata(
            temperature=_to(temperature, dev), all_greedy=not random.any(),
            any_greedy=not random.all(),
            top_k=_to(top_k, dev) if (top_k[random] < self.batch.vocab_size).any() else None,
            top_p=_to(top_p, dev) if (top_p[random] < 1.0).any() else None,
            min_p=_to(min_p, dev) if (min_p[random] > 0.0).any() else None,
            seeds=seeds, banned=banned)


def _to(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """Host array -> tensor on `device` (no copy on the CPU)."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    return tensor if device.type == "cpu" else tensor.to(device, non_blocking=True)
