"""Fuzzing both surfaces a stranger can reach (issue 12), with hypothesis: random and
mutated engine-core messages on the engine's socket, random and mutated HTTP bodies on
the server. After every example the engine serves a good request with its output
unchanged. Examples are derandomized, so CI runs the same bounded set every time."""

from __future__ import annotations

import http.client
import json
import time
from typing import Any

import msgspec
import pytest
from conftest import PROMPTS
from helpers import NAME, RawEngineClient, Server, free_port, start_engine, stop
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagellm import LLM, SamplingParams
from pagellm.protocol.messages import EngineCoreRequest, RequestType

# Our code and torch alone: the floors leg skips it (.ci/run).
pytestmark = pytest.mark.own_code

FUZZ = settings(max_examples=120, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow,
                                       HealthCheck.function_scoped_fixture])
GOOD = SamplingParams(temperature=0.0, max_tokens=4)

# Values of every kind and at every edge that the wire formats can carry.
EDGE_INTS = st.sampled_from([0, -1, 1, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 1,
                             -(2**63), 1023, 1024, 1025, 10**9])
SCALARS = st.one_of(st.none(), st.booleans(), EDGE_INTS, st.integers(-(2**64) + 1, 2**64 - 1),
                    st.floats(), st.text(max_size=12))
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=8)


# --- the engine core's socket -------------------------------------------------------------

SAMPLING_FIELDS = list(SamplingParams.__struct_fields__)
TOKEN_LISTS = st.lists(st.one_of(st.integers(0, 1023), EDGE_INTS), max_size=10)


@st.composite
def engine_requests(draw: Any) -> bytes:
    """An ADD payload: EngineCoreRequest's positional fields, each either plausible or
    anything at all, sometimes cut short or with extra fields."""
    sampling = draw(st.dictionaries(st.sampled_from(SAMPLING_FIELDS), st.one_of(
        VALUES, TOKEN_LISTS, st.integers(-3, 40)), max_size=6))
    if "max_tokens" not in sampling:
        sampling["max_tokens"] = draw(st.integers(1, 8))
    fields = [draw(st.one_of(st.text(min_size=1, max_size=8), VALUES)),
              draw(st.one_of(TOKEN_LISTS, VALUES)),
              draw(st.one_of(st.just(sampling), VALUES)),
              draw(st.one_of(st.integers(-2, 1100), EDGE_INTS, st.none(), VALUES)),
              draw(st.one_of(st.floats(), VALUES)),
              draw(st.one_of(EDGE_INTS, VALUES)), draw(VALUES)]
    fields = fields[:draw(st.integers(0, len(fields)))] + draw(st.lists(VALUES, max_size=2))
    try:
        return msgspec.msgpack.encode(fields)
    except (OverflowError, TypeError):
        return b"\x90"


@st.composite
def mutated(draw: Any, valid: bytes) -> bytes:
    """`valid` with a few bytes replaced, inserted or cut."""
    data = bytearray(valid)
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, max(len(data) - 1, 0)))
        how = draw(st.sampled_from(["replace", "insert", "cut"]))
        if how == "replace" and data:
            data[i] = draw(st.integers(0, 255))
        elif how == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=4))
        else:
            del data[i:]
    return bytes(data)


VALID_ADD = msgspec.msgpack.encode(EngineCoreRequest("ok", [5, 6, 7], SamplingParams(
    max_tokens=4, temperature=0.7, top_k=5, logprobs=2, stop_token_ids=[3], min_tokens=1),
    2, 0.0))
MESSAGES = st.lists(st.one_of(
    st.tuples(st.just(RequestType.ADD.value), st.one_of(engine_requests(),
                                                        mutated(VALID_ADD))),
    st.tuples(st.sampled_from([t.value for t in RequestType]),
              st.one_of(st.binary(max_size=24), st.builds(msgspec.msgpack.encode, SCALARS))),
    st.lists(st.binary(max_size=8), min_size=1, max_size=4)), min_size=1, max_size=4)


