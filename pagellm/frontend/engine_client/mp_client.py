"""Clients of an engine core in another process: `MPClient`, what both kinds share.
`SyncMPClient` (for `LLM`) is in sync_mp_client.py, `AsyncMPClient` (for `AsyncLLM`) in
async_mp_client.py.

Either launches its own engine core (`EngineProcess`) or attaches to a running one at
`engine_address`. One DEALER socket connects to the engine's ROUTER: HELLO answered by
READY (the engine's facts, this client's index and its output endpoint), then requests,
aborts, utility calls and BYE; this client's outputs come back on a PULL socket.

The engine's death reaches every caller as `EngineDeadError` naming the cause: from
the engine's last message, from the child process's exit (a watcher thread waits on
it, so a SIGKILL is noticed at once), from a socket losing its connection (ZeroMQ's
monitor events: an engine elsewhere that dies is noticed at once too), or, for an
engine that hangs silently, from missing heartbeats.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from pagellm.frontend.engine_client.core_client import (
    EngineCoreClient,
    EngineDeadError,
)
from pagellm.frontend.engine_client.engine_process import EngineProcess
from pagellm.protocol.codec import MsgpackDecoder, MsgpackEncoder
from pagellm.protocol.engine_args import EngineArgs
from pagellm.protocol.messages import (
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    EngineCoreOutputs,
    EngineCoreRequest,
    HandshakeReply,
    HandshakeRequest,
    RequestType,
    UtilityMethod,
    UtilityRequest,
)
from pagellm.protocol.utility import SIGNATURES
from pagellm.transport.curve import CurveClientKeys
from pagellm.transport.sockets import PLAIN_USER, Context
from pagellm.transport.sockets import monitor as monitor_socket

LOCAL_STARTUP_TIMEOUT_S = 900.0  # loading a large model can take minutes
REMOTE_HANDSHAKE_TIMEOUT_S = 30.0
# An attached engine's address that refuses every connection for this long has nothing
# listening: said then, not after REMOTE_HANDSHAKE_TIMEOUT_S. An engine core binds its
# address first thing, before torch and the model load (`transport.bind_frontends`), so
# this need only cover the interpreter's start (~0.5 s) on a busy machine.
REFUSED_TIMEOUT_S = 5.0
HEARTBEAT_TIMEOUT_S = 10.0  # an engine core is dead after this long in silence
_EXIT_WAIT_S = 1.0  # a lost connection to a launched engine: wait this long for its exit
_LAST_WORD_WAIT_S = 0.3  # ... to an attached one: this long for its last word


def _endpoint_for(engine_address: str, endpoint: str) -> str:
    """The engine reports where it bound (maybe 0.0.0.0): reach it at the host we used."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    host = urlsplit(engine_address).hostname or "127.0.0.1"
    port = urlsplit(endpoint).port
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class MPClient(EngineCoreClient):
    """What both multi-process clients share: start-up, handshake, sending, death.

    A data-parallel client (frontend/engine_client/dp_client.py) runs one of these per engine core:
    it launches the processes itself (`process`, so that all of them load at once),
    names each core in its death messages (`label`) and hears of each death
    (`on_dead`, called once, from whichever thread noticed it)."""

    def __init__(self, args: EngineArgs | None, engine_address: str | None = None,
                 curve: CurveClientKeys | None = None, *, process: EngineProcess | None = None,
                 label: str | None = None, on_dead: Callable[[str], None] | None = None
                 ) -> None:
        if sum(x is not None for x in (args, engine_address, process)) != 1:
            raise ValueError("give engine args to launch an engine core, or an address")
        self.engine_process = EngineProcess(args) if args is not None else process
        self.address = engine_address or self.engine_process.address  # type: ignore[union-attr]
        self.curve = curve
        self.context = Context()
        self.dead_error: str | None = None
        self.label = label
        self._on_dead_callback = on_dead
        # The engine's load as its last message reported it, and the ADDs sent to it
        # beyond those that load accounts for (what a data-parallel client routes by).
        # Counting by acknowledgement, not "since the last report": a report computed
        # before an ADD arrived would otherwise hide it. Each count has one writer.
        self.reported_load = 0
        self.adds_sent = 0  # callers' thread
        self.adds_acknowledged = 0  # the output reader
        self._closed = False
        self._death_lock = threading.Lock()
        # zmq sockets are not thread-safe: an LLM generating in one thread while another
        # asks for stats interleaved two messages' frames, and the engine dropped both
        # as malformed (the stats call then timed out after 60 s).
        self._send_lock = threading.Lock()
        # Threads that poll this context's sockets: stopped before it is destroyed (a
        # socket closed under another thread's poll can hang zmq_ctx_term for good).
        self._pollers: list[threading.Thread] = []
        try:
            self.engine, reply = self._handshake()
            assert reply.info is not None and reply.client_index is not None
            self.output = self._connect_output(_endpoint_for(self.address,
                                                             reply.output_endpoint),
                                               reply.output_password)
        except BaseException:
            self._close_transport()
            raise
        self.info = reply.info
        self.client_index = reply.client_index
        # Created here, read only by the watcher thread (sockets are not thread-safe).
        monitors = [monitor_socket(s, zmq.EVENT_DISCONNECTED)
                    for s in (self.engine, self.output)]
        if self.engine_process is not None:
            # Connected: the socket files are no longer needed, so nothing is left behind
            # even if both processes are killed.
            self.engine_process.remove_socket_dir()
            threading.Thread(target=self._watch_process, name="engine-watcher",
                             daemon=True).start()
        self._start_poller(threading.Thread(target=self._watch_connection, args=(monitors,),
                                            name="engine-connection", daemon=True))
        self._encoder = MsgpackEncoder()
        self._decoder = MsgpackDecoder(EngineCoreOutputs)
        self._call_ids = itertools.count()

    # -- start-up --------------------------------------------------------------------

    def _new_socket(self, kind: int) -> zmq.Socket:
        sock = self.context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)  # never drop or block a request: queue it
        sock.setsockopt(zmq.RCVHWM, 0)  # take outputs off the wire as they come
        if self.curve is not None:
            self.curve.configure(sock)
        return sock

    def _handshake(self) -> tuple[zmq.Socket, HandshakeReply]:
        """HELLO, answered by READY. For an attached engine, an address that refuses
        every connection attempt (ZeroMQ retries: EVENT_CONNECT_RETRIED, never
        EVENT_CONNECTED) for REFUSED_TIMEOUT_S has nothing listening, and is named then;
        one that accepts the connection but does not answer (still loading its model:
        the HELLO waits in its socket) gets the whole REMOTE_HANDSHAKE_TIMEOUT_S. A
        launched engine is watched through its process instead."""
        sock = self._new_socket(zmq.DEALER)
        auth_failed = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                       | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
        local = self.engine_process is not None
        monitor = monitor_socket(sock, auth_failed if local else (
            auth_failed | zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED))
        sock.connect(self.address)
        sock.send_multipart([RequestType.HELLO.value,
                             msgspec.msgpack.encode(HandshakeRequest(PROTOCOL_VERSION))])
        timeout = LOCAL_STARTUP_TIMEOUT_S if local else REMOTE_HANDSHAKE_TIMEOUT_S
        deadline = time.monotonic() + timeout
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        attached = False
        connected = False
        first_refused: float | None = None
        try:
            while time.monotonic() < deadline:
                events = dict(poller.poll(100))
                if sock in events:
                    reply = msgspec.msgpack.decode(sock.recv_multipart()[-1],
                                                   type=HandshakeReply)
                    if reply.error is not None:
                        raise RuntimeError(f"engine core at {self.address} refused this "
                                           f"frontend: {reply.error}")
                    attached = True
                    return sock, reply
                while monitor.poll(0):
                    event = recv_monitor_message(monitor)["event"]
                    if event & auth_failed:
                        raise PermissionError(
                            f"CURVE authentication with the engine core at {self.address} "
                            "failed: it does not accept this frontend's key, or the "
                            "engine's public key given here is wrong")
                    connected = connected or event == zmq.EVENT_CONNECTED
                    if event == zmq.EVENT_CONNECT_RETRIED and first_refused is None:
                        first_refused = time.monotonic()
                if not connected and first_refused is not None \
                        and time.monotonic() - first_refused >= REFUSED_TIMEOUT_S:
                    raise ConnectionRefusedError(
                        f"nothing accepts connections at {self.address} (refused for "
                        f"{REFUSED_TIMEOUT_S:g} s): is the engine core running, and is this "
                        "its --address?")
                if self.engine_process is not None:
                    self.engine_process.check_starting()
        finally:
            sock.disable_monitor()
            monitor.close(linger=0)
            if not attached:
                sock.close(linger=0)
        raise TimeoutError(
            f"no answer from an engine core at {self.address} within {timeout:.0f} s "
            "(is it running? if it requires CURVE, are the keys right?)")

    def _connect_output(self, endpoint: str, password: str | None) -> zmq.Socket:
        sock = self._new_socket(zmq.PULL)
        if password is not None:  # the engine admits only the client it gave it to
            sock.plain_username, sock.plain_password = PLAIN_USER.encode(), password.encode()
        monitor = monitor_socket(sock, zmq.EVENT_HANDSHAKE_SUCCEEDED)
        sock.connect(endpoint)
        # The engine drops outputs for a client that has not connected yet: wait.
        if not monitor.poll(int(REMOTE_HANDSHAKE_TIMEOUT_S * 1000)):
            raise TimeoutError(f"could not connect to the engine core's {endpoint}")
        sock.disable_monitor()
        monitor.close(linger=0)
        return sock

    # -- requests --------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(RequestType.ADD, request)
        self.adds_sent += 1

    @property
    def load(self) -> int:
        """Requests waiting or running there, as far as this client knows."""
        return self.reported_load + self.adds_sent - self.adds_acknowledged

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self.dead_error is None and not self._closed:
            self._send(RequestType.ABORT, request_ids)

    def _send(self, kind: RequestType, payload: Any) -> None:
        self.check_alive()
        data = self._encoder.encode(payload)
        if len(data) > MAX_MESSAGE_BYTES:  # the engine would drop this connection
            what = f"request {payload.request_id!r}" if kind == RequestType.ADD \
                else f"this {kind.name.lower()} message"
            raise ValueError(f"{what} is {len(data)} bytes encoded, more than the "
                             f"{MAX_MESSAGE_BYTES} an engine core takes (its prompt, "
                             "arguments or extra_args are too large)")
        with self._send_lock:
            self.engine.send_multipart([kind.value, data])

    def _utility_request(self, method: UtilityMethod, args: tuple[Any, ...]) -> UtilityRequest:
        return UtilityRequest(next(self._call_ids), method, list(args))

    @staticmethod
    def _utility_result(method: UtilityMethod, outputs: EngineCoreOutputs) -> Any:
        result = outputs.utility_output
        assert result is not None
        if result.failure is not None:
            raise RuntimeError(f"engine core utility call {method.name.lower()} failed: "
                               f"{result.failure}")
        return msgspec.msgpack.decode(result.result or b"", type=SIGNATURES[method].result)

    # -- death and shutdown ----------------------------------------------------------

    def check_alive(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(self.dead_error)
        if self._closed:
            raise RuntimeError("this engine-core client has been shut down")

    def _watch_process(self) -> None:
        assert self.engine_process is not None
        self.engine_process.wait_exit()
        if not self._closed:
            self._on_dead(self.engine_process.exit_cause() or "engine core exited")

    def _watch_connection(self, monitors: list[zmq.Socket]) -> None:
        """Both sockets' connections: losing either means the engine is gone (it
        aborts what we sent when it loses us too)."""
        poller = zmq.Poller()
        for monitor in monitors:
            poller.register(monitor, zmq.POLLIN)
        try:
            while not self._closed and self.dead_error is None:
                events = dict(poller.poll(100))
                if not any(m in events and recv_monitor_message(m) for m in monitors):
                    continue
                cause = f"lost the connection to the engine core at {self.address}"
                deadline = time.monotonic() + _EXIT_WAIT_S
                if self.engine_process is not None:  # the exit says more, if it comes
                    while self.engine_process.exit_cause() is None \
                            and time.monotonic() < deadline:
                        time.sleep(0.01)
                    cause = self.engine_process.exit_cause() or cause
                else:  # an engine that stops says why before it hangs up: let that win
                    deadline = time.monotonic() + _LAST_WORD_WAIT_S
                    while self.dead_error is None and time.monotonic() < deadline:
                        time.sleep(0.01)
                self._on_dead(cause)
        except zmq.ZMQError:
            return  # the context was closed under us: shutting down
        finally:
            for monitor in monitors:
                with contextlib.suppress(zmq.ZMQError):
                    monitor.close(linger=0)

    def _on_silence(self) -> None:
        """The engine stopped writing: dead. Its output thread sends a heartbeat every
        0.5 s whatever its busy loop does, so silence means the process is stopped or
        hung as a whole (SIGSTOP, a lock held forever). A launched one is then killed,
        so that it frees its memory and no call waits on it."""
        process = self.engine_process
        self._on_dead(f"no heartbeat from the engine core at {self.address} for "
                      f"{HEARTBEAT_TIMEOUT_S:.0f} s"
                      + ("" if process is None else f" (pid {process.proc.pid}, killed)"))
        if process is not None:
            process.proc.kill()  # SIGKILL reaches a stopped process too

    def _on_dead(self, cause: str) -> None:
        self.die(cause if self.label is None else f"{self.label}: {cause}")

    def die(self, cause: str) -> None:
        """Mark the engine dead with `cause` (as given) and wake every waiter; the first
        cause wins. A data-parallel client also calls it for the cores that outlive
        another's death."""
        with self._death_lock:
            if self.dead_error is not None or self._closed:
                return
            self.dead_error = cause
        self._notify_dead(cause)
        if self._on_dead_callback is not None:
            self._on_dead_callback(cause)

    def _notify_dead(self, cause: str) -> None:
        """Wake every waiter (subclasses)."""

    def _check_outputs(self, outputs: EngineCoreOutputs) -> None:
        self.reported_load = outputs.num_waiting + outputs.num_running
        self.loop_busy_s = outputs.loop_busy_s
        self.adds_acknowledged = outputs.num_adds_taken
        if outputs.engine_dead is not None:
            self._on_dead(outputs.engine_dead)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.engine_process is None and self.dead_error is None:
            # Attached: tell the engine we leave, so it aborts what we left running.
            with contextlib.suppress(zmq.ZMQError), self._send_lock:
                self.engine.send_multipart([RequestType.BYE.value, b""])
                self.engine.setsockopt(zmq.LINGER, 1000)
        self._close_transport()

    def _start_poller(self, thread: threading.Thread) -> None:
        self._pollers.append(thread)
        thread.start()

    def _close_transport(self) -> None:
        self._closed = True
        for thread in self._pollers:  # each wakes within 100 ms and sees _closed
            if thread is not threading.current_thread():
                thread.join(timeout=2.0)
        if self.engine_process is not None:
            # Stop the engine first: it still talks to our sockets until it exits.
            self.engine_process.terminate()
            self.context.destroy(linger=0)
        else:
            self.context.destroy()  # each socket's own linger: the BYE gets out
