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
  results are merged (dp_routing.py's `merge_results`, as the method's row in
  protocol/utility.py says).
- The death of any core is every waiter's `EngineDeadError`, naming the core's rank,
  and stops all the others (nothing is left running).
- Cores of other nodes (data_parallel_size_local < data_parallel_size) are started by
  `pagellm serve --headless` there (dp_node.py): they bind tcp on their host and
  register their addresses at --data-parallel-address:--data-parallel-rpc-port, where
  this client listens (dp_registration.py); it then attaches to each as to a standalone
  engine core.
  A headless node stops its cores when this client closes that socket.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
import time
from abc import abstractmethod
from collections.abc import Sequence
from typing import Any

from pagellm.frontend.engine_client.async_mp_client import AsyncMPClient, LoopQueue, OutputQueue
from pagellm.frontend.engine_client.core_client import (
    UTILITY_TIMEOUT_S,
    AsyncEngineCoreClient,
    EngineCoreClient,
    EngineDeadError,
    SyncEngineCoreClient,
)
from pagellm.frontend.engine_client.dp_registration import (
    RegistrationListener,
    local_ranks,
    rank_label,
)
from pagellm.frontend.engine_client.dp_routing import Router, merge_infos, merge_results
from pagellm.frontend.engine_client.engine_process import EngineProcess
from pagellm.frontend.engine_client.mp_client import MPClient
from pagellm.frontend.engine_client.sync_mp_client import SyncMPClient
from pagellm.protocol.engine_args import EngineArgs
from pagellm.protocol.messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    UtilityMethod,
)
from pagellm.transport.curve import CurveClientKeys

logger = logging.getLogger("pagellm")


class DPClient(EngineCoreClient):
    """What the sync and async data-parallel clients share: start-up, routing, aborts,
    death and shutdown."""

    clients: Sequence[MPClient]

    def __init__(self, args: EngineArgs, curve: CurveClientKeys | None = None) -> None:
        self.args = args
        self.curve = curve  # for cores of other nodes: see RegistrationListener
        self.dead_error: str | None = None
        self._closed = False
        self._fail_lock = threading.Lock()
        self._stop_lock = threading.Lock()
        self._stopper: threading.Thread | None = None
        self._listener: RegistrationListener | None = None
        self._owner: dict[str, int] = {}  # request id -> the rank that holds it
        size = args.data_parallel_size
        self.requests_per_engine = [0] * size  # routed here, cumulative
        ranks = local_ranks(args)
        clients: list[MPClient] = []
        self.clients = clients
        processes: dict[int, EngineProcess] = {}
        try:
            if len(ranks) < size:  # cores of other nodes register here
                self._listener = RegistrationListener(args, curve)
            for rank in ranks:  # all load at once
                processes[rank] = EngineProcess(args.replace(data_parallel_rank=rank),
                                                num_local=len(ranks))
            remote = {} if self._listener is None else self._listener.wait(
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
            if self._listener is not None:  # headless nodes see it close and stop
                self._listener.close()
                self._listener = None

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
