"""`pagellm serve MODEL -dp N --data-parallel-size-local L --data-parallel-start-rank S
--data-parallel-address A --data-parallel-rpc-port P --headless`: engine cores only.

A node other than the frontend's runs data-parallel ranks S..S+L-1 here: each is the
standalone engine core (`python -m pagellm.enginecore`, launched like a frontend's own,
with a lifeline) bound to tcp on the interface that routes to A. Once they are loaded,
one DEALER socket registers their addresses with the frontend's data-parallel client,
listening at tcp://A:P, which then attaches to each as to any standalone engine core.

Across hosts both sides need ZeroMQ CURVE keys, the same two flags on each (as for
attaching to a standalone engine core): on this node `--curve-secret-key` is the key
pair its engine cores serve with (and register with) and `--curve-server-public-key`
the frontend's public key, the only key its cores admit; on the frontend's node they are
the frontend's key pair and the engine cores' public key. Without keys, only loopback.

The node keeps its cores until one of them exits, the frontend goes away (the
registration connection drops: ZeroMQ heartbeats notice a silent peer too), or
SIGTERM/SIGINT; then it stops them all. No API server runs here.
"""

from __future__ import annotations

import logging
import shutil
import signal
import socket
import tempfile
import time
from pathlib import Path
from types import FrameType

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from pagellm.frontend.engine_client.dp_registration import (
    local_ranks,
    rank_label,
    registration_address,
)
from pagellm.frontend.engine_client.engine_process import EngineProcess
from pagellm.frontend.engine_client.mp_client import LOCAL_STARTUP_TIMEOUT_S
from pagellm.protocol.engine_args import EngineArgs
from pagellm.protocol.messages import PROTOCOL_VERSION, DPRegister, DPRegisterReply
from pagellm.transport.curve import CurveClientKeys
from pagellm.transport.sockets import Context, is_loopback
from pagellm.transport.sockets import monitor as monitor_socket

logger = logging.getLogger("pagellm")

HEARTBEAT_MS = 1000  # ZMTP heartbeats on the registration connection ...
HEARTBEAT_TIMEOUT_MS = 5000  # ... a frontend silent this long is gone
_POLL_MS = 100


class _Stop(Exception):
    """SIGTERM or SIGINT."""


