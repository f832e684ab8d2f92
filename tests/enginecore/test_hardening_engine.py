"""No request, frame or client can stop the engine core for anyone else (issue 12).

Each finding of the hostile review has a regression test here: bounds on every value a
client sends, foreign engine-core requests, the handshake flood, identity from the
connection, a client that stops reading, I/O threads that die, a step that fails.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import msgspec
import pytest
import zmq
from conftest import PROMPTS, assert_no_leaks
from helpers import KV, ROOT, RawEngineClient, free_port, raw_hello, stop
from zmq.utils.monitor import recv_monitor_message

from pagellm import LLM, AsyncLLM, EngineDeadError, SamplingParams
from pagellm.protocol.messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    RequestType,
    UtilityMethod,
    UtilityRequest,
)
from pagellm.protocol.validation import FLOAT32_MAX, INT32_MAX, INT64_MAX, INT64_MIN
from pagellm.transport.sockets import Context

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)

# An engine core with small limits, so that the limits can be reached in a test.
TIGHT_ENGINE = textwrap.dedent("""
    import sys
    import pagellm.enginecore.output_sender as output_sender
    import pagellm.enginecore.input_receiver as input_receiver
    import pagellm.transport.sockets as transport
    output_sender.CONNECT_GRACE_S = 1.0
    output_sender.OUTPUT_HWM = 20
    input_receiver.MAX_CLIENTS = 8
    transport.MAX_MESSAGE_BYTES = 2**20  # the frontends' socket is bound there
    from pagellm.enginecore.__main__ import main
    sys.exit(main(sys.argv[1:]))
