"""Speculative decoding's draft model: a smaller model of the same vocabulary proposes
each request's next k tokens, greedily, one token at a time (`speculative_config`
method "draft_model").

Its paged KV cache is indexed by the target's block tables: each block the scheduler
gives a request holds the draft's keys and values at the same slots, in a cache of the
draft's own shape (a block's bytes count both: `ModelRunner.kv_cache_bytes_per_block`).
So the draft needs no block manager: preemption and freeing are the target's, and
prefix-cache hits are trusted to hold the draft's keys too (they do where the blocks
were computed in steps that proposed; elsewhere proposals are only rejected more).

The draft runs only in steps that ask for proposals (`SchedulerOutput.propose_drafts`):
above disable_by_batch_size it costs nothing. It keeps, per batch row, how many of the
request's positions its cache holds (`computed`), and in a proposing step catches up:

    positions   computed ........ L-1   L   L+1 .. L+m-1
    pass 1      [the tokens it lacks, s]                    one chunk per request:
                                                            its argmax at s is d1
    passes 2..m                        d1   d2 ..  d(m-1)   one token each: d2 .. dm

where s is the token just sampled (at position L - 1 = num_tokens - 1) and m <= k the
proposals it has slots for (the scheduler allocates k past the step: `lookahead`) and
that fit max_model_len. Passes 2..m write d1 .. d(m-1), which are true only as far as
the target accepts them: the next proposing step keeps the ones that match the tokens
the request then has, so after a verification that accepted a proposals the draft
lacks at most one position (none when a < m) and pass 1 is one or two tokens. A request
in a step that does not sample (a prompt chunk) catches up to its chunk's end. Catching
up after steps without proposals can be long: pass 1 then runs in pieces of at most
max_num_batched_tokens positions.

Proposals are greedy: each is one token with q one-hot, so the target's verification
(`ModelRunner._verify`) is exact without the draft's probabilities; they change only
how many tokens a step emits, never which.
"""

from __future__ import annotations

import numpy as np
import torch

from pagellm.executor.model.attention import AttentionBackend, AttentionMetadata, num_kv_segments
from pagellm.executor.model.config import ModelConfig
from pagellm.executor.model.decoder import DecoderForCausalLM
from pagellm.executor.model.loader import load_model
from pagellm.executor.model.parallel import TensorParallel
from pagellm.executor.worker.input_batch import InputBatch
from pagellm.executor.worker.sampling_inputs import to_device
from pagellm.executor.worker.step_inputs import StepInputs