@pytest.fixture(scope="module")
def engine_and_frontend(model_dirs):
    """One standalone engine core for every example, and a frontend attached to it."""
    address = f"tcp://127.0.0.1:{free_port()}"
    engine = start_engine(model_dirs["llama"], address)
    try:
        llm = LLM(str(model_dirs["llama"]), engine_address=address)
        reference = llm.generate(PROMPTS[:1], GOOD, use_tqdm=False)[0].outputs[0].token_ids
        yield address, llm, reference
        llm.shutdown()
        assert engine.poll() is None, "the engine core died during fuzzing"
    finally:
        stop(engine)


@FUZZ
@given(messages=MESSAGES)
def test_fuzzed_engine_core_messages_never_hurt_other_clients(engine_and_frontend, messages):
    address, llm, reference = engine_and_frontend
    stranger = RawEngineClient(address)
    try:
        for frames in messages:
            stranger.dealer.send_multipart(list(frames))
    finally:
        stranger.close()  # leaving aborts whatever of it was valid
    out = llm.generate(PROMPTS[:1], GOOD, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == reference


def test_after_fuzzing_every_block_is_free(engine_and_frontend):
    _, llm, _ = engine_and_frontend
    deadline = time.monotonic() + 10
    while True:
        stats = llm.get_stats()
        if stats.num_running_reqs == stats.num_waiting_reqs == 0 and \
                stats.num_free_blocks == stats.num_total_blocks:
            return
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)


# --- HTTP ---------------------------------------------------------------------------------

SMALL = st.one_of(st.integers(1, 6), VALUES)  # valid values stay small: no long generations
PROMPTS_ST = st.one_of(st.text(max_size=20), st.lists(st.integers(-2, 1100), max_size=6),
                       st.lists(st.text(max_size=8), max_size=3), VALUES)
SHARED = {"model": st.one_of(st.just(NAME), VALUES), "max_tokens": SMALL, "n": SMALL,
          "temperature": st.one_of(st.floats(0, 2), VALUES), "top_p": VALUES, "top_k": VALUES,
          "seed": VALUES, "stop": VALUES, "logit_bias": VALUES, "logprobs": VALUES,
          "stream": st.one_of(st.booleans(), VALUES), "stream_options": VALUES,
          "min_tokens": st.one_of(st.integers(0, 3), VALUES), "stop_token_ids": VALUES,
          "allowed_token_ids": VALUES, "bad_words": VALUES, "priority": VALUES,
          "truncate_prompt_tokens": VALUES, "repetition_penalty": VALUES, "min_p": VALUES,
          "cache_salt": VALUES, "presence_penalty": VALUES, "ignore_eos": VALUES}
COMPLETION = st.fixed_dictionaries({"prompt": PROMPTS_ST}, optional={
    **SHARED, "echo": VALUES, "suffix": VALUES, "best_of": VALUES})
CHAT = st.fixed_dictionaries({"messages": st.one_of(st.lists(st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["user", "system", "assistant"]), VALUES)},
    optional={"content": st.one_of(st.text(max_size=20), VALUES)}), max_size=3), VALUES)},
    optional={**SHARED, "top_logprobs": VALUES, "chat_template_kwargs": VALUES,
              "chat_template": VALUES, "add_generation_prompt": VALUES,
              "max_completion_tokens": SMALL})
VALID_BODY = json.dumps({"model": NAME, "prompt": "hello", "max_tokens": 3,
                         "logprobs": 1, "n": 2, "stop": ["x"]}).encode()
BODIES = st.one_of(
    st.tuples(st.just("/v1/completions"), COMPLETION),
    st.tuples(st.just("/v1/chat/completions"), CHAT),
    st.tuples(st.sampled_from(["/tokenize", "/detokenize"]),
              st.dictionaries(st.sampled_from(["prompt", "tokens", "messages", "model"]),
                              VALUES, max_size=3)),
    st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
              mutated(VALID_BODY)))


@pytest.fixture(scope="module")
def http_server(model_dirs):
    server = Server(model_dirs["llama"])
    reference = _complete(server)
    yield server, reference
    assert server.stop() == 0


def _complete(server: Server, key: str | None = None) -> str:
    status, body = server.post("/v1/completions", {"model": NAME, "prompt": PROMPTS[0],
                                                    "max_tokens": 4, "temperature": 0},
                               headers=_auth(key))
    assert status == 200, body
    return body["choices"][0]["text"]