def host_towards(address: str) -> str:
    """The IP address of this host's interface that routes to `address` (a UDP
    'connect' sends nothing): where the frontend can reach our engine cores."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((address.strip("[]"), 9))
        return str(s.getsockname()[0])


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _tcp(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def run_dp_node(args: EngineArgs, curve: CurveClientKeys | None = None) -> int:
    """Serve this node's engine cores until they or the frontend stop: 0 when the
    frontend left or a signal came, 1 when a core failed or the frontend refused us.
    `curve`: this node's key pair and the frontend's public key."""
    ranks, frontend, host = _node_plan(args, curve)
    stop: list[str] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.append(signal.Signals(signum).name)
        raise _Stop

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    processes: dict[int, EngineProcess] = {}
    context = Context()
    keys_dir = None
    extra: list[str] = []
    try:
        if curve is not None:  # the engine cores admit the frontend's key alone
            keys_dir = tempfile.mkdtemp(prefix="pagellm-dp-keys-")
            shutil.copy(curve.server_public_key_file, Path(keys_dir) / "frontend.key")
            extra = ["--curve-secret-key", str(curve.secret_key_file),
                     "--curve-authorized-keys", keys_dir]
        for rank in ranks:
            address = _tcp(host, _free_port(host))
            processes[rank] = EngineProcess(args.replace(data_parallel_rank=rank), address,
                                            num_local=len(ranks), extra_args=extra)
        _wait_ready(processes)
        sock = _register(context, curve, frontend, processes)
        if sock is None:
            return 1
        logger.info("data-parallel rank(s) %s attached to the frontend at %s", list(ranks),
                    frontend)
        return _serve_until_gone(sock, frontend, processes)
    except _Stop:
        logger.info("%s: stopping this node's engine cores", stop[0])
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for process in processes.values():
            process.terminate()
        context.destroy(linger=0)
        if keys_dir is not None:
            shutil.rmtree(keys_dir, ignore_errors=True)


def _node_plan(args: EngineArgs, curve: CurveClientKeys | None
               ) -> tuple[range, str, str]:
    """(this node's data-parallel ranks, the frontend's registration address, this host's
    address towards it), after the checks a headless node needs."""
    if args.data_parallel_size_local is None:
        raise ValueError("--headless needs --data-parallel-size-local (the engine cores "
                         "on this node)")
    ranks = local_ranks(args)
    if not ranks:
        raise ValueError("--headless with --data-parallel-size-local 0 has nothing to run")
    frontend = registration_address(args)
    host = host_towards(args.data_parallel_address)
    if curve is None and not is_loopback(_tcp(host, 1)):
        raise ValueError(
            f"data-parallel engine cores on {host} would be reachable from the network: "
            "give ZeroMQ CURVE keys (--curve-secret-key: this node's key pair; "
            "--curve-server-public-key: the frontend's public key)")
    return ranks, frontend, host


def _register(context: Context, curve: CurveClientKeys | None, frontend: str,
              processes: dict[int, EngineProcess]) -> zmq.Socket | None:
    """Register the ready cores' addresses with the frontend: the DEALER socket, whose
    connection (heartbeats on) then tells the frontend's departure; None (logged) when a
    core failed meanwhile, the CURVE handshake was refused, or the frontend refused us."""
    sock = context.socket(zmq.DEALER)
    if curve is not None:
        curve.configure(sock)
    refused = monitor_socket(sock, zmq.EVENT_HANDSHAKE_FAILED_AUTH
                             | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                             | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.connect(frontend)
    sock.send(msgspec.msgpack.encode(DPRegister(
        PROTOCOL_VERSION, list(processes), [p.address for p in processes.values()])))
    logger.info("data-parallel rank(s) %s ready; registering with the frontend at %s",
                list(processes), frontend)
    while not sock.poll(_POLL_MS):
        if (failed := _failed(processes)) is not None:
            logger.error("%s", failed)
            return None
        if refused.poll(0):
            logger.error("CURVE authentication with the frontend at %s failed: it does "
                         "not admit this node's key, or its public key given here is "
                         "wrong", frontend)
            return None
    reply = msgspec.msgpack.decode(sock.recv(), type=DPRegisterReply)
    sock.disable_monitor()  # one monitor per socket: the next watches departures
    refused.close(linger=0)
    if reply.error is not None:
        logger.error("the frontend at %s refused this node: %s", frontend, reply.error)
        return None
    return sock


def _serve_until_gone(sock: zmq.Socket, frontend: str,
                      processes: dict[int, EngineProcess]) -> int:
    """Until the frontend's connection drops (0) or a core exits (1)."""
    monitor = monitor_socket(sock, zmq.EVENT_DISCONNECTED)
    while True:
        if monitor.poll(_POLL_MS) and recv_monitor_message(monitor):
            logger.info("the frontend at %s is gone: stopping this node's engine cores",
                        frontend)
            return 0
        if (failed := _failed(processes)) is not None:
            logger.error("%s: stopping this node's engine cores", failed)
            return 1


def _failed(processes: dict[int, EngineProcess]) -> str | None:
    for rank, process in processes.items():
        cause = process.exit_cause()
        if cause is not None:
            return f"{rank_label(rank)}: {cause}"
    return None


def _wait_ready(processes: dict[int, EngineProcess]) -> None:
    """Until every core serves (READY on its status pipe: it binds before it loads)."""
    deadline = time.monotonic() + LOCAL_STARTUP_TIMEOUT_S
    waiting = dict(processes)
    while waiting:
        for rank, process in list(waiting.items()):
            process.check_starting(rank_label(rank))
            if process.ready():
                del waiting[rank]
        if time.monotonic() > deadline:
            raise TimeoutError(f"data-parallel rank(s) {sorted(waiting)} did not start "
                               f"within {LOCAL_STARTUP_TIMEOUT_S:.0f} s")
        time.sleep(0.1)
