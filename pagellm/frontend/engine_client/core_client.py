"""The engine-core client interfaces: one, whatever side of a socket the core is on.

- `SyncEngineCoreClient` (what `LLM` needs): `InprocClient` (inproc_client.py) runs the
  `EngineCore` in this process; `SyncMPClient` (sync_mp_client.py) talks to one in
  another process over ZeroMQ, `DPSyncClient` (dp_client.py) to several.
- `AsyncEngineCoreClient` (what `AsyncLLM` needs): `AsyncMPClient`, `DPAsyncClient`.

`make_client` (factory.py) is the one place that chooses between them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from pagellm.protocol.messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineInfo,
    UtilityMethod,
)
from pagellm.protocol.stats import EngineStats
from pagellm.protocol.utility import SIGNATURES

# How long a utility call may take by default (None: a pause or sleep in mode "wait",
# which lasts as long as the requests it waits for).
UTILITY_TIMEOUT_S = 60.0


def utility_timeout(method: UtilityMethod) -> float | None:
    """How long `LLM` and `AsyncLLM` wait for `method`: no limit where its row says the
    call lasts as long as what it waits for (`Signature.no_timeout`), else
    UTILITY_TIMEOUT_S."""
    return None if SIGNATURES[method].no_timeout else UTILITY_TIMEOUT_S


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
