"""The step metadata the stateful layers read (query starts, each request's state row),
built for unit tests of executor/model/stateful.py and the recurrent mixers."""

from __future__ import annotations

import numpy as np
import torch

from pagellm.executor.model.attention import AttentionMetadata


def step_meta(counts: list[int], rows: list[int]) -> AttentionMetadata:
    """A step of requests computing `counts` tokens each, in state rows `rows`: what
    ConvBatch and scan_requests read (the query starts and the rows); nothing else."""
    starts = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    empty = torch.empty(0)
    return AttentionMetadata(slot_mapping=empty, block_tables=empty, query_start_loc=empty,
                             seq_lens=empty, query_start_loc_cpu=starts,
                             seq_lens_cpu=np.zeros(len(counts), np.int64), max_query_len=1,
                             backend=None,  # type: ignore[arg-type]
                             request_rows=np.array(rows, np.int64))
