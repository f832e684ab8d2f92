"""The engine-core clients: one interface, whatever side of a socket the core is on.

- `InprocClient` runs the `EngineCore` in this process (tests, debugging): each
  `get_output()` is one engine step.
- `SyncMPClient` / `AsyncMPClient` (frontend/mp_client.py) talk to an engine core in
  another process over ZeroMQ.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod

from protocol.engine_args import EngineArgs
from protocol.messages import EngineCoreOutputs, EngineCoreRequest, EngineInfo
from protocol.stats import EngineStats


class EngineDeadError(RuntimeError):
    """The engine core stopped; the message names why. Every pending and later call
    on its client raises this."""


class EngineCoreClient(ABC):
    info: EngineInfo
    dead_error: str | None = None

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def shutdown(self) -> None: ...


class SyncEngineCoreClient(EngineCoreClient):
    @abstractmethod
    def get_output(self) -> EngineCoreOutputs:
        """The next outputs for this client (blocks until there are some)."""

    @abstractmethod
    def get_stats(self) -> EngineStats: ...

    @abstractmethod
    def reset_prefix_cache(self) -> bool: ...


class InprocClient(SyncEngineCoreClient):
    def __init__(self, args: EngineArgs) -> None:
        from enginecore.core import EngineCore

        self.core = EngineCore(args)
        self.info = self.core.info

    def add_request(self, request: EngineCoreRequest) -> None:
        self.core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        outputs = self.core.step()
        return outputs.get(0) or EngineCoreOutputs(timestamp=time.monotonic())

    def get_stats(self) -> EngineStats:
        return self.core.get_stats()

    def reset_prefix_cache(self) -> bool:
        return self.core.reset_prefix_cache()

    def shutdown(self) -> None:
        self.core.shutdown()
