"""The sampler's per-row inputs (executor/worker/sampling_inputs.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagellm.executor.worker.input_batch import InputBatch
from pagellm.executor.worker.sampling_inputs import sampling_metadata
from pagellm.executor.worker.step_buffers import StepBuffers
from pagellm.protocol.sampling_params import SamplingParams
from pagellm.protocol.scheduling import NewRequestData

pytestmark = pytest.mark.own_code

VOCAB = 64


def _batch(params: SamplingParams, output: list[int], bad_words: list[list[int]] | None
           ) -> InputBatch:
    batch = InputBatch(4, 64, 16, VOCAB)
    batch.add(NewRequestData("r", [5, 6, 7, 8], output, params, 1, [0, 1, 2, 3], 0,
                             bad_words))
    return batch


def _buffers() -> StepBuffers:
    return StepBuffers(torch.device("cpu"), {
        name: ((16,), dtype) for name, dtype in (("temperature", torch.float32),
                                                 ("top_k", torch.int64),
                                                 ("top_p", torch.float32),
                                                 ("min_p", torch.float32))})


def test_a_position_past_proposals_is_sampled_as_if_they_had_been_sampled():
    """Speculative decoding samples a request's last token position and each proposal's
    at once (offsets 0..k, the proposals written past num_tokens): each row's seed,
    min_tokens and bad-word bans and penalty counts must be those the request would
    have had with the proposals before that row really appended."""
    params = SamplingParams(temperature=0.5, seed=3, min_tokens=5, stop_token_ids=[9],
                            repetition_penalty=1.3, frequency_penalty=0.5,
                            presence_penalty=0.25, max_tokens=20)
    output, proposals = [11, 12], [12, 13, 11]
    bad_words = [[12, 13, 40], [13, 41], [11, 12, 42]]
    speculating = _batch(params, output, bad_words)
    speculating.token_ids[0, 6:9] = proposals  # past num_tokens = 6, as the runner writes
    rows = np.zeros(4, np.int64)
    meta = sampling_metadata(speculating, rows, _buffers(), False, np.arange(4))
    assert meta.banned is not None and meta.seeds is not None and meta.penalties is not None
    banned_rows, banned_ids = (x.tolist() for x in meta.banned)
    # By hand: EOS (1) and 9 banned while fewer than 5 outputs; a bad word's last token
    # banned right after its prefix (11 12 -> 42, 12 13 -> 40, 13 -> 41).
    expected = [{1, 9, 42}, {1, 9}, {1, 9, 40, 41}, set()]
    for offset in range(4):
        ours = {t for r, t in zip(banned_rows, banned_ids, strict=True) if r == offset}
        assert ours == expected[offset], offset
        appended = _batch(params, output + proposals[:offset], bad_words)
        one = sampling_metadata(appended, np.zeros(1, np.int64), _buffers(), False)
        assert one.seeds is not None and one.penalties is not None
        assert meta.seeds[offset] == one.seeds[0]
        assert ours == (set(one.banned[1].tolist()) if one.banned is not None else set())
        assert torch.equal(meta.penalties.output_counts[offset],
                           one.penalties.output_counts[0])
    assert meta.penalties.output_counts[3, [11, 12, 13]].tolist() == [2.0, 2.0, 1.0]
