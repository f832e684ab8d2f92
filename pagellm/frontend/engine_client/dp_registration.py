"""Where engine cores of other nodes register (`pagellm serve --headless`, dp_node.py):
the data-parallel client's listening socket and the checks a registration passes.

The socket stays bound for the client's life (its close tells the headless nodes to
stop), so what anyone can make it hold is bounded: message size, queue, and what an
error echoes back of a registrant's strings.
"""

from __future__ import annotations

import logging
import re
import socket
import time
from typing import Any

import msgspec
import zmq

from pagellm.frontend.engine_client.engine_process import EngineProcess
from pagellm.frontend.engine_client.mp_client import LOCAL_STARTUP_TIMEOUT_S
from pagellm.protocol.engine_args import EngineArgs
from pagellm.protocol.messages import PROTOCOL_VERSION, DPRegister, DPRegisterReply
from pagellm.protocol.validation import MAX_HOST_CHARS
from pagellm.transport.curve import CurveClientKeys, allow_only
from pagellm.transport.sockets import Context, is_loopback

logger = logging.getLogger("pagellm")
# What the registration socket takes (it stays bound, unread, for this client's life:
# its close tells headless nodes to stop). A DPRegister is [version, ranks, addresses]:
# a msgpack array of an int and two lists, then per rank an int (at most 9 bytes) and
# an address, tcp://HOST:PORT with HOST at most 253 characters (or a bracketed IPv6
# address), behind a string header of at most 5 bytes. Larger messages make ZeroMQ
# drop the connection before anything is read.
MAX_ADDRESS_CHARS = len("tcp://[") + MAX_HOST_CHARS + len("]:65535")
_REGISTER_OVERHEAD_BYTES = 64  # array headers and the protocol version
_REGISTER_RANK_BYTES = 9 + 5 + MAX_ADDRESS_CHARS  # one rank and its address
REGISTRATION_HWM = 4  # messages queued per connection; beyond, ZeroMQ holds off
REGISTRATION_PROBE_S = 2.0  # a registered address must accept a TCP connection by then
_ECHO_CHARS = 80  # at most this much of a registrant's string in errors and logs
_ADDRESS = re.compile(
    r"tcp://(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):(?P<port>[0-9]{1,5})")


def max_registration_bytes(num_ranks: int) -> int:
    """The largest DPRegister of `num_ranks` ranks (the registration socket's
    MAXMSGSIZE, with data_parallel_size: no node registers more ranks than that)."""
    return _REGISTER_OVERHEAD_BYTES + num_ranks * _REGISTER_RANK_BYTES


def clip(text: str) -> str:
    """A client's string as errors and logs may show it: repr, at most _ECHO_CHARS."""
    return repr(text[:_ECHO_CHARS]) + ("..." if len(text) > _ECHO_CHARS else "")


def check_engine_address(address: str) -> tuple[str, int]:
    """tcp://HOST:PORT (HOST a name or IPv4 address of at most 253 characters, or an
    IPv6 address in brackets; PORT 1-65535) -> (host, port); ValueError if not."""
    match = _ADDRESS.fullmatch(address) if len(address) <= MAX_ADDRESS_CHARS else None
    if match is None or len(match["host"].strip("[]")) > MAX_HOST_CHARS:
        raise ValueError(f"not a tcp://HOST:PORT address: {clip(address)}")
    port = int(match["port"])
    if not 1 <= port <= 65535:
        raise ValueError(f"port out of range (1-65535): {clip(address)}")
    return match["host"].strip("[]"), port


def rank_label(rank: int) -> str:
    return f"engine core of data-parallel rank {rank}"


def registration_address(args: EngineArgs) -> str:
    """Where a frontend with remote engine cores listens for their registration."""
    host = args.data_parallel_address
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"tcp://{host}:{args.data_parallel_rpc_port}"


def local_ranks(args: EngineArgs) -> range:
    """The data-parallel ranks whose engine cores run on this node."""
    size = args.data_parallel_size
    local = size if args.data_parallel_size_local is None else args.data_parallel_size_local
    start = args.data_parallel_start_rank
    if start + local > size:
        raise ValueError(f"data_parallel_start_rank={start} + data_parallel_size_local="
                         f"{local} exceeds data_parallel_size={size}")
    return range(start, start + local)


