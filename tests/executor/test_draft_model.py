"""executor/worker/draft_model.py's bookkeeping: which positions of a request the
draft's KV cache holds after a verification (the end-to-end behaviour, proposals
accepted and tokens unchanged, is in tests/e2e/test_speculative_decoding.py)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from pagellm.executor.worker.draft_model import DraftModel

pytestmark = pytest.mark.own_code


def test_the_proposals_the_request_then_has_are_kept_up_to_the_first_other_token():
    """Row 0 drafted 7 8 9 after position 4 and the request now reads 7 8 5 there: its
    keys at 4 and 5 (7, 8) are the request's, at 6 not. Row 1's proposals all match
    but the request ends first. Row 2 wrote none."""
    draft = SimpleNamespace(computed=np.array([4, 2, 3]), num_written=np.array([3, 3, 0]),
                            written=np.array([[7, 8, 9], [1, 1, 1], [0, 0, 0]]))
    tokens = np.zeros((3, 10), np.int64)
    tokens[0, :8] = [3, 3, 3, 3, 7, 8, 5, 6]
    tokens[1, :4] = [2, 2, 1, 1]
    batch = SimpleNamespace(token_ids=tokens, num_tokens=np.array([8, 4, 5]))
    DraftModel._keep_matching(draft, batch, np.array([0, 1, 2]))  # type: ignore[arg-type]
    assert draft.computed.tolist() == [6, 4, 3]
    assert draft.num_written.tolist() == [0, 0, 0]
