"""`EagerReplay`: the CUDA-graph path on the CPU, for tests.

A captured graph replays the decode forward pass on the persistent step buffers at a
padded batch size; this stand-in runs that very forward pass eagerly instead, so every
input a graph reads and everything the step does around it is exercised without a GPU
(tests/executor/test_gpu_path.py, tests/e2e/test_lora.py)."""

from __future__ import annotations

from typing import Any

from pagellm.executor.worker.cuda_graphs import DecodeGraphs, Forward


class EagerReplay(DecodeGraphs):
    """Stands in for the captured graphs on the CPU: `replay` runs the very forward
    pass a graph records, on the persistent buffers, at the padded size."""

    def __init__(self, sizes: list[int], forward: Forward) -> None:
        super().__init__(sizes)
        self.forward = forward
        self.replayed: list[int] = []
        self._graphs = {size: None for size in sizes}  # type: ignore[misc]

    def replay(self, size: int) -> Any:
        self.replayed.append(size)
        return self.forward(size)