""")


@pytest.fixture(scope="module")
def tight_engine(model_dirs):
    address = f"tcp://127.0.0.1:{free_port()}"
    engine = subprocess.Popen([sys.executable, "-c", TIGHT_ENGINE, "--model",
                               str(model_dirs["llama"]), "--kv-cache-memory-bytes", KV,
                               "--address", address], cwd=ROOT)
    yield engine, address
    stop(engine)


@pytest.fixture(scope="module")
def attached(tight_engine, model_dirs):
    """A well-behaved frontend on the tight engine, and its greedy tokens for PROMPTS."""
    _, address = tight_engine
    llm = LLM(str(model_dirs["llama"]), engine_address=address)
    reference = greedy_ids(llm)
    yield llm, reference
    llm.shutdown()


def greedy_ids(llm: LLM, prompts: list[str] = PROMPTS[:4]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def still_serves(attached) -> None:
    llm, reference = attached
    assert greedy_ids(llm) == reference


# --- bounds where values enter ----------------------------------------------------------

INT_FIELDS = {  # field: (smallest allowed, largest allowed)
    "n": (1, INT32_MAX), "top_k": (-1, INT32_MAX), "seed": (INT64_MIN, INT64_MAX),
    "max_tokens": (1, INT32_MAX), "min_tokens": (0, INT32_MAX), "logprobs": (-1, INT32_MAX),
    "prompt_logprobs": (-1, INT32_MAX), "truncate_prompt_tokens": (1, INT32_MAX),
}


@pytest.mark.parametrize("name", sorted(INT_FIELDS))
def test_every_sampling_integer_is_bounded_by_its_destination(name):
    low, high = INT_FIELDS[name]
    extra = {"max_tokens": None} if name == "min_tokens" else {}
    for value in (low, high):
        params = SamplingParams(**{name: value, **extra})  # the bounds themselves pass...
        decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
        assert getattr(decoded, name) == value  # ...and survive the wire
    for value in (low - 1, high + 1, 2**64, -(2**70)):
        if name == "truncate_prompt_tokens" and value == low - 1:
            continue  # 0 is refused, -1 means "as many as the model takes"
        with pytest.raises(ValueError, match=rf"{name} must be .*allowed: \[{low}, {high}\]"):
            SamplingParams(**{name: value, **extra})


@pytest.mark.parametrize("name, value", [
    ("temperature", 10**400), ("temperature", 1e39), ("top_p", 2**80), ("min_p", -(10**400)),
    ("presence_penalty", 10**30), ("repetition_penalty", float("nan")),
])
def test_every_sampling_float_is_finite_and_bounded(name, value):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})
    assert SamplingParams(temperature=FLOAT32_MAX).temperature == FLOAT32_MAX


def test_token_id_lists_and_biases_are_bounded():
    for kwargs in ({"stop_token_ids": [2**40]}, {"allowed_token_ids": [2**31]},
                   {"logit_bias": {2**31: 1.0}}):
        with pytest.raises(ValueError, match="must be <= 2147483647"):
            SamplingParams(**kwargs)


def test_lists_a_client_sends_are_bounded(model_dirs, make_llm):
    """Stop strings are searched and bad words tokenized per request, token-id lists
    gathered every step: their lengths are work a client could otherwise inflate."""
    with pytest.raises(ValueError, match="stop has 1025 entries, more than 1024"):
        SamplingParams(stop=["x"] * 1025)
    with pytest.raises(ValueError, match="bad_words has 1025 entries"):
        SamplingParams(bad_words=["x"] * 1025)
    # Counted before any entry is checked (the server checks them on its event loop).
    too_many = 2**20 + 1
    for kwargs in ({"stop_token_ids": [1] * too_many}, {"allowed_token_ids": [1] * too_many},
                   {"logit_bias": dict.fromkeys(range(too_many), 1.0)}):
        with pytest.raises(ValueError, match=f"has {too_many} entries, more than 1048576"):
            SamplingParams(**kwargs)
    llm = make_llm(model_dirs["llama"])
    vocab = llm.info.vocab_size
    for kwargs, message in (({"allowed_token_ids": [1] * (vocab + 1)}, "allowed_token_ids"),
                            ({"stop_token_ids": [2] * (vocab + 1)}, "stop_token_ids")):
        with pytest.raises(ValueError, match=f"{message} has {vocab + 1} entries"):
            llm.generate("hi", SamplingParams(**kwargs), use_tqdm=False)


def test_top_k_beyond_the_vocabulary_means_all_of_it(model_dirs, make_llm):
    """Finding 1: top_k=2**63 overflowed an int64 array in the engine loop. Now it is
    refused where it enters, and any top_k the int32 bound admits is clamped."""
    llm = make_llm(model_dirs["llama"])
    with pytest.raises(ValueError, match="top_k"):
        llm.generate("hi", SamplingParams(top_k=2**63, temperature=0.5), use_tqdm=False)
    sampled = {}
    for top_k in (0, llm.info.vocab_size, INT32_MAX):
        params = SamplingParams(top_k=top_k, temperature=0.9, seed=11, max_tokens=10)
        sampled[top_k] = llm.generate("hi", params, use_tqdm=False)[0].outputs[0].token_ids
    assert sampled[0] == sampled[llm.info.vocab_size] == sampled[INT32_MAX]


def test_n_is_bounded_by_max_num_seqs(model_dirs, make_llm):
    """Finding 4: n=20000 stalled the server while it fanned out."""
    llm = make_llm(model_dirs["llama"], max_num_seqs=4)
    with pytest.raises(ValueError, match=r"n=5 is more than .*max_num_seqs=4"):
        llm.generate("hi", SamplingParams(n=5), use_tqdm=False)
    assert len(llm.generate("hi", SamplingParams(n=4), use_tqdm=False)[0].outputs) == 4


def test_seeds_of_completions_wrap_within_64_bits(model_dirs, make_llm):
    llm = make_llm(model_dirs["llama"])
    params = SamplingParams(n=3, seed=INT64_MAX - 1, temperature=1.0, max_tokens=6)
    first = [c.token_ids for c in llm.generate("x", params, use_tqdm=False)[0].outputs]
    again = [c.token_ids for c in llm.generate("x", params, use_tqdm=False)[0].outputs]
    assert first == again and len({tuple(t) for t in first}) == 3


def test_priority_is_bounded_to_64_bits(model_dirs, make_llm):
    llm = make_llm(model_dirs["llama"])
    with pytest.raises(ValueError, match="priority"):
        llm.generate(["a"], GREEDY, use_tqdm=False, priority=[2**63])
    # Under fcfs a priority would be silently ignored: refused, as vLLM does, naming
    # what would honour it; the engine serves the next request as usual.
    with pytest.raises(ValueError, match=r"priority=5 needs .*scheduling_policy='priority'.*"
                                         r"'fcfs'"):
        llm.generate(["a"], GREEDY, use_tqdm=False, priority=[5])
    assert llm.generate(["a"], GREEDY, use_tqdm=False, priority=[0])[0].outputs[0].token_ids


def test_request_ids_are_bounded(model_dirs, make_llm):
    """A request id travels in every output of its request (a 10 MB one was taken)."""
    from pagellm.protocol.messages import MAX_REQUEST_ID_CHARS

    llm = make_llm(model_dirs["llama"])
    for request_id in ("x" * 961, "x" * 10**7, ""):
        with pytest.raises(ValueError, match="request_id must be a non-empty string of at "
                                             "most 960 characters"):
            llm.input_processor.process_inputs(request_id, "hi", GREEDY)
    assert llm.input_processor.process_inputs("x" * 960, "hi", GREEDY).engine_requests
    # A foreign client's id is checked by the engine itself.
    core = llm.engine_core.core
    core.add_request(request("y" * (MAX_REQUEST_ID_CHARS + 1), [1, 2]))
    (failed,) = core.step()[0].outputs
    assert failed.finish_reason == FinishReason.ERROR
    assert f"longer than {MAX_REQUEST_ID_CHARS} characters" in failed.error
    assert llm.generate(["a"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


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


def test_a_prompt_too_long_for_the_model_is_refused_before_it_is_tokenized(
        model_dirs, make_llm, monkeypatch):
    llm = make_llm(model_dirs["llama"])
    calls = []
    monkeypatch.setattr(llm.tokenizer, "encode", lambda *a, **k: calls.append(a) or [1])
    too_long = "a" * (llm.input_processor.max_prompt_chars + 1)
    with pytest.raises(ValueError, match=r"characters: more than max_model_len"):
        llm.generate(too_long, GREEDY, use_tqdm=False)
    assert calls == []


def test_model_config_values_are_checked_with_their_names(model_dirs, tmp_path):
    """Finding 9: num_attention_heads=0 gave a bare ZeroDivisionError."""
    import json
    import shutil

    for field, value in (("num_attention_heads", 0), ("hidden_size", -64),
                         ("vocab_size", 0), ("num_hidden_layers", 0),
                         ("num_key_value_heads", 3), ("max_position_embeddings", 0)):
        broken = tmp_path / field
        shutil.copytree(model_dirs["llama"], broken)
        config = json.loads((broken / "config.json").read_text())
        config[field] = value
        (broken / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=field):
            LLM(str(broken), multiprocess=False, kv_cache_memory_bytes=int(KV))


# --- the engine core and its foreign clients ---------------------------------------------

def request(request_id: str, prompt: list[int], **params) -> EngineCoreRequest:
    fields = {"max_tokens": 4, "temperature": 0.0, **params}
    eos = fields.pop("eos_token_id", None)
    return EngineCoreRequest(request_id, prompt, SamplingParams(**fields), eos, time.time())


def test_foreign_requests_the_engine_cannot_serve_fail_alone(tight_engine, attached):
    """Finding 5: a raw request with eos_token_id=10**9 and min_tokens killed the engine."""
    _, address = tight_engine
    client = RawEngineClient(address)
    vocab = client.reply.info.vocab_size
    try:
        bad = {
            "eos": request("eos", [5, 6], eos_token_id=10**9, min_tokens=2),
            "negative-eos": request("negative-eos", [5], eos_token_id=-1),
            "n": request("n", [5], n=3),
            "vocab": request("vocab", [5, vocab]),
            "long": request("long", [5] * 10, max_tokens=client.reply.info.max_model_len),
            "stop-ids": request("stop-ids", [5], stop_token_ids=[vocab + 1]),
            "logprobs": request("logprobs", [5], logprobs=1000),
            "empty": request("empty", []),
            "bad-words": request("bad-words", [5]),
            "bad-words-empty": request("bad-words-empty", [5]),
        }
        bad["bad-words"].bad_words_token_ids = [[1, 2**40]]
        bad["bad-words-empty"].bad_words_token_ids = [[]]
        bad["nan"] = request("nan", [5])
        bad["nan"].arrival_time = float("nan")
        bad["salt"] = request("salt", [5])
        bad["salt"].cache_salt = "s" * 1025
        for r in bad.values():
            client.send(RequestType.ADD, r)
        # Out of range for SamplingParams: refused while decoding, still answered by id.
        client.send(RequestType.ADD, msgspec.msgpack.encode(
            ["top-k", [5], {"top_k": 2**63}, None, 0.0]))
        errors = {}
        for _ in range(len(bad) + 1):
            out = client.outputs_until(lambda o: o.finish_reason is not None)[-1]
            assert out.finish_reason == FinishReason.ERROR, out
            errors[out.request_id] = out.error
        assert "eos_token_id=1000000000" in errors["eos"]
        assert "eos_token_id=-1" in errors["negative-eos"]
        assert "n must be 1" in errors["n"]
        assert "vocabulary" in errors["vocab"] and "vocabulary" in errors["stop-ids"]
        assert "max_model_len" in errors["long"] and "max_logprobs" in errors["logprobs"]
        assert "arrival_time" in errors["nan"] and "must not be empty" in errors["empty"]
        assert "top_k" in errors["top-k"]
        assert "outside the vocabulary" in errors["bad-words"]
        assert "must not be empty" in errors["bad-words-empty"]
        assert "cache_salt is longer than 1024" in errors["salt"]
        client.send(RequestType.ADD, request("good", [5, 6, 7]))
        assert client.finished("good").finish_reason == FinishReason.LENGTH
    finally:
        client.close()
    still_serves(attached)



def test_every_message_counts_the_adds_its_load_accounts_for(tight_engine, attached):
    """A data-parallel frontend routes by load = reported + ADDs sent - ADDs the report
    accounts for (a report computed before an ADD arrived must not hide it). An ADD
    refused on arrival counts at once (else it would count as load for good); an
    accepted one once the busy loop has queued it, and never before the load has it."""
    _, address = tight_engine
    client = RawEngineClient(address)
    seen: list[tuple[int, int]] = []  # (adds taken, waiting + running) per message
    try:
        client.send(RequestType.ADD, request("refused", [5], n=3))  # refused on arrival
        client.send(RequestType.ADD, request("long", [5, 6], max_tokens=1500,
                                             ignore_eos=True))

        def read_until(wanted: tuple[int, int]) -> None:
            deadline = time.monotonic() + 30
            while not seen or seen[-1] != wanted:
                assert time.monotonic() < deadline, seen[-5:]
                if client.output.poll(100):
                    message = msgspec.msgpack.decode(client.output.recv(),
                                                     type=EngineCoreOutputs)
                    seen.append((message.num_adds_taken,
                                 message.num_waiting + message.num_running))

        read_until((2, 1))  # both taken, "long" running
        client.send(RequestType.ABORT, ["long"])
        read_until((2, 0))  # then gone (a heartbeat says so at the latest)
    finally:
        client.close()
    taken = [t for t, _ in seen]
    assert taken == sorted(taken) and taken[-1] == 2
    until_abort = seen[:seen.index((2, 1)) + 1]
    assert all(load == 1 for t, load in until_abort if t == 2)  # "long" in every such load
    still_serves(attached)

def test_the_message_with_a_requests_last_output_counts_it_out(tight_engine, attached):
    """A finished request's last output carries the load after that step: stamped with
    the load from before it, the message said the request still ran, and a
    data-parallel frontend counted it until the core's next message."""
    _, address = tight_engine
    client = RawEngineClient(address)
    try:
        client.send(RequestType.ADD, request("short", [5, 6], max_tokens=3, ignore_eos=True))
        deadline = time.monotonic() + 30
        while True:
            assert time.monotonic() < deadline
            if not client.output.poll(100):
                continue
            message = msgspec.msgpack.decode(client.output.recv(), type=EngineCoreOutputs)
            if any(o.request_id == "short" and o.finished for o in message.outputs):
                break
        assert (message.num_waiting, message.num_running) == (0, 0)
    finally:
        client.close()
    still_serves(attached)


