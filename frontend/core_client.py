"""The engine-core clients: one interface, whatever side of a socket the core is on.

`InprocClient` runs the `EngineCore` in this process (tests, debugging); each
`get_output()` is one engine step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from protocol.engine_args import EngineArgs
from protocol.messages import EngineCoreOutputs, EngineCoreRequest, EngineInfo
from protocol.stats import EngineStats


class EngineCoreClient(ABC):
    info: EngineInfo

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def get_output(self) -> EngineCoreOutputs:
        """The next batch of outputs (blocks until the engine has produced one)."""

    @abstractmethod
    def get_stats(self) -> EngineStats: ...

    @abstractmethod
    def shutdown(self) -> None: ...


class InprocClient(EngineCoreClient):
    def __init__(self, args: EngineArgs) -> None:
        from enginecore.core import EngineCore

        self.core = EngineCore(args)
        self.info = self.core.info

    def add_request(self, request: EngineCoreRequest) -> None:
        self.core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        return self.core.step()

    def get_stats(self) -> EngineStats:
        return self.core.get_stats()

    def shutdown(self) -> None:
        self.core.shutdown()
