"""The adapters on the device: `max_loras` slots per projection, and the step's segments.

Every projection that takes adapters (qkv_proj, o_proj, gate_up_proj, down_proj) holds
one `LoRASlots`: slot s keeps one adapter's update of that projection,

    a [max_loras, parts * max_rank, in_features]
    b [max_loras, out_features, parts * max_rank]

of which an adapter of rank r uses the first `parts * r` rows of a and columns of b
(`widths[s]`: no work for the rank it lacks). The model runner orders a step's requests
by adapter, so each adapter's tokens are one contiguous run of rows; `LoRABatch`
carries the step's runs, (slot, first row, end row), shared by every projection. The
layer then adds, to its base output y [T, out] (before a row-parallel layer's
all-reduce, which sums the ranks' partial updates as it sums their partial products),

    y[start:end] += (x[start:end] a[s, :w]^T) b[s, :, :w]^T      for each run

two thin GEMMs per adapter in the step (shrink to the rank, expand back), in place; a
step of the base model alone has no runs and costs nothing.
"""

from __future__ import annotations

import torch


class LoRABatch:
    """The step's runs of rows by adapter slot, set by the model runner before each
    forward pass (empty: no adapter in the step)."""

    def __init__(self) -> None:
        self.runs: list[tuple[int, int, int]] = []  # (slot, start row, end row)


class LoRASlots:
    """One projection's adapter slots (module doc)."""

    def __init__(self, batch: LoRABatch, slots: int, parts: int, max_rank: int,
                 in_features: int, out_features: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.batch = batch
        self.parts = parts
        self.a = torch.zeros(slots, parts * max_rank, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(slots, out_features, parts * max_rank, dtype=dtype, device=device)
        self.widths = [0] * slots  # rows of a (columns of b) slot s uses

    def put(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Write an adapter's update into `slot` (a [w, in], b [out, w]); None: the
        adapter leaves this projection alone (width 0)."""
        if a is None or b is None:
            self.widths[slot] = 0
            return
        width = a.shape[0]
        self.a[slot, :width].copy_(a, non_blocking=True)
        self.b[slot, :, :width].copy_(b, non_blocking=True)
        self.widths[slot] = width

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y [T, out] += this step's adapters' updates of x [T, in], run by run."""
        for slot, start, end in self.batch.runs:
            width = self.widths[slot]
            if width:
                shrunk = torch.mm(x[start:end], self.a[slot, :width].t())  # [n, w]
                y[start:end].addmm_(shrunk, self.b[slot, :, :width].t())