def test_garbage_frames_are_dropped_and_the_engine_keeps_serving(tight_engine, attached):
    _, address = tight_engine
    client = RawEngineClient(address)
    try:
        good = msgspec.msgpack.encode(request("r", [1, 2]))
        for frames in ([b"\x09", good],  # unknown type byte
                       [RequestType.ADD.value],  # no payload
                       [RequestType.ADD.value, good, b"extra"],  # too many frames
                       [RequestType.ADD.value, b"\xc1garbage"],  # not msgpack
                       [RequestType.ADD.value, msgspec.msgpack.encode([1, 2])],
                       [RequestType.ABORT.value, b"\x93\x01"],
                       [RequestType.UTILITY.value, msgspec.msgpack.encode([0, 99])],
                       [RequestType.HELLO.value, b"\xff"],
                       [b"", b""]):
            client.dealer.send_multipart(frames)
        # A typed utility call with arguments the method does not take: a failure
        # answer, not a crash. So is a call of a method the engine lacks (call 0
        # above): answered, or its caller would wait for its own timeout.
        client.send(RequestType.UTILITY, UtilityRequest(7, UtilityMethod.GET_STATS, [5]))
        deadline = time.monotonic() + 10
        answers = {}
        while len(answers) < 2 and time.monotonic() < deadline:
            if client.output.poll(100):
                answer = msgspec.msgpack.decode(client.output.recv(),
                                                type=EngineCoreOutputs).utility_output
                if answer is not None:
                    answers[answer.call_id] = answer
        assert sorted(answers) == [0, 7] and not any(a.result for a in answers.values())
        assert "invalid utility call" in answers[0].failure
        assert "bad arguments for get_stats" in answers[7].failure
    finally:
        client.close()
    still_serves(attached)


