"""The frontend's side of ZeroMQ CURVE: the key files it connects to engine cores
with, and the authenticator of the socket where remote engine cores register (data
parallel across hosts). The engine's side is transport/sockets.py."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

logger = logging.getLogger("pagellm")


@dataclass(frozen=True)
class CurveClientKeys:
    """Key files for an engine core that requires CURVE (zmq.auth's format)."""

    secret_key_file: Path  # this frontend's key pair ("*.key_secret")
    server_public_key_file: Path  # the engine's public key ("*.key")

    @classmethod
    def from_paths(cls, secret_key: str | None, server_public_key: str | None
                   ) -> CurveClientKeys | None:
        """Both or neither (None: no CURVE)."""
        if (secret_key is None) != (server_public_key is None):
            raise ValueError("curve_secret_key and curve_server_public_key go together")
        if secret_key is None or server_public_key is None:
            return None
        return cls(Path(secret_key), Path(server_public_key))

    def configure(self, sock: zmq.Socket) -> None:
        import zmq.auth

        for path in (self.secret_key_file, self.server_public_key_file):
            if not Path(path).is_file():
                raise FileNotFoundError(f"CURVE key file not found: {path}")
        public, secret = zmq.auth.load_certificate(self.secret_key_file)
        if secret is None:
            raise ValueError(f"{self.secret_key_file} holds no secret key")
        server_public, _ = zmq.auth.load_certificate(self.server_public_key_file)
        sock.curve_publickey, sock.curve_secretkey = public, secret
        sock.curve_serverkey = server_public


class _OnlyKey:
    """A ZAP credentials provider that admits one CURVE public key (z85)."""

    def __init__(self, key: bytes) -> None:
        self.key = key

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.key


def allow_only(context: zmq.Context, curve: CurveClientKeys) -> Any:
    """A started ZAP authenticator on `context` that admits only the engine cores'
    public key (`curve.server_public_key_file`)."""
    import zmq.auth
    from zmq.auth.thread import ThreadAuthenticator

    public, _ = zmq.auth.load_certificate(curve.server_public_key_file)
    auth = ThreadAuthenticator(context, log=logger)
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=_OnlyKey(public))
    return auth
