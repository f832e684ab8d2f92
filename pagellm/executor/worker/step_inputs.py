"""`InputPreparer`: one step's flat batch, built from the persistent `InputBatch`.

The model runner hands it each `SchedulerOutput` (after applying the step's changes to
the batch); it returns the step's `StepInputs`: one flat, unpadded batch (requests in the
order cached, then new; where the engine serves LoRA adapters, stably ordered by adapter
so that each adapter's rows are one run), built with vectorized numpy:

    input_ids     [T]            the tokens computed this step
    positions     [T]            their positions in their requests
    slot_mapping  [T]            block_id * block_size + offset of each token's KV
    block_tables  [R, max_blk]   each request's blocks (rows zero-padded)
    query_start_loc [R + 1]      request i owns rows query_start_loc[i]:[i+1]
    seq_lens      [R]            context length after this step
    logits_indices [S]           last row of each request that samples this step
                                 (with speculative decoding: its last 1 + k rows, the
                                 positions of its last token and of its k proposals)

They are staged through `StepBuffers` (pinned host memory, non-blocking copies into
device buffers allocated once). A step where every request computes one token, while
CUDA graphs exist, is padded to the next captured batch size (`DecodeGraphs`).

This runs on the host between two forward passes, every step: its own module so its
microsecond-level economies (cached rows, views of one arange) read apart from the
runner's flow.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from pagellm.executor.lora.manager import LoRAManager
from pagellm.executor.model.attention import AttentionBackend, AttentionMetadata, num_kv_segments
from pagellm.executor.worker.cuda_graphs import DecodeGraphs
from pagellm.executor.worker.input_batch import InputBatch
from pagellm.executor.worker.step_buffers import StepBuffers
from pagellm.protocol.scheduling import SchedulerOutput


@dataclass
class StepInputs:
    """One step's flat batch, on the device (staged through `StepBuffers`), with the
    host-side indices the runner needs after the forward pass."""


    req_ids: list[str]
    rows: np.ndarray  # [R] InputBatch row of each request
    starts: np.ndarray  # [R] computed tokens before this step
    counts: np.ndarray  # [R] tokens computed this step
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sampling: np.ndarray  # [S] indices into req_ids of the requests that sample
    sampling_rows: np.ndarray  # [S'] the InputBatch row of each sampled position
    # Speculative decoding (None in a step without proposals): per sampling request its
    # proposals' count k [S], and per sampled position [S'] (its request's 1 + k
    # positions in a row) its request's index into req_ids and its offset 0..k.
    num_drafts: np.ndarray | None
    sample_req: np.ndarray  # [S'] index into req_ids (= sampling without proposals)
    sample_offsets: np.ndarray | None
    graph_size: int | None  # the CUDA graph's batch size, or None: run eagerly
    attention_plan_s: float  # time in the attention backend's prepare


class InputPreparer:
    """Builds each step's `StepInputs` from the runner's batch and step buffers."""

    def __init__(self, batch: InputBatch, buffers: StepBuffers, attention: AttentionBackend,
                 block_size: int, max_num_seqs: int, num_kv_heads: int, num_sms: int,
                 lora: LoRAManager | None = None) -> None:
        """`num_sms`: the GPU's streaming multiprocessors (0 on the CPU), which size the
        split-KV segments. `lora`: the worker's adapters, where the engine serves them
        (each step's requests are then ordered by adapter: `_order_by_adapter`)."""
        self.batch = batch
        self.lora = lora
        self.buffers = buffers
        self.attention = attention
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.num_sms = num_sms
        # The last step's batch rows, valid while the batch's rows stay as they were.
        self._rows_generation = -1
        self._rows_req_ids: list[str] = []
        self._rows = np.zeros(0, np.int64)  # [R]
        # Read-only views of these serve every decode step's counts and offsets.
        self._arange = np.arange(max_num_seqs + 1)  # [max_num_seqs + 1] int64
        self._ones = np.ones(max_num_seqs, np.int64)
        self._arange.flags.writeable = self._ones.flags.writeable = False

    def prepare(self, so: SchedulerOutput, graphs: DecodeGraphs | None) -> StepInputs:
        """The step's flat batch. Every numpy call here costs microseconds more than its
        work (a forward pass has just pushed numpy's own state out of the caches), so a
        decode step, the common case, takes fewer: its counts, offsets and request index
        are views of one arange."""
        batch, bs = self.batch, self.block_size
        cached, new = so.scheduled_cached_reqs, so.scheduled_new_reqs
        req_ids = cached.req_ids + [n.req_id for n in new] if new else cached.req_ids
        num_reqs = len(req_ids)
        # Most steps run the same requests, in the same rows, as the last one.
        if batch.generation != self._rows_generation or req_ids != self._rows_req_ids:
            self._rows_generation, self._rows_req_ids = batch.generation, req_ids
            self._rows = np.fromiter(map(batch.rows.__getitem__, req_ids), np.int64, num_reqs)
        rows = self._rows
        if so.scheduled_spec_decode_tokens:  # proposals go where their tokens would be
            for req_id, drafts in so.scheduled_spec_decode_tokens.items():
                row = batch.rows[req_id]
                end = batch.num_tokens[row]
                batch.token_ids[row, end:end + len(drafts)] = drafts
        # The scheduler's count is the one truth (the batch keeps no copy to drift).
        starts = np.array(cached.num_computed_tokens + [n.num_computed_tokens for n in new]
                          if new else cached.num_computed_tokens, np.int64)
        lora_of = None
        if self.lora is not None:
            req_ids, rows, starts, lora_of = self._order_by_adapter(req_ids, rows, starts)
        num_tokens = so.total_num_scheduled_tokens
        decode = num_tokens == num_reqs  # one token each (counts are >= 1): a decode step
        if decode:
            arange = self._arange
            counts, cu = self._ones[:num_reqs], arange[1:num_reqs + 1]
            query_start_loc, req_index = arange[:num_reqs + 1], arange[:num_reqs]
            positions, ends = starts, starts + 1  # [T] = [R]
            input_ids = batch.token_ids[rows, starts]
        else:
            counts = np.fromiter(map(so.num_scheduled_tokens.__getitem__, req_ids), np.int64,
                                 num_reqs)
            cu = np.cumsum(counts)
            query_start_loc = np.concatenate(([0], cu))
            req_index = np.repeat(np.arange(num_reqs), counts)  # [T] request of each token
            positions = starts[req_index] + np.arange(num_tokens) - (cu - counts)[req_index]
            ends = starts + counts
            input_ids = batch.token_ids[rows[req_index], positions]
        # The slots from the gathered rows, not the whole table again (a forward pass has
        # just pushed it out of the cache: one miss per request each time).
        block_tables = batch.block_table[rows, :batch.num_blocks[rows].max()]
        block_index, offset = np.divmod(positions, bs)
        slot_mapping = (block_tables[req_index, block_index] * np.int64(bs)
                        + offset)  # int64: no overflow
        if self.lora is not None:
            self.lora.prepare_step(_adapter_runs(lora_of, counts, cu))
        # Caught up (past its tokens: proposals): sample.
        beyond = ends - batch.num_tokens[rows]
        sampling = np.flatnonzero(beyond >= 0)
        all_sample = len(sampling) == num_reqs
        logits_indices = req_index if all_sample and decode else cu[sampling] - 1
        sample_req, sampling_rows = sampling, rows if all_sample else rows[sampling]
        num_drafts = sample_offsets = None
        if so.scheduled_spec_decode_tokens:
            num_drafts = beyond[sampling]  # [S]
            width = num_drafts + 1
            sample_req = np.repeat(sampling, width)  # [S']
            sample_offsets = np.arange(int(width.sum())) - np.repeat(np.cumsum(width) - width,
                                                                     width)
            logits_indices = np.repeat(cu[sampling] - width, width) + sample_offsets
            sampling_rows = rows[sample_req]
        max_query_len = 1 if decode else int(counts.max())
        # Every request computes one token: a CUDA graph's step, padded to its size.
        graph_size = graphs.padded_size(num_reqs) if graphs is not None and decode else None
        put = self.buffers.put
        self.buffers.begin_step()
        if self.lora is not None and self.lora.batch.kernels:
            self._stage_lora_runs()
        meta = AttentionMetadata(
            slot_mapping=put("slot_mapping", slot_mapping, -1, graph_size),
            block_tables=put("block_tables", block_tables, 0, graph_size),
            # Graph padding rows continue the one-token-per-request pattern.
            query_start_loc=put("query_start_loc", self._arange[:graph_size + 1]
                                if graph_size else query_start_loc),
            seq_lens=put("seq_lens", ends, 0, graph_size),
            query_start_loc_cpu=query_start_loc, seq_lens_cpu=ends,
            max_query_len=max_query_len, backend=self.attention, request_rows=rows,
            num_segments=num_kv_segments(num_reqs, self.num_kv_heads, max_query_len,
                                         int(ends.max()), self.num_sms)
            if self.num_sms else 1)
        t_plan = time.perf_counter()
        self.attention.prepare(meta)
        attention_plan_s = time.perf_counter() - t_plan
        return StepInputs(req_ids, rows, starts, counts,
                          put("input_ids", input_ids, 0, graph_size),
                          put("positions", positions, 0, graph_size), meta,
                          put("logits_indices", logits_indices), sampling, sampling_rows,
                          num_drafts, sample_req, sample_offsets, graph_size,
                          attention_plan_s)

    def _stage_lora_runs(self) -> None:
        """Copy the step's (slot, start, end) runs to the kernels' device buffer, every
        step: a graph replays on whatever it holds (padding rows: (0, 0, 0), no run)."""
        assert self.lora is not None
        batch = self.lora.batch
        batch.launch = bool(batch.runs)
        self.buffers.put("lora_runs", np.array(batch.runs, np.int32).reshape(-1, 3), 0,
                         self.lora.max_loras)

    def _order_by_adapter(self, req_ids: list[str], rows: np.ndarray, starts: np.ndarray
                          ) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray | None]:
        """The step's requests ordered by adapter (stable; the base model's first), so
        that each adapter's tokens are one run of rows (model/lora_slots.py). Also returns each
        request's adapter id [R] (None: no adapter in the step)."""
        lora_of = self.batch.lora_ids[rows]  # [R]
        if not lora_of.any():
            return req_ids, rows, starts, None
        if (lora_of[1:] < lora_of[:-1]).any():
            order = np.argsort(lora_of, kind="stable")
            req_ids = [req_ids[i] for i in order.tolist()]
            rows, starts, lora_of = rows[order], starts[order], lora_of[order]
        return req_ids, rows, starts, lora_of


def _adapter_runs(lora_of: np.ndarray | None, counts: np.ndarray, cu: np.ndarray
                  ) -> list[tuple[int, int, int]]:
    """(adapter id, first row, end row) of each adapter's run of tokens, from requests
    ordered by adapter: lora_of [R], counts [R] tokens each, cu [R] their cumulative sum."""
    if lora_of is None:
        return []
    firsts = np.concatenate(([0], np.flatnonzero(lora_of[1:] != lora_of[:-1]) + 1))
    lasts = np.append(firsts[1:], len(lora_of)) - 1
    return [(lora_id, end - count, last_end)
            for lora_id, end, count, last_end in zip(
                lora_of[firsts].tolist(), cu[firsts].tolist(), counts[firsts].tolist(),
                cu[lasts].tolist(), strict=True) if lora_id != 0]