class RegistrationListener:
    """Listens where headless nodes register their engine cores (`wait`).

    With CURVE keys (this frontend's key pair, the engine cores' public key) the socket
    is a CURVE server that admits only that engine key: the nodes register with the key
    pair their engine cores serve with, and the client attaches to those cores with its
    own. Without keys, only a loopback address is allowed (as for any engine socket: see
    transport/sockets.py)."""

    def __init__(self, args: EngineArgs, curve: CurveClientKeys | None) -> None:
        self.address = registration_address(args)
        if curve is None and not is_loopback(self.address):
            raise ValueError(
                f"refusing to listen on {self.address} without authentication: data "
                "parallel across hosts needs ZeroMQ CURVE keys (curve_secret_key: this "
                "frontend's key pair; curve_server_public_key: the engine cores' public key)")
        self._context = Context()
        self._auth: Any = None
        self.socket = self._context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.MAXMSGSIZE, max_registration_bytes(args.data_parallel_size))
        self.socket.setsockopt(zmq.RCVHWM, REGISTRATION_HWM)
        if curve is not None:
            self._auth = allow_only(self._context, curve)
            curve.configure(self.socket)  # key pair; the server key set here goes unused
            self.socket.curve_server = True
        try:
            self.socket.bind(self.address)
        except BaseException:
            self.close()
            raise

    def wait(self, ranks: list[int], local: dict[int, EngineProcess]) -> dict[int, str]:
        """Each rank of `ranks` -> the address its engine core serves at, once every one
        has registered; fail at once if a core of this node (`local`) fails meanwhile."""
        found: dict[int, str] = {}
        deadline = time.monotonic() + LOCAL_STARTUP_TIMEOUT_S
        logger.info("waiting for data-parallel rank(s) %s to register at %s", ranks,
                    self.address)
        while len(found) < len(ranks):
            if time.monotonic() > deadline:
                missing = sorted(set(ranks) - set(found))
                raise TimeoutError(f"data-parallel rank(s) {missing} did not register at "
                                   f"{self.address} within {LOCAL_STARTUP_TIMEOUT_S:.0f} s")
            for rank, process in local.items():
                process.check_starting(rank_label(rank))
            if not self.socket.poll(100):
                continue
            frames = self.socket.recv_multipart()
            try:
                message = msgspec.msgpack.decode(frames[-1], type=DPRegister)
                error = self._registered(message, ranks, found)
            except msgspec.DecodeError as e:
                error = f"not a registration: {clip(str(e))}"
            reply = msgspec.msgpack.encode(DPRegisterReply(error))
            self.socket.send_multipart([frames[0], reply])
            if error is not None:
                logger.warning("refused a data-parallel registration: %s", error)
            else:
                logger.info("data-parallel rank(s) %s registered", message.ranks)
        return found

    @staticmethod
    def _registered(message: DPRegister, wanted: list[int], found: dict[int, str]
                    ) -> str | None:
        """Take a headless node's registration into `found`; why not, if not (the
        ranks stay open for the genuine node then)."""
        if message.protocol_version != PROTOCOL_VERSION:
            return f"protocol version {message.protocol_version} is not supported " \
                   f"(this frontend speaks {PROTOCOL_VERSION})"
        if len(message.ranks) != len(message.addresses) or not message.ranks:
            return "ranks and addresses must pair up"
        seen: set[int] = set()
        endpoints = []
        for rank, address in zip(message.ranks, message.addresses, strict=True):
            if rank in seen:
                return f"rank {rank} is registered twice in one message"
            seen.add(rank)
            if rank not in wanted:
                return f"rank {rank} is not one this frontend waits for ({wanted})"
            if rank in found:
                return f"rank {rank} is already registered"
            try:
                endpoints.append(check_engine_address(address))
            except ValueError as e:
                return f"rank {rank}: {e}"
        for rank, address, (host, port) in zip(message.ranks, message.addresses, endpoints,
                                                strict=True):
            try:  # an engine core that registers is bound already
                socket.create_connection((host, port), timeout=REGISTRATION_PROBE_S).close()
            except (OSError, ValueError) as e:  # ValueError: a name IDNA refuses
                return f"rank {rank}: nothing accepts connections at {clip(address)} " \
                       f"({clip(str(e))})"
        found.update(zip(message.ranks, message.addresses, strict=True))
        return None

    def close(self) -> None:
        """Unbind: the headless nodes see the connection close and stop their cores."""
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        self._context.destroy(linger=0)
