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
from executor.sampler import (
    LogprobsTensors,
    Penalties,
    Sampler,
    SamplingMetadata,
    gather_logprobs,
    mix_seed,
)
from protocol.messages import TokenLogprobs
from protocol.scheduling import ModelRunnerOutput, PromptLogprobsChunk, SchedulerOutput


@dataclass
class _StepInputs:
    req_ids: list[str]
    rows: np.ndarray  # [R] InputBatch row of each request
    starts: np.ndarray  # [R] computed tokens before this step
    counts: np.ndarray  # [R] tokens computed this step
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sampling: np.ndarray  # indices into req_ids of the requests that sample
    sampling_rows: np.ndarray  # their InputBatch rows


class ModelRunner:
    def __init__(self, model_config: ModelConfig, device: torch.device, block_size: int,
                 max_num_seqs: int, seed: int, attention_backend: str = "auto",
                 logprobs_mode: str = "raw_logprobs") -> None:
        self.model_config = model_config
        self.processed_logprobs = logprobs_mode == "processed_logprobs"
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
        logprobs: dict[str, TokenLogprobs] = {}
        if len(inputs.sampling):
            meta = self._sampling_metadata(inputs.sampling_rows)
            out = self.sampler(logits, meta)
            sampled_np = out.sampled.cpu().numpy()  # the step's one host sync
            self.batch.append_tokens(inputs.sampling_rows, sampled_np)
            for i, token_id in zip(inputs.sampling.tolist(), sampled_np.tolist(),
                                   strict=True):
                sampled_token_ids[i] = [token_id]
            if out.logprobs is not None and meta.logprob_rows is not None:
                logprobs = self._logprobs_by_request(inputs, meta.logprob_rows, out.logprobs)
        prompt_logprobs = self._prompt_logprobs(hidden, inputs) \
            if self.batch.num_prompt_logprobs else {}
        t3 = time.perf_counter()
        return ModelRunnerOutput(inputs.req_ids, sampled_token_ids, logprobs, prompt_logprobs,
                                 prepare_inputs_s=t1 - t0, forward_s=t2 - t1,
                                 sample_s=t3 - t2)

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
        return _StepInputs(req_ids, rows, starts, counts, _to(input_ids, dev),
                           _to(positions, dev), meta, _to(cu[sampling] - 1, dev), sampling,
                           rows[sampling])

    def _sampling_metadata(self, rows: np.ndarray) -> SamplingMetadata:
        """Per-row parameters for the sampling rows (batch rows `rows`, sampler rows
        0..S-1), gathered from the batch; what no row needs stays None."""
        batch, dev = self.batch, self.device
        temperature = batch.temperature[rows]
        random = temperature > 0
        top_k, top_p, min_p = batch.top_k[rows], batch.top_p[rows], batch.min_p[rows]
        row_list = rows.tolist()
        meta = SamplingMetadata(
            temperature=_to(temperature, dev), all_greedy=not random.any(),
            any_greedy=not random.all(),
            top_k=_to(top_k, dev) if (top_k[random] < batch.vocab_size).any() else None,
            top_p=_to(top_p, dev) if (top_p[random] < 1.0).any() else None,
            min_p=_to(min_p, dev) if (min_p[random] > 0.0).any() else None,
            processed_logprobs=self.processed_logprobs)
        if batch.seeds:
            meta.seeds = {i: mix_seed(batch.seeds[r], int(batch.num_tokens[r]))
                          for i, r in enumerate(row_list) if r in batch.seeds}
        banned = self._banned_tokens(row_list)
        if banned:
            meta.banned = (_to(np.array([i for i, _ in banned]), dev),
                           _to(np.array([t for _, t in banned]), dev))
        if batch.allowed:
            pairs = [(i, t) for i, r in enumerate(row_list) for t in batch.allowed.get(r, ())]
            if pairs:
                meta.allowed = (_to(np.array([i for i, _ in pairs]), dev),
                                _to(np.array([t for _, t in pairs]), dev))
        if batch.logit_bias:
            triples = [(i, t, b) for i, r in enumerate(row_list)
                       for t, b in batch.logit_bias.get(r, {}).items()]
            if triples:
                meta.logit_bias = (_to(np.array([i for i, _, _ in triples]), dev),
                                   _to(np.array([t for _, t, _ in triples]), dev),
                                   _to(np.array([b for _, _, b in triples], np.float32), dev))
        if batch.penalized:
            meta.penalties = self._penalties([(i, r) for i, r in enumerate(row_list)
                                              if r in batch.penalized])
        if batch.num_logprobs:
            which = [i for i, r in enumerate(row_list) if r in batch.num_logprobs]
            if which:
                meta.logprob_rows = _to(np.array(which), dev)
                meta.num_logprobs = max(batch.num_logprobs[row_list[i]] for i in which)
        return meta

    def _banned_tokens(self, rows: list[int]) -> list[tuple[int, int]]:
        """(sampler row, token) pairs masked this step: EOS and stop ids before
        min_tokens, and the last token of any bad word whose other tokens end the
        output so far."""
        batch = self.batch
        banned: list[tuple[int, int]] = []
        if not (batch.stop_ids or batch.bad_words):
            return banned
        for i, r in enumerate(rows):
            num_output = int(batch.num_tokens[r] - batch.num_prompt_tokens[r])
            if r in batch.stop_ids and num_output < batch.min_tokens[r]:
                banned += [(i, t) for t in batch.stop_ids[r]]
            for word in batch.bad_words.get(r, ()):
                prefix = len(word) - 1
                end = int(batch.num_tokens[r])
                if prefix <= num_output and (prefix == 0 or batch.token_ids[
                        r, end - prefix:end].tolist() == word[:-1]):
                    banned.append((i, word[-1]))
        return banned

    def _penalties(self, which: list[tuple[int, int]]) -> Penalties:
        """Prompt masks and output counts [P, V] for the penalized rows, built by
        scatters over padded token arrays (one extra column takes the padding)."""
        batch, dev, vocab = self.batch, self.device, self.batch.vocab_size
        rows = np.array([r for _, r in which])
        prompt_lens = batch.num_prompt_tokens[rows]
        output_lens = batch.num_tokens[rows] - prompt_lens
        width_p, width_o = int(prompt_lens.max()), max(int(output_lens.max()), 1)
        prompt = np.full((len(rows), width_p), vocab, dtype=np.int64)
        output = np.full((len(rows), width_o), vocab, dtype=np.int64)
        for j, r in enumerate(rows.tolist()):
            prompt[j, :prompt_lens[j]] = batch.token_ids[r, :prompt_lens[j]]
            output[j, :output_lens[j]] = batch.token_ids[r, prompt_lens[j]:batch.num_tokens[r]]
        prompt_mask = torch.zeros(len(rows), vocab + 1, dtype=torch.bool, device=dev)
        prompt_mask.scatter_(1, _to(prompt, dev), True)
        counts = torch.zeros(len(rows), vocab + 1, dtype=torch.float32, device=dev)
        counts.scatter_add_(1, _to(output, dev), torch.ones(output.shape, device=dev))
        return Penalties(rows=_to(np.array([i for i, _ in which]), dev),
                         presence=_to(batch.presence[rows], dev),
                         frequency=_to(batch.frequency[rows], dev),
                         repetition=_to(batch.repetition[rows], dev),
                         prompt_mask=prompt_mask[:, :vocab], output_counts=counts[:, :vocab])

    def _logprobs_by_request(self, inputs: _StepInputs, logprob_rows: torch.Tensor,
                             tensors: LogprobsTensors) -> dict[str, TokenLogprobs]:
        ids, lps = tensors.token_ids.tolist(), tensors.logprobs.tolist()
        ranks = tensors.sampled_ranks.tolist()
        result = {}
        for j, i in enumerate(logprob_rows.tolist()):
            k = self.batch.num_logprobs[int(inputs.sampling_rows[i])]
            req_id = inputs.req_ids[int(inputs.sampling[i])]
            result[req_id] = TokenLogprobs(ids[j][:k + 1], lps[j][:k + 1],
                                           [ranks[j], *range(1, k + 1)])
        return result

    def _prompt_logprobs(self, hidden: torch.Tensor, inputs: _StepInputs
                         ) -> dict[str, PromptLogprobsChunk]:
        """Logprobs of the prompt's own next tokens at the prompt positions computed
        this step (from the raw logits), for the requests that asked."""
        batch = self.batch
        result = {}
        offsets = np.cumsum(inputs.counts) - inputs.counts
        for i, row in enumerate(inputs.rows.tolist()):
            k = batch.num_prompt_logprobs.get(row)
            if k is None:
                continue
            start = int(inputs.starts[i])
            end = min(start + int(inputs.counts[i]), int(batch.num_prompt_tokens[row]) - 1)
            if end <= start:
                continue
            flat = torch.arange(end - start, device=hidden.device) + int(offsets[i])
            logprobs = self.model.compute_logits(hidden[flat]).float().log_softmax(dim=-1)
            targets = _to(batch.token_ids[row, start + 1:end + 1].astype(np.int64),
                          self.device)
            t = gather_logprobs(logprobs, targets, k)
            ids, lps, ranks = t.token_ids.tolist(), t.logprobs.tolist(), t.sampled_ranks.tolist()
            result[inputs.req_ids[i]] = PromptLogprobsChunk(start, [
                TokenLogprobs(ids[j], lps[j], [ranks[j], *range(1, k + 1)])
                for j in range(end - start)])
        return result


def _to(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """Host array -> tensor on `device` (no copy on the CPU)."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    return tensor if device.type == "cpu" else tensor.to(device, non_blocking=True)
