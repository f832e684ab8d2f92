"""CUDA graphs of the decode step's forward pass.

A decode step of a small model is mostly launch overhead: hundreds of small kernels,
each costing the host microseconds to enqueue. A CUDA graph records them once and
replays them with one launch. A graph replays fixed shapes and fixed addresses, so:

- graphs are captured for a ladder of batch sizes (`capture_sizes`), and a step of R
  requests runs the smallest captured size >= R, with the R real requests first and
  padding after (no KV write: slot -1; no keys: seq_len 0);
- their inputs are the persistent `StepBuffers` views, which each step refills;
- the split-KV slice count of the attention kernel is fixed per size at capture;
- a graph ends at the hidden states: the logits of the rows that sample are computed
  after it, eagerly. Every graph's output stays allocated in the shared pool, so
  logits there would cost the sum of all sizes x vocabulary (1.3 GB for Qwen2.5 in
  bf16 at max_num_seqs 256, outside the KV budget); hidden states cost 13 MB.

Only steps in which every request computes exactly one token use a graph (decodes, and
the rare prompt whose last token is all that is left); everything else runs eagerly.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable

import torch

# The forward pass at one padded batch size -> hidden [size, H].
Forward = Callable[[int], torch.Tensor]


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 up to max_num_seqs, and max_num_seqs itself:
    padding wastes at most 7 rows, and small batches (latency-bound) pad least."""
    sizes = {s for s in (1, 2, 4) if s <= max_num_seqs}
    sizes.update(range(8, max_num_seqs + 1, 8))
    sizes.add(max_num_seqs)
    return sorted(sizes)


class DecodeGraphs:
    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sorted(sizes)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def padded_size(self, num_reqs: int) -> int | None:
        """The captured size a step of num_reqs requests runs at (None: too big)."""
        i = bisect.bisect_left(self.sizes, num_reqs)
        return self.sizes[i] if i < len(self.sizes) and self._graphs else None

    def capture(self, forward: Forward) -> float:
        """Capture every size, largest first so the smaller graphs reuse its memory
        pool; returns the seconds taken. Each size runs once eagerly first, so Triton
        compiles and cuBLAS sets up outside the capture."""
        start = time.perf_counter()
        pool = None
        for size in reversed(self.sizes):
            forward(size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = forward(size)
            pool = graph.pool()
            self._graphs[size] = (graph, hidden)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    def replay(self, size: int) -> torch.Tensor:
        """Run the graph of `size` on what the step buffers hold now; the returned
        hidden states [size, H] are the graph's own, overwritten by its next replay."""
        graph, hidden = self._graphs[size]
        graph.replay()
        return hidden

    def clear(self) -> None:
        self._graphs.clear()
