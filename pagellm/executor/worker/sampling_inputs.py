"""The sampler's per-row inputs for one step, gathered from the persistent batch.

Each sampling parameter lives per batch row in the `InputBatch` (numpy); a step turns
the rows that sample into the sampler's `SamplingMetadata` (sampler row i = the i-th
sampling row): temperatures and top-k/top-p/min-p through the step buffers, the sparse
parts (seeds, banned tokens, allowed ids, logit bias, penalties, logprob rows) only for
the rows that use them, so plain requests pay nothing for the features they skip.
"""

from __future__ import annotations

import numpy as np
import torch

from pagellm.executor.worker.input_batch import InputBatch
from pagellm.executor.worker.sampler import Penalties, SamplingMetadata, mix_seed
from pagellm.executor.worker.step_buffers import StepBuffers


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """Host array -> tensor on `device` (no copy on the CPU)."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    return tensor if device.type == "cpu" else tensor.to(device, non_blocking=True)


def sampling_metadata(batch: InputBatch, rows: np.ndarray, buffers: StepBuffers,
                      processed_logprobs: bool, offsets: np.ndarray | None = None
                      ) -> SamplingMetadata:
    """Per-row parameters for the sampling rows (batch rows `rows` [S], sampler rows
    0..S-1), gathered from the batch; what no row needs stays None. The [S] vectors go
    through the step buffers; the rest is built on their device.

    `offsets` [S] (speculative decoding): sampler row i samples the position `offsets[i]`
    tokens past its request's last one, as if the proposals before it (in the batch's
    token_ids past num_tokens) had been sampled: its seed, its min_tokens and bad-words
    bans and its penalties' output counts are those of that position."""
    dev, put = buffers.device, buffers.put
    # [S] each sampled position's token count before it
    num_tokens = batch.num_tokens[rows] if offsets is None else batch.num_tokens[rows] + offsets
    temperature = batch.temperature[rows]
    random = temperature > 0
    top_k, top_p, min_p = batch.top_k[rows], batch.top_p[rows], batch.min_p[rows]
    row_list = rows.tolist()
    meta = SamplingMetadata(
        temperature=put("temperature", temperature), all_greedy=not random.any(),
        any_greedy=not random.all(),
        top_k=put("top_k", top_k) if (top_k[random] < batch.vocab_size).any() else None,
        top_p=put("top_p", top_p) if (top_p[random] < 1.0).any() else None,
        min_p=put("min_p", min_p) if (min_p[random] > 0.0).any() else None,
        processed_logprobs=processed_logprobs)
    if batch.seeds:
        meta.seeds = {i: mix_seed(batch.seeds[r], int(num_tokens[i]))
                      for i, r in enumerate(row_list) if r in batch.seeds}
    banned = _banned_tokens(batch, row_list, num_tokens)
    if banned:
        meta.banned = (to_device(np.array([i for i, _ in banned]), dev),
                       to_device(np.array([t for _, t in banned]), dev))
    if batch.allowed:
        pairs = [(i, t) for i, r in enumerate(row_list) for t in batch.allowed.get(r, ())]
        if pairs:
            meta.allowed = (to_device(np.array([i for i, _ in pairs]), dev),
                            to_device(np.array([t for _, t in pairs]), dev))
    if batch.logit_bias:
        triples = [(i, t, b) for i, r in enumerate(row_list)
                   for t, b in batch.logit_bias.get(r, {}).items()]
        if triples:
            meta.logit_bias = (to_device(np.array([i for i, _, _ in triples]), dev),
                               to_device(np.array([t for _, t, _ in triples]), dev),
                               to_device(np.array([b for _, _, b in triples], np.float32), dev))
    if batch.penalized:
        meta.penalties = _penalties(batch, [(i, r) for i, r in enumerate(row_list)
                                            if r in batch.penalized], dev, num_tokens)
    if batch.num_logprobs:
        which = [i for i, r in enumerate(row_list) if r in batch.num_logprobs]
        if which:
            meta.logprob_rows = to_device(np.array(which), dev)
            meta.num_logprobs = max(batch.num_logprobs[row_list[i]] for i in which)
    return meta

def _banned_tokens(batch: InputBatch, rows: list[int], num_tokens: np.ndarray
                   ) -> list[tuple[int, int]]:
    """(sampler row, token) pairs masked this step: EOS and stop ids before
    min_tokens, and the last token of any bad word whose other tokens end the
    output so far."""
    banned: list[tuple[int, int]] = []
    if not (batch.stop_ids or batch.bad_words):
        return banned
    for i, r in enumerate(rows):
        end = int(num_tokens[i])
        num_output = end - int(batch.num_prompt_tokens[r])
        if r in batch.stop_ids and num_output < batch.min_tokens[r]:
            banned += [(i, t) for t in batch.stop_ids[r]]
        for prefix, table in batch.bad_words.get(r, {}).items():
            if prefix <= num_output:
                key = tuple(batch.token_ids[r, end - prefix:end].tolist())
                banned += [(i, t) for t in table.get(key, ())]
    return banned

def _penalties(batch: InputBatch, which: list[tuple[int, int]], dev: torch.device,
               num_tokens: np.ndarray) -> Penalties:
    """Prompt masks and output counts [P, V] for the penalized rows, built by
    scatters over padded token arrays (one extra column takes the padding)."""
    vocab = batch.vocab_size
    rows = np.array([r for _, r in which])
    prompt_lens = batch.num_prompt_tokens[rows]
    output_lens = num_tokens[[i for i, _ in which]] - prompt_lens
    width_p, width_o = int(prompt_lens.max()), max(int(output_lens.max()), 1)
    prompt = np.full((len(rows), width_p), vocab, dtype=np.int64)
    output = np.full((len(rows), width_o), vocab, dtype=np.int64)
    for j, r in enumerate(rows.tolist()):
        prompt[j, :prompt_lens[j]] = batch.token_ids[r, :prompt_lens[j]]
        output[j, :output_lens[j]] = batch.token_ids[r, prompt_lens[j]:
                                                    prompt_lens[j] + output_lens[j]]
    prompt_mask = torch.zeros(len(rows), vocab + 1, dtype=torch.bool, device=dev)
    prompt_mask.scatter_(1, to_device(prompt, dev), True)
    counts = torch.zeros(len(rows), vocab + 1, dtype=torch.float32, device=dev)
    counts.scatter_add_(1, to_device(output, dev), torch.ones(output.shape, device=dev))
    return Penalties(rows=to_device(np.array([i for i, _ in which]), dev),
                     presence=to_device(batch.presence[rows], dev),
                     frequency=to_device(batch.frequency[rows], dev),
                     repetition=to_device(batch.repetition[rows], dev),
                     prompt_mask=prompt_mask[:, :vocab], output_counts=counts[:, :vocab])
