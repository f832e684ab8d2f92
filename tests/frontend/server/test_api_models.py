"""frontend/server/api_models.py: a request body's logit_bias keys must be ASCII token
ids (str.isdigit() took "²", then int() failed naming nothing, and fullwidth digits,
silently token 12). Against the `guarded` server (tests/conftest.py); the reference is
the 400's message."""

from __future__ import annotations

import pytest
from guarded_server import post
from helpers import NAME


@pytest.mark.parametrize("key", ["²", "１２", "--5", "1e3", ""])
def test_logit_bias_keys_are_ascii_token_ids(guarded, key):
    """str.isdigit() took "²" (then int() failed, naming nothing) and fullwidth digits
    (silently token 12)."""
    status, response = post(guarded, "/v1/completions", {
        "model": NAME, "prompt": "x", "max_tokens": 1, "logit_bias": {key: 1.0}})
    assert status == 400 and "logit_bias keys must be token ids" in \
        response["error"]["message"], response