def test_a_message_over_the_size_limit_drops_its_connection(tight_engine, attached):
    """MAX_MESSAGE_BYTES (1 MiB here) holds for every connection: ZeroMQ copies a
    socket's options into its listener when it binds, and the limit was once set after
    binding, so frames of any size were taken in whole (300 MiB in the review)."""
    _, address = tight_engine
    context = Context()
    try:
        dealer = context.socket(zmq.DEALER)
        events = dealer.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED
                                           | zmq.EVENT_DISCONNECTED)
        dealer.connect(address)
        assert events.poll(10_000) and recv_monitor_message(events)["event"] == \
            zmq.EVENT_HANDSHAKE_SUCCEEDED
        dealer.send_multipart([RequestType.ADD.value, b"\x00" * (2**20 - 64)])  # fits
        assert not events.poll(500)
        dealer.send_multipart([RequestType.ADD.value, b"\x00" * (2**20 + 1)])
        assert events.poll(10_000), "the engine kept a connection that sent 1 MiB + 1"
        assert recv_monitor_message(events)["event"] == zmq.EVENT_DISCONNECTED
    finally:
        context.destroy(linger=0)
    still_serves(attached)


def test_a_handshake_flood_neither_deafens_nor_kills_the_engine(tight_engine, attached,
                                                                model_dirs):
    """Finding 2: ~1,024 HELLOs killed the input thread while heartbeats went on, so an
    attached LLM.generate hung forever. Now: one attachment per connection, at most
    MAX_CLIENTS (8 here), a clear refusal beyond, and slots come back when clients go."""
    _, address = tight_engine
    context = Context()
    crowd: list[RawEngineClient] = []
    try:
        one = context.socket(zmq.DEALER)
        one.setsockopt(zmq.LINGER, 0)
        one.connect(address)
        replies = [raw_hello(one) for _ in range(300)]  # HELLO after HELLO, one connection
        assert replies[0].error is None
        assert all("already attached" in r.error for r in replies[1:])
        # `one` never connects its output socket: dropped after the grace (1 s here),
        # which frees its slot for the seven below (the fixture's frontend is the 8th).
        time.sleep(2.0)
        crowd = [RawEngineClient(address) for _ in range(7)]
        assert [c.reply.error for c in crowd] == [None] * 7
        extra = RawEngineClient(address)
        crowd.append(extra)
        assert "at most 8 frontends" in extra.reply.error
        with pytest.raises(RuntimeError, match="at most 8 frontends"):
            LLM(str(model_dirs["llama"]), engine_address=address)
        still_serves(attached)
        for c in crowd:  # clients that leave free their slots at once
            c.close()
        deadline = time.monotonic() + 5
        while True:
            try:
                late = LLM(str(model_dirs["llama"]), engine_address=address)
                break
            except RuntimeError:
                assert time.monotonic() < deadline, "slots never came back"
                time.sleep(0.1)
        assert greedy_ids(late) == attached[1]
        late.shutdown()
    finally:
        for c in crowd:
            c.close()
        context.destroy(linger=0)


