"""The engine-core clients: one interface, whatever side of a socket the core is on.

- `InprocClient` runs the `EngineCore` in this process (tests, debugging): each
  `get_output()` is one engine step.
- `SyncMPClient` / `AsyncMPClient` (frontend/sync_mp_client.py, async_mp_client.py) talk to
  an engine core in another process over ZeroMQ.

`make_client` is the one place that chooses between them, for `LLM`, `AsyncLLM` and
the server alike (vLLM's `EngineCoreClient.make_client`).
"""

from __future__ import annotations

import dataclasses
import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Literal, overload

import msgspec

from pagellm.protocol.engine_args import EngineArgs
from pagellm.protocol.messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineInfo,
    UtilityMethod,
)
from pagellm.protocol.stats import EngineStats

if TYPE_CHECKING:
    from pagellm.frontend.curve import CurveClientKeys


# How long a utility call may take by default (None: a pause or sleep in mode "wait",
# which lasts as long as the requests it waits for).
UTILITY_TIMEOUT_S = 60.0


class EngineDeadError(RuntimeError):
    """The engine core stopped; the message names why. Every pending and later call
    on its client raises this."""


class EngineCoreClient(ABC):
    info: EngineInfo
    dead_error: str | None = None
    # How long the engine core's loop has been inside one step or control call, as its
    # last message said (0 in this process: the caller's own thread runs the loop).
    loop_busy_s: float = 0.0

    def engine_busy_s(self) -> float:
        """The longest any of this client's engine cores has been inside one step or
        control call (`EngineCoreOutputs.loop_busy_s`): what /health judges a loop
        blocked by."""
        return self.loop_busy_s

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def shutdown(self) -> None: ...


# Engine options that shape the frontend itself, so they apply when attaching too, and
# the vLLM options that change nothing anywhere (vLLM scripts pass them to every engine).
FRONTEND_OPTIONS = frozenset({"model", "tokenizer", "skip_tokenizer_init",
                              "trust_remote_code", "disable_log_stats", "swap_space",
                              "max_seq_len_to_capture"})


@overload
def make_client(args: EngineArgs, *, asyncio_mode: Literal[False], multiprocess: bool = ...,
                engine_address: str | None = ..., curve: CurveClientKeys | None = ...
                ) -> SyncEngineCoreClient: ...


@overload
def make_client(args: EngineArgs, *, asyncio_mode: Literal[True], multiprocess: bool = ...,
                engine_address: str | None = ..., curve: CurveClientKeys | None = ...
                ) -> AsyncEngineCoreClient: ...


def make_client(args: EngineArgs, *, asyncio_mode: bool, multiprocess: bool = True,
                engine_address: str | None = None, curve: CurveClientKeys | None = None
                ) -> SyncEngineCoreClient | AsyncEngineCoreClient:
    """The engine core's client: in this process (`multiprocess=False`, for `LLM`
    only), in a child process launched here, or already running at `engine_address`
    (CURVE keys if it requires them); with data_parallel_size > 1, one client for
    several engine cores (frontend/dp_client.py). Engine options given with
    `engine_address` are an error: that engine is configured where it runs, and
    ignoring them would mislead."""
    from pagellm.frontend.async_mp_client import AsyncMPClient
    from pagellm.frontend.dp_client import DPAsyncClient, DPSyncClient
    from pagellm.frontend.sync_mp_client import SyncMPClient

    if engine_address is not None:
        configured = [f.name for f in dataclasses.fields(args)
                      if f.name not in FRONTEND_OPTIONS and getattr(args, f.name) != f.default]
        if configured:
            raise ValueError(f"engine option(s) {', '.join(configured)} have no effect on "
                             f"the engine core at {engine_address}: set them where it starts")
        return AsyncMPClient(None, engine_address, curve) if asyncio_mode \
            else SyncMPClient(None, engine_address, curve)
    remote_ranks = args.data_parallel_size > (args.data_parallel_size
                                              if args.data_parallel_size_local is None
                                              else args.data_parallel_size_local)
    if curve is not None and not remote_ranks:
        raise ValueError("CURVE keys are for attaching to an engine core (engine_address) "
                         "or to data-parallel engine cores of other nodes")
    if args.data_parallel_size > 1:
        if not multiprocess:
            raise ValueError("data_parallel_size > 1 runs each engine core in a process of "
                             "its own (multiprocess=False runs one in this process)")
        return DPAsyncClient(args, curve) if asyncio_mode else DPSyncClient(args, curve)
    if asyncio_mode:
        if not multiprocess:
            raise ValueError("AsyncLLM runs its engine core in a process of its own "
                             "(multiprocess=False is for LLM)")
        return AsyncMPClient(args)
    return SyncMPClient(args) if multiprocess else InprocClient(args)


