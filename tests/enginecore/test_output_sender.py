"""enginecore/output_sender.py: every attached frontend's output socket (issue 12).
Only the client that attached reads it (a PLAIN password from its handshake), a client
that stops reading is dropped once OUTPUT_HWM outputs wait for it and its requests are
aborted, and every message carries the load as a data-parallel frontend must count it
(proc.py stamps it: the ADDs it accounts for, a finished request counted out with its
last output). Against `tight_engine` (tests/conftest.py: small limits), through
helpers.RawEngineClient; after each, `still_serves`: a well-behaved frontend's greedy
tokens are what they were."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq
from conftest import still_serves
from helpers import RawEngineClient, request

from pagellm.enginecore import output_sender
from pagellm.enginecore.output_sender import AttachedClient, OutputSender
from pagellm.protocol.messages import EngineCoreOutputs, FinishReason, RequestType
from pagellm.transport.sockets import Context, monitor


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
    Its queue is bounded (OUTPUT_HWM, 200 here): past it, the client is dropped and its
    requests aborted. What the kernel buffers first (~3 MB) is a small part of what 32
    requests with logprobs send over their 2,000 steps, so they end early: until the
    sleeper was sent enough to notice (top-20 logprobs), its requests ran to their end
    and this test passed without any drop."""
    _, address = tight_engine
    llm, _ = attached
    sleeper = RawEngineClient(address, rcvhwm=1)
    first = llm.get_stats().num_steps
    try:
        for i in range(32):
            sleeper.send(RequestType.ADD, request(f"s{i}", [1, 2, 3], max_tokens=2000,
                                                  logprobs=20, ignore_eos=True))
        deadline = time.monotonic() + 60
        while True:  # the sleeper's requests run, then get aborted when it is dropped
            stats = llm.get_stats()
            if stats.num_running_reqs == 0 and stats.num_steps > first + 30:
                break
            assert time.monotonic() < deadline, stats
            time.sleep(0.1)
        assert stats.num_steps - first < 1500, "the requests ran to their end: no drop"
        assert stats.num_free_blocks == stats.num_total_blocks
    finally:
        sleeper.close()
    still_serves(attached)


# The output thread alone, on ipc sockets with tiny queues (no engine) ------------------

BULKY = list(range(30_000))  # ~90 kB encoded: a few of them fill a socket's buffers


@pytest.fixture
def sender(tmp_path) -> Iterator[tuple[OutputSender, list[int], list[zmq.Socket]]]:
    """An OutputSender's thread with two clients (0 and 1), each a PUSH queue of 2 to a
    PULL queue of 1 that the test reads (or does not); and the indexes it forgot."""
    forgotten: list[int] = []
    sender = OutputSender(stamp=lambda index, outputs: None, forget=forgotten.append)
    context = zmq.Context()
    readers = []
    events = zmq.EVENT_ACCEPTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
    for index in (0, 1):
        push = context.socket(zmq.PUSH)
        push.setsockopt(zmq.SNDHWM, 2)
        endpoint = f"ipc://{tmp_path}/out{index}"
        push.bind(endpoint)
        record = AttachedClient(index, b"%d" % index, push, monitor(push, events),
                                endpoint, None)
        pull = context.socket(zmq.PULL)
        pull.setsockopt(zmq.RCVHWM, 1)
        pull.connect(endpoint)
        readers.append(pull)
        sender.register(record)
    thread = threading.Thread(target=sender.run, daemon=True)
    thread.start()
    try:
        yield sender, forgotten, readers
    finally:
        sender.stop("test over")
        thread.join(timeout=10)
        assert not thread.is_alive()
        context.destroy(linger=0)


def bulky(number: int) -> EngineCoreOutputs:
    return EngineCoreOutputs(timestamp=float(number), token_req_ids=["r"] * len(BULKY),
                             token_ids=BULKY)


def received(reader: zmq.Socket, count: int) -> list[float]:
    """The timestamps of the next `count` messages with outputs (heartbeats skipped)."""
    stamps: list[float] = []
    while len(stamps) < count:
        assert reader.poll(5000), f"only {len(stamps)} of {count} messages came"
        message = msgspec.msgpack.decode(reader.recv(), type=EngineCoreOutputs)
        if message.has_outputs:
            stamps.append(message.timestamp)
    return stamps


def test_a_client_that_pauses_reading_loses_nothing(sender):
    """A frontend the OS did not run for a moment (the tests' loaded CI machines) was
    dropped at the first full queue, its requests aborted. A queue that empties within
    STALL_S loses nothing, in order, whether sent by the busy loop or the thread."""
    sender, forgotten, (reader, _) = sender
    time.sleep(0.2)  # registered
    for number in range(40):
        (sender.send_now if number % 2 else sender.queue_send)({0: bulky(number)})
    time.sleep(output_sender.STALL_S / 2)  # not reading: the queue is full by now
    assert received(reader, 40) == list(range(40))
    assert forgotten == []


def test_a_stalled_client_is_dropped_without_holding_up_the_others(sender):
    sender, forgotten, (_, reader) = sender  # client 0 never reads
    time.sleep(0.2)
    start = time.monotonic()
    gaps = []
    for number in range(60):
        sender.queue_send({0: bulky(number), 1: EngineCoreOutputs(
            timestamp=float(number), token_req_ids=["r"], token_ids=[number])})
        sent = time.monotonic()
        received(reader, 1)
        gaps.append(time.monotonic() - sent)
        time.sleep(0.03)
    assert forgotten == [0]  # dropped within STALL_S of its queue filling
    assert time.monotonic() - start > output_sender.STALL_S
    assert max(gaps) < output_sender.STALL_S / 2, gaps  # client 1 never waited on it
