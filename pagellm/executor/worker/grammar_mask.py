"""Structured outputs on the worker: the engine core's token bitmask applied to the
step's logits before sampling (so every later stage, logprobs included, sees only the
tokens the grammar allows, as in vLLM). The apply kernel is xgrammar's (native code on
the CPU, a GPU kernel on CUDA), whichever backend filled the rows: both use the same
layout."""

from __future__ import annotations

import numpy as np
import torch

from pagellm.protocol.scheduling import GrammarOutput


def apply_grammar_bitmask(logits: torch.Tensor, grammar: GrammarOutput,
                          row_of: dict[str, int]) -> None:
    """logits [S, V] in place: -inf where the request's grammar forbids the token.
    `row_of`: request id -> its logits row (requests that sample this step)."""
    import xgrammar as xgr

    vocab_size = logits.shape[1]
    words = -(-vocab_size // 32)
    packed = np.frombuffer(grammar.bitmask, dtype=np.int32).reshape(len(grammar.req_ids),
                                                                    words)
    rows = [row_of.get(req_id, -1) for req_id in grammar.req_ids]
    keep = [i for i, row in enumerate(rows) if row >= 0]
    if not keep:
        return
    bitmask = torch.full((logits.shape[0], words), -1, dtype=torch.int32)  # [S, W]
    targets = [rows[i] for i in keep]
    bitmask[targets] = torch.from_numpy(packed[keep])
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                    indices=targets, vocab_size=vocab_size)
