"""frontend/engine_client/mp_client.py: the client of an engine core in another process
refuses a request larger than an engine core takes (MAX_MESSAGE_BYTES) itself, naming
the request, instead of sending it: the engine core would drop the connection, failing
every request of that frontend (issue 12). The reference is the next request on the
same connection, served."""

from __future__ import annotations

import pytest

from pagellm import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def test_a_request_larger_than_the_engine_takes_fails_alone(model_dirs, make_llm):
    """The engine core drops a connection that sends more than MAX_MESSAGE_BYTES, which
    would fail every request of that frontend: the client refuses such a message
    itself, naming the request, and serves the next one on the same connection."""
    llm = make_llm(model_dirs["llama"], multiprocess=True)
    huge = SamplingParams(max_tokens=2, extra_args={"blob": "x" * (64 * 2**20)})
    with pytest.raises(ValueError, match=r"request '.*' is \d+ bytes encoded, more than "
                                         r"the 67108864 an engine core takes"):
        llm.generate(["a"], huge, use_tqdm=False)
    assert llm.generate(["a"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
