"""enginecore/input_receiver.py: the engine core's input thread against foreign and
hostile clients (issue 12). Requests the engine cannot serve fail alone, garbage frames
are dropped, a message over MAX_MESSAGE_BYTES drops its connection (transport/sockets.py
sets the limit before binding), a handshake flood is refused past MAX_CLIENTS, identity
comes from the connection, and an input thread that dies takes the engine down loudly
(proc.py). The clients are written from the protocol alone (helpers.RawEngineClient),
against `tight_engine` (tests/conftest.py: small limits); after each, `still_serves`: a
well-behaved frontend's greedy tokens are what they were."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import msgspec
import pytest
import zmq
from conftest import PROMPTS, greedy_ids, still_serves
from helpers import KV, ROOT, RawEngineClient, free_port, raw_hello, request, stop
from zmq.utils.monitor import recv_monitor_message

from pagellm import LLM, EngineDeadError, SamplingParams, StructuredOutputsParams
from pagellm.protocol.messages import (
    EngineCoreOutputs,
    FinishReason,
    RequestType,
    UtilityMethod,
    UtilityRequest,
)
from pagellm.transport.sockets import Context


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
        # Structured outputs (issue 39): a grammar no backend compiles, and constraints
        # that are no single constraint.
        bad["grammar"] = request("grammar", [5], structured_outputs=StructuredOutputsParams(
            regex="("))
        bad["two"] = request("two", [5], structured_outputs=StructuredOutputsParams(
            regex="a"))
        bad["two"].sampling_params.structured_outputs.choice = ["a"]  # type: ignore[union-attr]
        for r in bad.values():
            client.send(RequestType.ADD, r)
        # Out of range for SamplingParams: refused while decoding, still answered by id.
        client.send(RequestType.ADD, msgspec.msgpack.encode(
            ["top-k", [5], {"top_k": 2**63}, None, 0.0]))
        # A schema nested past the decoder's stack (msgpack maps 5000 deep): answered too.
        deep = msgspec.Raw(b"\x81\xa5items" * 5000 + b"\x80")
        client.send(RequestType.ADD, msgspec.msgpack.encode(
            ["deep", [5], {"structured_outputs": {"json": deep}}, None, 0.0]))
        errors = {}
        for _ in range(len(bad) + 2):
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
        assert "regex" in errors["grammar"] and "exactly one" in errors["two"]
        assert "nested too deeply" in errors["deep"]
        client.send(RequestType.ADD, request("good", [5, 6, 7]))
        assert client.finished("good").finish_reason == FinishReason.LENGTH
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
