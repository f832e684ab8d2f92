"""The engine core's side of ZeroMQ: where sockets bind, and CURVE authentication.

Binding anything a network peer can reach requires CURVE: a TCP address other than
loopback is refused unless the engine has a secret key and a directory of authorized
client public keys (as written by `zmq.auth.create_certificates`).
"""

from __future__ import annotations

import contextlib
import glob
import ipaddress
import itertools
import logging
import secrets
import shutil
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import zmq

from pagellm.protocol.messages import MAX_MESSAGE_BYTES

logger = logging.getLogger("pagellm")


@dataclass(frozen=True)
class CurveServerKeys:
    secret_key_file: Path  # this engine's key pair (zmq.auth "*.key_secret" file)
    authorized_keys_dir: Path  # public keys of the frontends allowed in

    def load(self) -> tuple[bytes, bytes]:
        import zmq.auth

        if not self.secret_key_file.is_file():
            raise FileNotFoundError(f"CURVE secret key file not found: {self.secret_key_file}")
        if not self.authorized_keys_dir.is_dir():
            raise FileNotFoundError(
                f"CURVE authorized keys directory not found: {self.authorized_keys_dir}")
        public, secret = zmq.auth.load_certificate(self.secret_key_file)
        if secret is None:
            raise ValueError(f"{self.secret_key_file} holds no secret key (use the "
                             "'.key_secret' file written by zmq.auth.create_certificates)")
        return public, secret


_monitor_ids = itertools.count()
PLAIN_USER = "pagellm"  # the user name of PLAIN-authenticated client sockets


class Context(zmq.Context):
    """A zmq context whose finalizer never blocks the thread that drops it.

    Every socket defaults to LINGER 0 (nothing waits on a gone peer). pyzmq's own
    finalizer terminates the context in whatever thread the garbage collector runs,
    and `zmq_ctx_term` blocks until every socket is closed: for a client dropped
    without shutdown (a leaked `LLM`), that has hung a caller for good. Here a
    context dropped unclosed is terminated on a daemon thread instead."""

    def __init__(self) -> None:
        super().__init__()
        self.setsockopt(zmq.LINGER, 0)

    def __del__(self) -> None:
        if self.closed or getattr(self, "_shadow", False):
            return
        # At interpreter exit the process's end frees it. A thread started then never
        # runs, and `Thread.start` waits for it forever: a process that exited with a
        # context open (an engine core whose frontend died) hung there for good.
        if sys.is_finalizing():
            return
        with contextlib.suppress(RuntimeError):  # Python 3.12+: no new threads at exit
            threading.Thread(target=self.destroy, kwargs={"linger": 0}, daemon=True,
                             name="zmq-context-term").start()


def monitor(sock: zmq.Socket, events: int) -> zmq.Socket:
    """A PAIR socket that receives `sock`'s events (zmq.utils.monitor's format). Each
    monitor gets its own inproc address: a socket monitored again after
    `disable_monitor()` would otherwise reuse one that may still be bound."""
    events_socket = sock.get_monitor_socket(events,
                                            f"inproc://pagellm-monitor-{next(_monitor_ids)}")
    events_socket.setsockopt(zmq.LINGER, 0)
    return events_socket


def tcp_host(address: str) -> str | None:
    """'tcp://10.0.0.5:5555' -> '10.0.0.5'; None for other transports."""
    if not address.startswith("tcp://"):
        return None
    host = urlsplit(address).hostname
    if host is None:
        raise ValueError(f"not a tcp://HOST:PORT address: {address!r}")
    return host


def is_loopback(address: str) -> bool:
    """ipc:// and inproc:// stay on this machine; tcp:// only on a loopback host."""
    if address.startswith(("ipc://", "inproc://")):
        return True
    host = tcp_host(address)
    if host is None:
        raise ValueError(f"unsupported address {address!r} (use tcp://HOST:PORT or ipc://PATH)")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name or wildcard ("*"): reachable from the network


def data_endpoint(address: str, suffix: str) -> str:
    """Where a data socket binds beside the handshake address: a sibling ipc path, or
    a free port on the same TCP interface."""
    if address.startswith("ipc://"):
        return f"{address}.{suffix}"
    return f"tcp://{tcp_host(address)}:*"


