"""Data parallelism: one client, several engine cores (vLLM's `DPLBAsyncMPClient`).

With data_parallel_size=N the frontend runs N engine cores, each a process of its own
with its own KV cache (and its own tensor-parallel workers), and talks to them through
one `MPClient` per core; `DPSyncClient` (for `LLM`) and `DPAsyncClient` (for
`AsyncLLM` and the server) put them behind the one client interface:

- A new request goes to the least loaded core: waiting + running as the core reported
  in its last message (every message carries it, heartbeats too) plus the ADDs this
  client sent there that the report does not account for yet (it says how many it
  does: a report computed before an ADD arrived must not hide it). Near-ties go to the
  core that holds the longest prefix of the prompt (dp_routing.py's `Router`).
- An abort goes to the core that holds the request (request id -> core, forgotten
  once the request finishes); utility calls go to every core at once and their
  results are merged (dp_routing.py's `merge_results`, the one place that says how).
- The death of any core is every waiter's `EngineDeadError`, naming the core's rank,
  and stops all the others (nothing is left running).
- Cores of other nodes (data_parallel_size_local < data_parallel_size) are started by
  `pagellm serve --headless` there (frontend/headless.py): they bind tcp on their host
  and register their addresses at --data-parallel-address:--data-parallel-rpc-port,
  where this client listens; it then attaches to each as to a standalone engine core.
  A headless node stops its cores when this client closes that socket.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import re
import socket
import threading
import time
from abc import abstractmethod
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq

from pagellm.enginecore.transport import Context, is_loopback
from pagellm.frontend.async_mp_client import AsyncMPClient, LoopQueue, OutputQueue
from pagellm.frontend.core_client import (
    UTILITY_TIMEOUT_S,
    AsyncEngineCoreClient,
    EngineCoreClient,
    EngineDeadError,
    SyncEngineCoreClient,
)
from pagellm.frontend.curve import CurveClientKeys, allow_only
from pagellm.frontend.dp_routing import Router, merge_infos, merge_results
from pagellm.frontend.engine_process import EngineProcess
from pagellm.frontend.mp_client import LOCAL_STARTUP_TIMEOUT_S, MPClient
from pagellm.frontend.sync_mp_client import SyncMPClient
from pagellm.protocol.engine_args import EngineArgs
from pagellm.protocol.messages import (
    PROTOCOL_VERSION,
    DPRegister,
    DPRegisterReply,
    EngineCoreOutputs,
    EngineCoreRequest,
    UtilityMethod,
)
from pagellm.protocol.validation import MAX_HOST_CHARS

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


class DPClient(EngineCoreClient):
    """What the sync and async data-parallel clients share: start-up, routing, aborts,
    death and shutdown."""

    clients: Sequence[MPClient]

    def __init__(self, args: EngineArgs, curve: CurveClientKeys | None = None) -> None:
        self.args = args
        self.curve = curve  # for cores of other nodes: see _await_registrations
        self.dead_error: str | None = None
        self._closed = False
        self._fail_lock = threading.Lock()
        self._stop_lock = threading.Lock()
        self._stopper: threading.Thread | None = None
        self._context: Context | None = None
        self._registration: zmq.Socket | None = None
        self._auth: Any = None
        self._owner: dict[str, int] = {}  # request id -> the rank that holds it
        size = args.data_parallel_size
        self.requests_per_engine = [0] * size  # routed here, cumulative
        ranks = local_ranks(args)
        if len(ranks) < size:
            self._check_registration_address()
        clients: list[MPClient] = []
        self.clients = clients
        processes: dict[int, EngineProcess] = {}
        try:
            for rank in ranks:  # all load at once
                processes[rank] = EngineProcess(args.replace(data_parallel_rank=rank),
                                                num_local=len(ranks))
            remote = self._await_registrations(
                [r for r in range(size) if r not in processes], processes)
            for rank in range(size):
                on_dead = functools.partial(self._on_core_dead, rank)
                if rank in processes:
                    clients.append(self._make_client(
                        None, process=processes.pop(rank), label=rank_label(rank),
                        on_dead=on_dead))
                else:
                    clients.append(self._make_client(
                        remote[rank], curve=curve, label=rank_label(rank), on_dead=on_dead))
            self.info = merge_infos([c.info for c in clients])
        except BaseException:
            for process in processes.values():
                process.terminate()
            self._closed = True
            self._stop_all()
            raise
        self.router = Router(self.info.block_size, [c.info.num_kv_blocks for c in clients])
        if self.dead_error is not None:  # a core died while the others started
            self.shutdown()
            raise EngineDeadError(self.dead_error)

    @abstractmethod
    def _make_client(self, engine_address: str | None, **options: Any) -> MPClient:
        """One engine core's client (`MPClient`'s keyword options)."""

    def engine_busy_s(self) -> float:
        return max(client.loop_busy_s for client in self.clients)

    @property
    def prefix_aware(self) -> bool:
        """Whether the cached prefix breaks near-ties in load (default: True)."""
        return self.router.prefix_aware

    @prefix_aware.setter
    def prefix_aware(self, value: bool) -> None:
        self.router.prefix_aware = value

    # -- start-up: engine cores of other nodes ---------------------------------------

    def _await_registrations(self, ranks: list[int], local: dict[int, EngineProcess]
                             ) -> dict[int, str]:
        """Listen where headless nodes register their engine cores, until every rank
        in `ranks` has; fail at once if a local core fails meanwhile.

        With CURVE keys (this frontend's key pair, the engine cores' public key) the
        socket is a CURVE server that admits only that engine key: the nodes register
        with the key pair their engine cores serve with, and this client attaches to
        those cores with its own. Without keys, only a loopback address is allowed (as
        for any engine socket: see enginecore/transport.py)."""
        if not ranks:
            return {}
        address = registration_address(self.args)
        self._context = Context()
        sock = self._registration = self._context.socket(zmq.ROUTER)
        # It stays bound for this client's life: what anyone can make it hold is bounded.
        sock.setsockopt(zmq.MAXMSGSIZE, max_registration_bytes(self.args.data_parallel_size))
        sock.setsockopt(zmq.RCVHWM, REGISTRATION_HWM)
        if self.curve is not None:
            self._auth = allow_only(self._context, self.curve)
            self.curve.configure(sock)  # key pair; the server key set here goes unused
            sock.curve_server = True
        sock.bind(address)
        found: dict[int, str] = {}
        deadline = time.monotonic() + LOCAL_STARTUP_TIMEOUT_S
        logger.info("waiting for data-parallel rank(s) %s to register at %s", ranks, address)
        while len(found) < len(ranks):
            if time.monotonic() > deadline:
                missing = sorted(set(ranks) - set(found))
                raise TimeoutError(f"data-parallel rank(s) {missing} did not register at "
                                   f"{address} within {LOCAL_STARTUP_TIMEOUT_S:.0f} s")
            for rank, process in local.items():
                failure = process.startup_failure()
                if failure is not None:
                    raise failure.reraise()
                cause = process.exit_cause()
                if cause is not None:
                    raise RuntimeError(f"{rank_label(rank)} failed to start: {cause}")
            if not sock.poll(100):
                continue
            frames = sock.recv_multipart()
            try:
                message = msgspec.msgpack.decode(frames[-1], type=DPRegister)
                error = self._registered(message, ranks, found)
            except msgspec.DecodeError as e:
                error = f"not a registration: {clip(str(e))}"
            sock.send_multipart([frames[0], msgspec.msgpack.encode(DPRegisterReply(error))])
            if error is not None:
                logger.warning("refused a data-parallel registration: %s", error)
            else:
                logger.info("data-parallel rank(s) %s registered", message.ranks)
        return found

    def _check_registration_address(self) -> None:
        address = registration_address(self.args)
        if self.curve is None and not is_loopback(address):
            raise ValueError(
                f"refusing to listen on {address} without authentication: data parallel "
                "across hosts needs ZeroMQ CURVE keys (curve_secret_key: this frontend's "
                "key pair; curve_server_public_key: the engine cores' public key)")

    def _registered(self, message: DPRegister, wanted: list[int], found: dict[int, str]
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

    # -- requests --------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        self.check_alive()
        hashes = self.router.hashes(request)
        rank = self.router.choose([c.load for c in self.clients], hashes)
        self.clients[rank].add_request(request)
        self._owner[request.request_id] = rank
        self.router.record(rank, hashes)
        self.requests_per_engine[rank] += 1

    def abort_requests(self, request_ids: list[str]) -> None:
        by_rank: dict[int, list[str]] = {}
        for request_id in request_ids:
            rank = self._owner.pop(request_id, None)
            if rank is not None:  # else finished already
                by_rank.setdefault(rank, []).append(request_id)
        for rank, ids in by_rank.items():
            self.clients[rank].abort_requests(ids)

    def _forget_finished(self, outputs: EngineCoreOutputs) -> None:
        for output in outputs.outputs:
            if output.finish_reason is not None:
                self._owner.pop(output.request_id, None)

    def owner_of(self, request_id: str) -> int | None:
        """The rank of the engine core that holds an unfinished request."""
        return self._owner.get(request_id)

    @staticmethod
    def _name_rank(rank: int, error: Exception) -> Exception:
        """A core's utility failure, naming the core (its death already does)."""
        if type(error) is RuntimeError:
            return RuntimeError(f"{rank_label(rank)}: {error}")
        return error

    # -- death and shutdown ----------------------------------------------------------

    def check_alive(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(self.dead_error)
        if self._closed:
            raise RuntimeError("this engine-core client has been shut down")

    def _on_core_dead(self, rank: int, cause: str) -> None:
        """One core died (`cause` names it): every waiter on every core hears it, and
        the others are stopped (off the noticing thread, which may be a watcher)."""
        with self._fail_lock:
            if self.dead_error is not None or self._closed:
                return
            self.dead_error = cause
        logger.error("%s; stopping the other data-parallel engine cores", cause)
        for client in list(self.clients):
            client.die(cause)
        self._stopper = threading.Thread(target=self._stop_all, name="dp-stop", daemon=True)
        self._stopper.start()

    def _stop_all(self) -> None:
        with self._stop_lock:
            for client in list(self.clients):
                client.shutdown()
            if self._auth is not None:
                self._auth.stop()
                self._auth = None
            if self._context is not None:  # headless nodes see it close and stop
                self._context.destroy(linger=0)
                self._context = self._registration = None

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        stopper = self._stopper
        if stopper is not None and stopper is not threading.current_thread():
            stopper.join()
        self._stop_all()


class DPSyncClient(DPClient, SyncEngineCoreClient):
    """For `LLM`: every core's reader thread puts its outputs on one queue."""

    clients: list[SyncMPClient]

    def __init__(self, args: EngineArgs, curve: CurveClientKeys | None = None) -> None:
        self._outputs: queue.Queue[EngineCoreOutputs | EngineDeadError] = queue.Queue()
        super().__init__(args, curve)

    def _make_client(self, engine_address: str | None, **options: Any) -> SyncMPClient:
        return SyncMPClient(None, engine_address, outputs=self._outputs, **options)

    def get_output(self) -> EngineCoreOutputs:
        while True:
            try:
                item = self._outputs.get(timeout=0.2)  # Ctrl-C must reach the caller
                break
            except queue.Empty:
                continue
        if isinstance(item, EngineDeadError):
            self._outputs.put(item)
            raise item
        self._forget_finished(item)
        return item

    def call_utility(self, method: UtilityMethod, *args: Any,
                     timeout: float | None = UTILITY_TIMEOUT_S) -> Any:
        self.check_alive()
        calls = [client.start_utility(method, *args) for client in self.clients]
        deadline = None if timeout is None else time.monotonic() + timeout
        results = []
        for rank, (client, call) in enumerate(zip(self.clients, calls, strict=True)):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                results.append(client.finish_utility(method, call, left))
            except Exception as e:
                raise self._name_rank(rank, e) from e
        return merge_results(method, results)


class DPAsyncClient(DPClient, AsyncEngineCoreClient):
    """For `AsyncLLM`: one task per core moves its outputs onto one asyncio queue."""

    clients: list[AsyncMPClient]

    def __init__(self, args: EngineArgs, curve: CurveClientKeys | None = None) -> None:
        self._outputs = LoopQueue(lambda loop, queue: [
            loop.create_task(self._pump(c, queue)) for c in self.clients])
        super().__init__(args, curve)

    def _make_client(self, engine_address: str | None, **options: Any) -> AsyncMPClient:
        return AsyncMPClient(None, engine_address, **options)

    async def _pump(self, client: AsyncMPClient, into: OutputQueue) -> None:
        try:
            while True:
                outputs = await client.get_output_async()
                self._forget_finished(outputs)
                into.put_nowait(outputs)
        except EngineDeadError as e:
            into.put_nowait(EngineDeadError(self.dead_error or str(e)))

    async def get_output_async(self) -> EngineCoreOutputs:
        return await self._outputs.get(self.dead_error)

    async def call_utility_async(self, method: UtilityMethod, *args: Any,
                                 timeout: float | None = UTILITY_TIMEOUT_S) -> Any:
        self.check_alive()
        self._outputs.ensure(self.dead_error)
        results = await asyncio.gather(
            *(client.call_utility_async(method, *args, timeout=timeout)
              for client in self.clients), return_exceptions=True)
        for rank, result in enumerate(results):
            if isinstance(result, BaseException):
                raise self._name_rank(rank, result) if isinstance(result, Exception) \
                    else result
        return merge_results(method, results)

    def shutdown(self) -> None:
        self._outputs.cancel()
        super().shutdown()