def test_identity_comes_from_the_connection(tight_engine, attached):
    """Finding 9: any local process could disconnect another client by writing its
    index. Now a BYE or an ABORT acts only on the sender's own connection."""
    _, address = tight_engine
    llm, reference = attached
    victim = llm.input_processor.process_inputs("victim", "a long one",
                                          SamplingParams(max_tokens=300, ignore_eos=True,
                                                         temperature=0.0))
    victim_id = victim.engine_requests[0].request_id
    llm.output_processor.add_request(victim)
    llm.engine_core.add_request(victim.engine_requests[0])
    attacker = RawEngineClient(address)
    try:
        attacker.send(RequestType.ABORT, [victim_id])  # even knowing the id
        attacker.send(RequestType.BYE, b"")
        attacker.send(RequestType.ADD, request("after-bye", [1, 2]))
        (final,) = llm._run(["victim"], use_tqdm=False)
        assert final.outputs[0].finish_reason == "length"
        assert len(final.outputs[0].token_ids) == 300
        assert not attacker.output.poll(300)  # after BYE nothing more is served
    finally:
        attacker.close()
    assert greedy_ids(llm) == reference


def test_a_stranger_cannot_connect_to_a_clients_output_socket(tight_engine, attached):
    """Review 2: a process that only knew the port of a client's output socket (ports of
    a loopback engine are listed in /proc/net/tcp) read some of its outputs, then the
    second connection dropped the client. The socket now admits only the PLAIN
    password the client got in its handshake reply: strangers fail the handshake,
    neither read nor count as a peer."""
    _, address = tight_engine
    victim = RawEngineClient(address)
    assert victim.reply.output_password  # no CURVE on this engine: a password
    context = Context()
    try:
        strangers = []
        for password in (None, "wrong"):
            stranger = context.socket(zmq.PULL)
            if password is not None:
                stranger.plain_username, stranger.plain_password = b"pagellm", b"wrong"
            stranger.connect(victim.reply.output_endpoint)
            strangers.append(stranger)
        time.sleep(0.5)  # their handshakes are over
        victim.send(RequestType.ADD, request("mine", [1, 2, 3], max_tokens=50, ignore_eos=True))
        final = victim.finished("mine")
        assert final.finish_reason == FinishReason.LENGTH  # served, not dropped
        assert not any(s.poll(300) for s in strangers)  # and nothing reached them
    finally:
        context.destroy(linger=0)
        victim.close()
    still_serves(attached)