class SocketFactory:
    """Makes the engine's sockets, all of them CURVE servers when keys are given.

    For an ipc:// address the socket files live beside the address: ZeroMQ removes
    them when the sockets close, stale ones from a killed run are removed here, and
    with `owns_directory` (an engine launched by a frontend, in the frontend's private
    temporary directory) the whole directory goes on close.
    """

    def __init__(self, address: str, curve: CurveServerKeys | None,
                 owns_directory: bool = False) -> None:
        if curve is None and not is_loopback(address):
            raise ValueError(
                f"refusing to bind {address} without authentication: a non-loopback TCP "
                "address needs ZeroMQ CURVE keys (--curve-secret-key and "
                "--curve-authorized-keys; see docs/ARCHITECTURE.md)")
        self.address = address
        self.ipc_path = Path(address.removeprefix("ipc://")) if address.startswith("ipc://") \
            else None
        self.owns_directory = owns_directory and self.ipc_path is not None
        if self.ipc_path is not None:  # per-client sockets a SIGKILLed engine left behind
            for stale in self.ipc_path.parent.glob(glob.escape(self.ipc_path.name) + ".out*"):
                with contextlib.suppress(OSError):
                    stale.unlink()
        self.context = Context()
        self._ipc_files: list[Path] = []
        self._auth: Any = None
        self._keys: tuple[bytes, bytes] | None = None
        self._domains = itertools.count()
        if curve is not None:
            from zmq.auth.thread import ThreadAuthenticator

            self._keys = curve.load()
            self._auth = ThreadAuthenticator(self.context, log=logger)
            self._auth.start()
            self._auth.configure_curve(domain="*", location=str(curve.authorized_keys_dir))

    def bind_private(self, kind: int, endpoint: str, options: dict[int, int] | None = None
                     ) -> tuple[zmq.Socket, str, str | None]:
        """`bind` for one client's socket: (socket, endpoint, password). Without CURVE
        the socket admits only a peer that sends the password (ZeroMQ's PLAIN
        mechanism, checked by this context's ZAP handler), which the client gets in its
        handshake reply: knowing a port is not enough to connect (a stranger on a
        loopback TCP engine once read another client's outputs that way). With CURVE,
        only authorized keys connect at all (None). `forget_password` undoes it."""
        if self._keys is not None:
            return (*self.bind(kind, endpoint, options), None)
        if self._auth is None:
            from zmq.auth.thread import ThreadAuthenticator

            self._auth = ThreadAuthenticator(self.context, log=logger)
            self._auth.start()
        domain, password = f"pagellm-{next(self._domains)}", secrets.token_urlsafe(24)
        self._auth.configure_plain(domain=domain, passwords={PLAIN_USER: password})
        try:
            sock, bound = self.bind(kind, endpoint, options, plain_domain=domain)
        except zmq.ZMQError:
            self._auth.passwords.pop(domain, None)
            raise
        return sock, bound, password

    def forget_password(self, password: str | None) -> None:
        """A departed client's password is no longer accepted (nor kept)."""
        if password is None or self._auth is None:
            return
        for domain, users in list(self._auth.passwords.items()):
            if users.get(PLAIN_USER) == password:
                self._auth.passwords.pop(domain, None)

    def bind(self, kind: int, endpoint: str, options: dict[int, int] | None = None,
             plain_domain: str | None = None) -> tuple[zmq.Socket, str]:
        """A bound socket and the endpoint it actually bound (ports resolved).

        `options` (zmq socket options) are set before binding: ZeroMQ copies a socket's
        options into its listener when it binds, so a limit set afterwards (MAXMSGSIZE,
        SNDHWM) never reaches the connections it accepts."""
        sock = self.context.socket(kind)
        for option, value in (options or {}).items():
            sock.setsockopt(option, value)
        if self._keys is not None:
            sock.curve_publickey, sock.curve_secretkey = self._keys
            sock.curve_server = True
        elif plain_domain is not None:
            sock.plain_server = True
            sock.zap_domain = plain_domain.encode()
        try:
            sock.bind(endpoint)
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if bound.startswith("ipc://"):
            self._ipc_files.append(Path(bound.removeprefix("ipc://")))
        return sock, bound

    def close(self) -> None:
        if self._auth is not None:
            self._auth.stop()
        self.context.destroy(linger=0)
        for path in self._ipc_files:  # ZeroMQ unlinks them only eventually, if at all
            with contextlib.suppress(OSError):
                path.unlink()
        if self.owns_directory and self.ipc_path is not None:
            shutil.rmtree(self.ipc_path.parent, ignore_errors=True)


def bind_frontends(sockets: SocketFactory) -> zmq.Socket:
    """The ROUTER every client talks to, at the engine's address. The entry point binds
    it before it imports torch or loads the model: a frontend attaching meanwhile
    connects and its HELLO waits in the socket for READY, so a frontend that is refused
    can tell at once that nothing runs there (`MPClient._handshake`), instead of
    retrying for its whole handshake timeout in case an engine is still loading."""
    sock, _ = sockets.bind(zmq.ROUTER, sockets.address, {
        zmq.ROUTER_MANDATORY: 1,  # a reply to a gone peer raises
        zmq.MAXMSGSIZE: MAX_MESSAGE_BYTES})
    return sock
