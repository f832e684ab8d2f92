"""Speculative decoding's draft model: a smaller model of the same vocabulary proposes
each request's next k tokens, greedily, one token at a time (`speculative_config`
method "draft_model").

Its paged KV cache is indexed by the target's block tables: each block the scheduler
gives a request holds the draft's keys and values at the same slots, in a cache of the
draft's own shape (a block's bytes count both: `ModelRunner.kv_cache_bytes_per_block`).
So the draft needs no block manager: prefix-cache hits, preemption and freeing are the
target's, and a cached block holds both models' keys (they were computed in one step).

Each step that asks for proposals (`SchedulerOutput.propose_drafts`), two passes:

    step's tokens   t0 t1 .. tn            the target computes them, then the draft does
                                           (`follow`: same ids, positions and slots)
    after sampling  s  d1 d2 .. d(k-1)     `propose`: k one-token passes from the last
                    |  |                   token s (no cache has its keys yet); each
                    v  v                   writes its keys and its argmax is the next
                    d1 d2 .. dk            proposal: d1..dk go to the scheduler

The k passes write slots past the step's tokens, which the scheduler allocated
(`Proposer.lookahead`); a request with fewer slots (or near max_model_len) gets fewer
proposals. Keys written for tokens the target later rejects sit at positions the next
step writes over, as the target's own do.

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


class DraftModel:
    def __init__(self, config: ModelConfig, k: int, device: torch.device,
                 target_tp: TensorParallel, host_ranks: int, attention: AttentionBackend,
                 block_size: int, num_sms: int) -> None:
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

    @property
    def num_layers(self) -> int:
        return self.config.spec.num_layers

    @torch.inference_mode()
    def follow(self, input_ids: torch.Tensor, positions: torch.Tensor,
               meta: AttentionMetadata, kv_caches: list[torch.Tensor]) -> None:
        """Compute the step's tokens (input_ids, positions [T]; the target's metadata):
        their keys and values go into the draft's cache (`kv_caches`, its layers)."""
        self.model(input_ids, positions, meta, kv_caches)

    @torch.inference_mode()
    def propose(self, batch: InputBatch, rows: np.ndarray, kv_caches: list[torch.Tensor]
                ) -> list[list[int]]:
        """Up to k greedy proposals after the last token of each of `rows` [R] (the
        InputBatch rows of the requests that sampled this step), one list per row."""
        bs = self.block_size
        last = batch.num_tokens[rows].astype(np.int64) - 1  # [R] position of the new token
        # [R] proposals each: as many as its allocated slots and max_model_len allow.
        room = np.minimum(batch.num_blocks[rows].astype(np.int64) * bs,
                          self.config.max_model_len) - last
        counts = np.clip(room, 0, self.k)
        tokens = batch.token_ids[rows, last].astype(np.int64)  # [R] each pass's input
        proposals: list[list[int]] = [[] for _ in range(len(rows))]
        for j in range(int(counts.max(initial=0))):
            active = np.flatnonzero(counts > j)  # [A]
            positions = last[active] + j  # [A]
            block_tables = batch.block_table[rows[active], :batch.num_blocks[rows].max()]
            slots = block_tables[np.arange(len(active)), positions // bs].astype(np.int64) \
                * bs + positions % bs
            cu = np.arange(len(active) + 1)
            seq_lens = positions + 1
            meta = AttentionMetadata(
                slot_mapping=self._put(slots),
                block_tables=self._put(block_tables, torch.int32),
                query_start_loc=self._put(cu, torch.int32),
                seq_lens=self._put(seq_lens, torch.int32),
                query_start_loc_cpu=cu, seq_lens_cpu=seq_lens, max_query_len=1,
                backend=self.attention,
                num_segments=num_kv_segments(len(active), self.tp.num_kv_heads, 1,
                                             int(seq_lens.max()), self.num_sms)
                if self.num_sms else 1)
            self.attention.prepare(meta)
            hidden = self.model(self._put(tokens[active]), self._put(positions), meta,
                                kv_caches)  # [A, H]
            # [A] the draft's most likely next tokens (logits gathered on every rank)
            best = self.model.compute_logits(hidden).argmax(dim=-1).cpu().numpy()
            tokens[active] = best
            for i, token in zip(active.tolist(), best.tolist(), strict=True):
                proposals[i].append(token)
        return proposals

    def _put(self, array: np.ndarray, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device, dtype)