def test_a_client_that_stops_reading_is_dropped_and_its_requests_aborted(tight_engine,
                                                                          attached):
    """Finding 9: a client that never read made the engine's memory grow without bound.
    Its queue is bounded (OUTPUT_HWM, 20 here): past it, the client is dropped."""
    _, address = tight_engine
    llm, _ = attached
    sleeper = RawEngineClient(address, rcvhwm=1)
    try:
        for i in range(8):
            sleeper.send(RequestType.ADD, request(f"s{i}", [1, 2, 3], max_tokens=1500,
                                                  ignore_eos=True))
        deadline = time.monotonic() + 60
        while True:  # the sleeper's requests run, then get aborted when it is dropped
            stats = llm.get_stats()
            if stats.num_running_reqs == 0 and stats.num_steps > 30:
                break
            assert time.monotonic() < deadline, stats
            time.sleep(0.1)
        assert stats.num_free_blocks == stats.num_total_blocks
    finally:
        sleeper.close()
    still_serves(attached)


# --- death is loud, and a failed step fails alone -------------------------------------------

DYING_INPUT_THREAD = textwrap.dedent("""
    import sys
    import pagellm.enginecore.input_receiver as input_receiver

    real = input_receiver.InputReceiver._on_message
    seen = 0

    def flaky(self, frames, decoders):
        global seen
        seen += 1
        if len(frames) == 3 and frames[2] == b"die":
            raise SystemExit("injected: the input thread dies")
        return real(self, frames, decoders)

    input_receiver.InputReceiver._on_message = flaky
    from pagellm.enginecore.__main__ import main
    sys.exit(main(sys.argv[1:]))
""")


