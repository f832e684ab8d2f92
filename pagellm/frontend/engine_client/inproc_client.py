"""`InprocClient`: the `EngineCore` in this process (`LLM(..., multiprocess=False)`,
tests, debugging). Each `get_output()` is one engine step, run in the caller's thread."""

from __future__ import annotations

import time
from typing import Any

import msgspec

from pagellm.frontend.engine_client.core_client import UTILITY_TIMEOUT_S, SyncEngineCoreClient
from pagellm.protocol.engine_args import EngineArgs
from pagellm.protocol.messages import EngineCoreOutputs, EngineCoreRequest, UtilityMethod


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
        self.core.wait_for_grammars(0.05)  # only while nothing but a compile is left
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
