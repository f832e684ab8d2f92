"""vLLM's `vllm.utils.network_utils`: the address a trainer advertises to the engine's
workers for the weight-transfer group (TRL's `init_communicator` sends `get_ip()`)."""

from __future__ import annotations

import os
import socket

# vLLM's override, honoured first: on a machine with several interfaces only the
# operator knows which one the workers reach.
HOST_IP_ENV = "VLLM_HOST_IP"


def get_ip() -> str:
    """This host's address on its outbound route (VLLM_HOST_IP if set): a UDP socket
    "connected" to a public address picks the interface without sending a packet.
    Without any route (an offline machine), the loopback address, which serves
    trainers and engines on the one host."""
    if os.environ.get(HOST_IP_ENV):
        return os.environ[HOST_IP_ENV]
    for family, probe in ((socket.AF_INET, "8.8.8.8"), (socket.AF_INET6, "2001:4860:4860::8888")):
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect((probe, 80))
                return str(s.getsockname()[0])
        except OSError:
            continue
    return "127.0.0.1"


def get_open_port() -> int:
    """A TCP port free at the time of the call (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


__all__ = ["get_ip", "get_open_port"]