def test_an_io_thread_that_dies_takes_the_engine_down_loudly(model_dirs):
    address = f"tcp://127.0.0.1:{free_port()}"
    engine = subprocess.Popen([sys.executable, "-c", DYING_INPUT_THREAD, "--model",
                               str(model_dirs["llama"]), "--kv-cache-memory-bytes", KV,
                               "--address", address], cwd=ROOT)
    try:
        llm = LLM(str(model_dirs["llama"]), engine_address=address)
        greedy_ids(llm, PROMPTS[:1])
        killer = RawEngineClient(address)
        killer.send(RequestType.UTILITY, b"die")
        assert engine.wait(20) == 1  # not a heartbeating zombie
        with pytest.raises(EngineDeadError, match="input thread failed"):
            greedy_ids(llm, PROMPTS[:1])
        killer.close()
        llm.shutdown()
    finally:
        stop(engine)


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(model_dirs, make_llm,
                                                                hf_reference, monkeypatch):
    """The safety net under validation: an exception inside the step fails the step's
    requests (an error output each) and the engine serves the next ones correctly;
    blocks computed in the failed step are not reused from the prefix cache."""
    from pagellm.executor.worker.input_batch import InputBatch

    llm = make_llm(model_dirs["llama"])
    real = InputBatch._set_sampling

    def poisoned(self, row, params, eos_token_id):
        if params.min_p == 0.125:  # the marked request
            raise IndexError("injected bad value")
        return real(self, row, params, eos_token_id)

    monkeypatch.setattr(InputBatch, "_set_sampling", poisoned)
    prompt = PROMPTS[4]  # long: its prompt blocks are registered in the failed step
    with pytest.raises(ValueError, match="the engine step failed: IndexError: injected"):
        llm.generate(prompt, SamplingParams(min_p=0.125, max_tokens=5), use_tqdm=False)
    assert_no_leaks(llm)
    out = llm.generate([prompt, PROMPTS[1]], SamplingParams(temperature=0, max_tokens=10),
                       use_tqdm=False)
    for text, o in zip([prompt, PROMPTS[1]], out, strict=True):
        assert o.outputs[0].token_ids == hf_reference("llama", llm.tokenizer.encode(text), 10)


def test_device_faults_are_fatal_and_other_failures_are_not(model_dirs, make_llm,
                                                           monkeypatch):
    import torch

    from pagellm.executor.executor import StepFailed, is_device_fault

    assert is_device_fault(RuntimeError("CUDA error: an illegal memory access was "
                                        "encountered"))
    assert not is_device_fault(torch.cuda.OutOfMemoryError("CUDA out of memory"))
    assert not is_device_fault(ValueError("bad"))
    llm = make_llm(model_dirs["llama"])
    core = llm.engine_core.core
    runner = core.executor.runner

    def fault(_):
        raise RuntimeError("CUDA error: device-side assert triggered")

    monkeypatch.setattr(runner, "execute_model", fault)
    core.add_request(request("x", [1, 2, 3]))
    with pytest.raises(RuntimeError, match="device-side assert") as info:
        core.step()
    assert not isinstance(info.value, StepFailed)
    monkeypatch.undo()
    core.abort_requests(["x"])
    core.step()


# --- ids ----------------------------------------------------------------------------------

def test_user_ids_never_collide_with_the_children_of_another_request(model_dirs):
    """Finding 8: in AsyncLLM a user id "0_r1" collided with the first child of an n=2
    request "r1", which then never finished; the error leaked the scoped id "0:0_r1"."""
    engine = AsyncLLM(str(model_dirs["llama"]), kv_cache_memory_bytes=int(KV))

    async def collect(prompt, params, request_id):
        return [o async for o in engine.generate(prompt, params, request_id)][-1]

    async def run():
        two = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=8)
        return await asyncio.wait_for(asyncio.gather(
            collect("x", two, "r1"), collect("y", GREEDY, "0_r1"),
            collect("z", GREEDY, "1_r1"), collect("w", GREEDY, "r1-0")), 60)

    async def duplicate():
        long = SamplingParams(max_tokens=1500, ignore_eos=True)  # running at the second
        first = engine.generate("x", long, "dup")
        await first.__anext__()
        with pytest.raises(ValueError) as info:
            await engine.generate("y", long, "dup").__anext__()
        await first.aclose()
        return str(info.value)

    try:
        results = asyncio.run(run())
        message = asyncio.run(duplicate())
    finally:
        engine.shutdown()
    assert [r.request_id for r in results] == ["r1", "0_r1", "1_r1", "r1-0"]
    assert len(results[0].outputs) == 2 and all(r.finished for r in results)
    assert message == "request id 'dup' is already in use"


# --- shutdown and leftovers ---------------------------------------------------------------

def test_sigterm_drains_for_at_most_the_shutdown_timeout(model_dirs, engine_at):
    """Finding 9: SIGTERM waited for every stream with no bound. The engine core now
    finishes what runs for up to --shutdown-timeout seconds, then aborts and exits 0."""
    # 0.3 s: well inside the ~1.5 s the 1900-token request runs on 2 CPU cores.
    engine, address = engine_at("llama", None, "--shutdown-timeout", "0.3")
    llm = LLM(str(model_dirs["llama"]), engine_address=address)
    try:
        processed = llm.input_processor.process_inputs(
            "endless", "x", SamplingParams(max_tokens=1900, ignore_eos=True, temperature=0))
        llm.output_processor.add_request(processed)
        llm.engine_core.add_request(processed.engine_requests[0])
        deadline = time.monotonic() + 30
        while llm.get_stats().num_running_reqs == 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        signalled = time.monotonic()
        engine.send_signal(signal.SIGTERM)
        assert engine.wait(15) == 0
        assert time.monotonic() - signalled < 6
        with pytest.raises(EngineDeadError, match="shut down"):
            llm._run(["endless"], use_tqdm=False)
    finally:
        llm.shutdown()


