"""`LLM.llm_engine`: vLLM's path to the model, for the RL trainers that load weights
through it.

TRL's colocate mode syncs weights with
`llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights([(name, t)])`,
one call per parameter. With the engine core in this process (`multiprocess=False`, or
`distributed_executor_backend="external_launcher"` as TRL passes) that path is the real
worker and model, as in vLLM: the copy goes straight into the parameters. With the
engine core in its own process, the path ends in `RemoteModel`, whose `load_weights`
queues the tensors (copies, so the trainer may change its own afterwards) and sends
them as one batched update over the "ipc" weight path (shared memory or CUDA IPC) when
the queue grows past PENDING_LIMIT_BYTES or before the LLM's next call of any kind
(generate, reset_prefix_cache, sleep, ...): one round trip per batch, not per tensor.
A failed batch raises from that next call, naming the update; nothing of it loaded
(every name and shape is checked before the first copy).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from pagellm.protocol.messages import EngineInfo

if TYPE_CHECKING:
    import torch

# How many bytes of queued tensors trigger a send (each batch is written to shared
# memory whole, so this bounds the extra host memory a sync holds at once).
PENDING_LIMIT_BYTES = 512 * 2**20


class PendingWeights:
    """Tensors queued by `RemoteModel.load_weights`, sent in batches by `send`."""

    def __init__(self, send: Callable[[list[tuple[str, torch.Tensor]]], int],
                 limit_bytes: int = PENDING_LIMIT_BYTES) -> None:
        self._send, self._limit = send, limit_bytes
        self._pairs: list[tuple[str, torch.Tensor]] = []
        self._bytes = 0

    def add(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        import torch

        names: set[str] = set()
        for item in weights:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                    and isinstance(item[1], torch.Tensor)):
                raise TypeError("load_weights takes (name, tensor) pairs, got "
                                f"{type(item).__name__}")
            name, tensor = item
            self._pairs.append((name, tensor.detach().clone()))
            self._bytes += tensor.numel() * tensor.element_size()
            names.add(name)
        if self._bytes >= self._limit:
            self.flush()
        return names

    def flush(self) -> None:
        """Send what is queued (nothing if empty); the queue is empty afterwards,
        whether the send succeeded or not."""
        if not self._pairs:
            return
        pairs, self._pairs, self._bytes = self._pairs, [], 0
        try:
            self._send(pairs)
        except Exception as e:
            raise RuntimeError(f"load_weights: the batched update of {len(pairs)} tensor(s) "
                               f"({pairs[0][0]}, ...) was refused; none of it loaded: {e}"
                               ) from e

    def __len__(self) -> int:
        return len(self._pairs)


class RemoteModel:
    """The end of `llm_engine...model_runner.model` for an engine core in another
    process: only vLLM's `load_weights`, the one model call trainers make."""

    def __init__(self, pending: PendingWeights) -> None:
        self._pending = pending

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Queue `(checkpoint name, tensor)` pairs for the engine (see the module
        docstring: sent batched, checked there); the names queued."""
        return self._pending.add(weights)


@dataclass(frozen=True)
class ModelConfig:
    """The fields of vLLM's `llm_engine.model_config` trainers read (TRL: the context
    length its tool loop must stay under)."""

    model: str
    max_model_len: int
    dtype_name: str

    @property
    def dtype(self) -> torch.dtype:
        import torch

        dtype: torch.dtype = getattr(torch, self.dtype_name)
        return dtype


class LLMEngine:
    """vLLM's `LLM.llm_engine`: `model_config`, and
    `model_executor.driver_worker.model_runner.model`."""

    def __init__(self, info: EngineInfo, model_executor: Any) -> None:
        self.model_config = ModelConfig(info.model, info.max_model_len, info.dtype)
        self.model_executor = model_executor

    @classmethod
    def remote(cls, info: EngineInfo, pending: PendingWeights) -> LLMEngine:
        """The path for an engine core in another process, ending in `RemoteModel`."""
        runner = SimpleNamespace(model=RemoteModel(pending))
        return cls(info, SimpleNamespace(driver_worker=SimpleNamespace(model_runner=runner)))