class DraftModel:
    def __init__(self, config: ModelConfig, k: int, device: torch.device,
                 target_tp: TensorParallel, host_ranks: int, attention: AttentionBackend,
                 block_size: int, num_sms: int, max_num_seqs: int,
                 max_num_batched_tokens: int) -> None:
        """The draft is split over the target's tensor-parallel ranks in the same way
        (its own heads and columns per rank, the same group)."""
        self.config = config
        self.k = k
        self.device = device
        self.tp = TensorParallel.layout(config.spec, target_tp.rank, target_tp.size,
                                        target_tp.group)
        self.model: DecoderForCausalLM = load_model(config, device, self.tp, host_ranks,
                                                    kernels=attention.name == "triton")
        self.attention = attention
        self.block_size = block_size
        self.num_sms = num_sms
        self.max_tokens_per_pass = max(max_num_batched_tokens, max_num_seqs)
        # Per InputBatch row: positions whose keys the draft's cache holds, from 0; and
        # the proposals whose keys it wrote after them (speculative: kept if they match).
        self.computed = np.zeros(max_num_seqs, np.int64)  # [rows]
        self.written = np.zeros((max_num_seqs, k), np.int64)  # [rows, k]
        self.num_written = np.zeros(max_num_seqs, np.int64)  # [rows]

    def add_request(self, row: int, num_computed_tokens: int) -> None:
        """A request (new, or resumed after preemption) took `row`, with the target's
        keys for its first `num_computed_tokens` positions (prefix-cache hits)."""
        self.computed[row] = num_computed_tokens
        self.num_written[row] = 0

    def propose_after(self, inputs: StepInputs, batch: InputBatch,
                      kv_caches: list[torch.Tensor]) -> dict[str, list[int]]:
        """The proposals of the step's sampling requests, by request id, once the batch
        holds the step's tokens (`propose`)."""
        sampled = np.zeros(len(inputs.req_ids), bool)  # [R]
        sampled[inputs.sampling] = True
        # [R] positions the target's cache holds now (rejected proposals not counted)
        ends = np.where(sampled, batch.num_tokens[inputs.rows].astype(np.int64) - 1,
                        inputs.starts + inputs.counts)
        proposals = self.propose(batch, inputs.rows, ends, sampled, kv_caches)
        return {inputs.req_ids[i]: tokens for i, tokens in
                zip(inputs.sampling.tolist(), proposals, strict=True)}

    @torch.inference_mode()
    def propose(self, batch: InputBatch, rows: np.ndarray, ends: np.ndarray,
                sampled: np.ndarray, kv_caches: list[torch.Tensor]) -> list[list[int]]:
        """After a step: `rows` [R] the InputBatch rows of the step's requests, `ends`
        [R] the positions whose keys the target now holds (rejected proposals not
        counted), `sampled` [R] bool, which requests sampled a token (their last, at
        position num_tokens - 1). Catches the draft's cache up to `ends` (and each new
        token), then returns up to k greedy proposals per sampling request (in order)."""
        bs = self.block_size
        self._keep_matching(batch, rows)
        last = batch.num_tokens[rows].astype(np.int64) - 1  # [R] each new token's position
        # [R] proposals each: as many as the allocated slots and max_model_len allow.
        room = np.minimum(batch.num_blocks[rows].astype(np.int64) * bs,
                          self.config.max_model_len) - last
        counts = np.where(sampled, np.clip(room, 0, self.k), 0)
        # Pass 1's range per request: what it lacks, and the new token if it drafts.
        starts = np.minimum(self.computed[rows], ends)
        stops = np.where(counts > 0, last + 1, ends)
        hidden = self._forward(batch, rows, starts, stops, counts > 0, kv_caches)
        self.computed[rows] = stops
        tokens = np.zeros(len(rows), np.int64)  # [R] each pass's input (drafting rows)
        proposals: list[list[int]] = [[] for _ in range(int(sampled.sum()))]
        index = np.cumsum(sampled) - 1  # [R] request -> its place among the sampling ones
        for j in range(int(counts.max(initial=0))):
            active = np.flatnonzero(counts > j)  # [A]
            if j:  # d_j's keys at position last + j
                positions = last[active] + j
                hidden = self._forward(batch, rows[active], positions, positions + 1,
                                       np.ones(len(active), bool), kv_caches,
                                       tokens[active])
            # [A] the draft's most likely next tokens (logits gathered on every rank)
            best = self.model.compute_logits(hidden).argmax(dim=-1).cpu().numpy()
            tokens[active] = best
            for i, token in zip(active.tolist(), best.tolist(), strict=True):
                proposals[index[i]].append(token)
        drafting = np.flatnonzero(counts > 0)
        written = counts[drafting] - 1  # d1 .. d(m-1) went in at last + 1 ..
        self.num_written[rows] = 0
        self.num_written[rows[drafting]] = written
        for i, n in zip(drafting.tolist(), written.tolist(), strict=True):
            self.written[rows[i], :n] = proposals[index[i]][:n]
        return proposals

    def _keep_matching(self, batch: InputBatch, rows: np.ndarray) -> None:
        """The last proposing step wrote its proposals' keys past `computed`: those the
        request's tokens now match (the target accepted them) are its own keys."""
        for row in rows[self.num_written[rows] > 0].tolist():
            start, n = int(self.computed[row]), int(self.num_written[row])
            n = min(n, int(batch.num_tokens[row]) - start)
            matched = (batch.token_ids[row, start:start + n] == self.written[row, :n])
            self.computed[row] = start + int(matched.cumprod().sum())
            self.num_written[row] = 0

    def _forward(self, batch: InputBatch, rows: np.ndarray, starts: np.ndarray,
                 stops: np.ndarray, want: np.ndarray, kv_caches: list[torch.Tensor],
                 input_ids: np.ndarray | None = None) -> torch.Tensor:
        """Compute positions starts[i]:stops[i] of each of `rows` [R] (tokens from the
        batch, or `input_ids` [R] for one-position ranges), in pieces of at most
        max_tokens_per_pass positions; returns the hidden states [W, H] at the last
        position of each request with `want` [R] (in order)."""
        bs = self.block_size
        lengths = stops - starts  # [R]
        pieces: list[tuple[int, int, int]] = []  # (request, start, stop) per pass, in order
        passes: list[list[tuple[int, int, int]]] = [pieces]
        room = self.max_tokens_per_pass
        for i in np.flatnonzero(lengths > 0).tolist():
            at, stop = int(starts[i]), int(stops[i])
            while at < stop:
                if room == 0:
                    pieces, room = [], self.max_tokens_per_pass
                    passes.append(pieces)
                take = min(room, stop - at)
                pieces.append((i, at, at + take))
                at, room = at + take, room - take
        outputs: dict[int, torch.Tensor] = {}
        for piece in passes:
            if not piece:
                continue
            req = np.array([i for i, _, _ in piece])  # [P]
            lo = np.array([a for _, a, _ in piece])
            hi = np.array([b for _, _, b in piece])
            counts = hi - lo
            cu = np.concatenate(([0], np.cumsum(counts)))  # [P + 1]
            owner = np.repeat(np.arange(len(piece)), counts)  # [T]
            positions = lo[owner] + np.arange(cu[-1]) - cu[:-1][owner]  # [T]
            piece_rows = rows[req]
            ids = batch.token_ids[piece_rows[owner], positions] if input_ids is None \
                else input_ids[req]
            block_tables = batch.block_table[piece_rows, :batch.num_blocks[piece_rows].max()]
            slots = block_tables[owner, positions // bs].astype(np.int64) * bs + positions % bs
            put = self._put
            meta = AttentionMetadata(
                slot_mapping=put(slots), block_tables=put(block_tables, np.int32),
                query_start_loc=put(cu, np.int32), seq_lens=put(hi, np.int32),
                query_start_loc_cpu=cu,
                seq_lens_cpu=hi, max_query_len=int(counts.max()), backend=self.attention,
                num_segments=num_kv_segments(len(piece), self.tp.num_kv_heads,
                                             int(counts.max()), int(hi.max()), self.num_sms)
                if self.num_sms else 1)
            self.attention.prepare(meta)
            hidden = self.model(put(ids), put(positions), meta, kv_caches)
            for p, (i, _, b) in enumerate(piece):
                if want[i] and b == stops[i]:  # the request's last position
                    outputs[i] = hidden[int(cu[p + 1]) - 1]
        return torch.stack([outputs[i] for i in np.flatnonzero(want).tolist()]) \
            if want.any() else torch.empty(0)

    def _put(self, array: np.ndarray, dtype: type = np.int64) -> torch.Tensor:
        return to_device(array.astype(dtype, copy=False), self.device)