def test_sigterm_lets_a_short_request_finish(model_dirs, engine_at, hf_reference):
    engine, address = engine_at("llama", None, "--shutdown-timeout", "30")
    llm = LLM(str(model_dirs["llama"]), engine_address=address)
    try:
        # Short against the 30 s drain, long enough (~1 s) to be still running when
        # the signal lands: 40 tokens could finish before the first look at the stats.
        params = SamplingParams(max_tokens=400, ignore_eos=True, temperature=0)
        processed = llm.input_processor.process_inputs("short", PROMPTS[1], params)
        llm.output_processor.add_request(processed)
        llm.engine_core.add_request(processed.engine_requests[0])
        deadline = time.monotonic() + 30
        while llm.get_stats().num_running_reqs == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        engine.send_signal(signal.SIGTERM)
        (out,) = llm._run(["short"], use_tqdm=False)
        tokens = out.outputs[0].token_ids
        reference = hf_reference("llama", llm.tokenizer.encode(PROMPTS[1]), 400)
        # transformers stops at EOS; the request ignores it and runs to its length.
        assert len(tokens) == 400 and tokens[:len(reference)] == reference
        assert out.outputs[0].finish_reason == "length"
        assert engine.wait(15) == 0
        with pytest.raises((EngineDeadError, RuntimeError)):  # then it is gone
            llm.generate("more", GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()


def test_no_socket_directory_is_left_behind(model_dirs, tmp_path):
    """Finding 9: /tmp/pagellm-* stayed behind after a SIGKILL."""
    script = textwrap.dedent(f"""
        import os, signal, sys
        from pagellm import LLM
        llm = LLM({str(model_dirs["llama"])!r}, kv_cache_memory_bytes={KV})
        print(llm.engine_core.engine_process.pid, flush=True)
        print(len(os.listdir({str(tmp_path)!r})), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120, cwd=ROOT, env=env)
    pid, entries_while_running = map(int, result.stdout.split()[:2])
    assert entries_while_running == 0  # removed as soon as the sockets connected
    deadline = time.monotonic() + 15
    while _alive(pid):
        assert time.monotonic() < deadline, "engine core orphaned"
        time.sleep(0.05)
    assert list(tmp_path.iterdir()) == []



def test_a_process_that_exits_with_a_context_open_exits(tmp_path):
    """An engine core whose frontend died hung at interpreter exit for good (an orphan):
    the context it still held started a thread to terminate it, which never runs then."""
    script = textwrap.dedent(f"""
        import zmq
        from pagellm.transport.sockets import Context
        context = Context()
        server = context.socket(zmq.PULL)
        server.bind("ipc://{tmp_path}/socket")
        client = context.socket(zmq.PUSH)
        client.connect("ipc://{tmp_path}/socket")
        client.send(b"x")
        assert server.recv() == b"x"
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr

def test_engine_core_accepts_the_demo_model(tmp_path):
    """Finding 9: `pagellm engine-core --model demo` was refused."""
    address = f"ipc://{tmp_path}/demo-engine"
    env = {**os.environ, "PAGELLM_CACHE_DIR": str(tmp_path / "cache")}
    engine = subprocess.Popen([sys.executable, "-m", "pagellm", "engine-core", "--model",
                               "demo", "--kv-cache-memory-bytes", "32MiB", "--address",
                               address], cwd=ROOT, env=env)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "demo-engine").exists():
            assert engine.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        client = RawEngineClient(address)
        assert client.reply.info.model.endswith(tmp_path.joinpath("cache").name) or \
            "cache" in client.reply.info.model
        client.send(RequestType.ADD, request("d", [5, 6, 7]))
        assert client.finished("d").finish_reason == FinishReason.LENGTH
        client.close()
    finally:
        assert stop(engine) == 0
    assert not list(tmp_path.glob("demo-engine*"))  # socket files removed on exit


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