@FUZZ
@given(case=BODIES)
def test_fuzzed_http_bodies_get_answers_never_500s(http_server, case):
    server, reference = http_server
    _post_answered(server, *case, answers=(200, 400, 404))
    assert _complete(server) == reference


def _auth(key: str | None) -> dict[str, str]:
    return {} if key is None else {"authorization": f"Bearer {key}"}


def _post_answered(server: Server, path: str, body: Any, answers: tuple[int, ...],
                   key: str | None = None) -> None:
    """POST `body` (bytes as they are, anything else as JSON): one of `answers`, and an
    error in OpenAI's shape naming why."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        connection.request("POST", path, data, {"content-type": "application/json",
                                                **_auth(key)})
        response = connection.getresponse()
        payload = response.read()
    finally:
        connection.close()
    assert response.status in answers, (response.status, payload[:300])
    if response.status != 200:
        error = json.loads(payload)["error"]
        assert error["message"] and error["code"] == response.status


# --- the RL dev routes (--enable-dev-endpoints): their JSON bodies ------------------------

INIT_INFO = st.fixed_dictionaries({}, optional={
    "master_address": st.one_of(st.just("127.0.0.1"), st.text(max_size=300), VALUES),
    "master_port": st.one_of(st.integers(0, 70000), VALUES),
    "rank_offset": st.one_of(st.integers(-1, 3), VALUES),
    "world_size": st.one_of(st.integers(0, 3), VALUES), "packed": VALUES})
UPDATE_INFO = st.fixed_dictionaries({}, optional={
    "names": st.one_of(st.lists(st.sampled_from(["model.norm.weight", "x"]), max_size=3),
                       VALUES),
    "dtype_names": st.one_of(st.lists(st.sampled_from(["float32", "int8"]), max_size=3),
                             VALUES),
    "shapes": st.one_of(st.lists(st.lists(st.integers(-1, 64), max_size=2), max_size=3),
                        VALUES),
    "packed": VALUES})
DEV_BODIES = st.one_of(
    st.tuples(st.just("/collective_rpc"), st.fixed_dictionaries({}, optional={
        "method": st.one_of(st.sampled_from(["describe", "weight_checksum", "fail",
                                             "embedding_rows", "_private", "sleep"]),
                            st.text(max_size=12), VALUES),
        "args": VALUES, "kwargs": VALUES,
        "timeout": st.one_of(st.floats(-1, 30), VALUES)})),
    st.tuples(st.just("/init_weight_transfer_engine"),
              st.one_of(st.fixed_dictionaries({"init_info": INIT_INFO}), VALUES)),
    st.tuples(st.just("/update_weights"),
              st.one_of(st.fixed_dictionaries({"update_info": UPDATE_INFO}), VALUES)),
    st.tuples(st.sampled_from(["/start_weight_update", "/finish_weight_update"]),
              st.one_of(st.fixed_dictionaries({}, optional={"weight_version": VALUES}),
                        VALUES)),
    st.tuples(st.sampled_from(["/collective_rpc", "/init_weight_transfer_engine",
                               "/update_weights"]),
              mutated(json.dumps({"init_info": {"master_address": "127.0.0.1",
                                                "master_port": 1, "world_size": 2},
                                  "method": "describe", "args": ["p"]}).encode())))


@settings(FUZZ, max_examples=60)
@given(case=DEV_BODIES)
def test_fuzzed_dev_route_bodies_get_answers_never_500s(rl_server, case):
    """Issue 37: the RL routes' bodies too (collective_rpc, the weight-transfer phases),
    against an engine started for them (conftest's rl_server): each is answered (200, a
    400 naming what is wrong, a 504 for a collective_rpc past its own timeout), never a
    500, and the engine serves the same tokens after."""
    reference = DEV_REFERENCE.setdefault(rl_server.port, _complete(rl_server, key="k"))
    _post_answered(rl_server, *case, answers=(200, 400, 504), key="k")
    assert _complete(rl_server, key="k") == reference
    assert rl_server.get("/health")[0] == 200


DEV_REFERENCE: dict[int, str] = {}  # the RL server's greedy text, taken before fuzzing it