class AsyncEngineCoreClient(EngineCoreClient):
    """What `AsyncLLM` needs of a client: `AsyncMPClient` (one engine core) and
    `DPAsyncClient` (several, data parallel)."""

    @abstractmethod
    def check_alive(self) -> None:
        """Raise EngineDeadError if the engine died, RuntimeError after shutdown."""

    @abstractmethod
    async def get_output_async(self) -> EngineCoreOutputs:
        """The next outputs with request outputs in them."""

    @abstractmethod
    async def call_utility_async(self, method: UtilityMethod, *args: Any,
                                 timeout: float | None = UTILITY_TIMEOUT_S) -> Any:
        """As `SyncEngineCoreClient.call_utility`, awaitable."""

    async def get_stats_async(self) -> EngineStats:
        return await self.call_utility_async(UtilityMethod.GET_STATS)

    async def reset_prefix_cache_async(self) -> bool:
        return await self.call_utility_async(UtilityMethod.RESET_PREFIX_CACHE)


class SyncEngineCoreClient(EngineCoreClient):
    @abstractmethod
    def get_output(self) -> EngineCoreOutputs:
        """The next outputs for this client (blocks until there are some)."""

    @abstractmethod
    def call_utility(self, method: UtilityMethod, *args: Any,
                     timeout: float | None = UTILITY_TIMEOUT_S) -> Any:
        """Call the engine core's `method` (see pagellm.protocol.utility.SIGNATURES);
        its failure raises RuntimeError naming it, `timeout` (None: no limit) a
        TimeoutError."""

    def get_stats(self) -> EngineStats:
        return self.call_utility(UtilityMethod.GET_STATS)

    def reset_prefix_cache(self) -> bool:
        return self.call_utility(UtilityMethod.RESET_PREFIX_CACHE)


class InprocClient(SyncEngineCoreClient):
    def __init__(self, args: EngineArgs) -> None:
        from pagellm.enginecore.core import EngineCore

        self.core = EngineCore(args)
        self.info = self.core.info
        self._stepped: list[EngineCoreOutputs] = []

    def add_request(self, request: EngineCoreRequest) -> None:
        self.core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        if self._stepped:  # outputs of steps run while a call waited for a pause
            return self._stepped.pop(0)
        outputs = self.core.step()
        return outputs.get(0) or EngineCoreOutputs(timestamp=time.monotonic())

    def call_utility(self, method: UtilityMethod, *args: Any,
                     timeout: float | None = UTILITY_TIMEOUT_S) -> Any:
        """As over a socket, except `timeout`: the call runs in the caller's thread, so
        nothing can stop it early. Its arguments go through the wire's encoding, so
        what an engine in another process would refuse is refused here too."""
        from pagellm.enginecore.core import Deferred

        wire_args = msgspec.msgpack.decode(msgspec.msgpack.encode(list(args)))
        try:
            result = self.core.call_utility(method, wire_args)
            if isinstance(result, Deferred):
                while not result.ready():
                    if not self.core.has_work():  # a join waits for its trainer
                        time.sleep(0.01)
                    outputs = self.core.step().get(0)
                    if outputs is not None:
                        self._stepped.append(outputs)
                result = result.finish()
        except Exception as e:  # the same error as from an engine in another process
            raise RuntimeError(f"engine core utility call {method.name.lower()} failed: "
                               f"{type(e).__name__}: {e}") from e
        return result

    def shutdown(self) -> None:
        self.core.shutdown()
