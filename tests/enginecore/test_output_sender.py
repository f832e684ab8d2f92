"""enginecore/output_sender.py: every attached frontend's output socket (issue 12).
Only the client that attached reads it (a PLAIN password from its handshake), a client
that stops reading is dropped once OUTPUT_HWM outputs wait for it and its requests are
aborted, and every message carries the load as a data-parallel frontend must count it
(proc.py stamps it: the ADDs it accounts for, a finished request counted out with its
last output). Against `tight_engine` (tests/conftest.py: small limits), through
helpers.RawEngineClient; after each, `still_serves`: a well-behaved frontend's greedy
tokens are what they were."""

from __future__ import annotations

import time

import msgspec
import zmq
from conftest import still_serves
from helpers import RawEngineClient, request

from pagellm.protocol.messages import EngineCoreOutputs, FinishReason, RequestType
from pagellm.transport.sockets import Context


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
