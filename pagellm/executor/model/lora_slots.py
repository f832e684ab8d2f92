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

Where the model runs the Triton kernels (CUDA, or the CPU's interpreter for tests:
`LoRABatch.kernels`), the same update takes two launches per projection for all the
step's adapters (kernels/triton_lora.py), reading the runs from `device_runs` (a step
buffer the input preparer fills) and each slot's width from `device_widths`, never from
the host. Their shapes are fixed, so a decode step's CUDA graph records them: a graph
is captured with `launch` on, and each replay reads that step's runs (none: every
program returns at once).
"""

from __future__ import annotations

import torch


class LoRABatch:
    """The step's runs of rows by adapter slot, set by the model runner before each
    forward pass (empty: no adapter in the step)."""

    def __init__(self, kernels: bool) -> None:
        self.runs: list[tuple[int, int, int]] = []  # (slot, start row, end row)
        self.kernels = kernels  # the Triton kernels, on `device_runs` (module doc)
        # [max_loras, 3] int32: `runs`, staged on the device, unused rows (0, 0, 0).
        self.device_runs: torch.Tensor | None = None
        self.launch = False  # kernels: this forward pass runs them (runs, or a capture)


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
        self.device_widths = torch.zeros(slots, dtype=torch.int32, device=device)  # [slots]

    def put(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Write an adapter's update into `slot` (a [w, in], b [out, w]); None: the
        adapter leaves this projection alone (width 0)."""
        width = 0 if a is None or b is None else a.shape[0]
        if a is not None and b is not None:
            self.a[slot, :width].copy_(a, non_blocking=True)
            self.b[slot, :, :width].copy_(b, non_blocking=True)
        self.widths[slot] = width
        self.device_widths[slot] = width  # in place: graphs hold its address

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y [T, out] += this step's adapters' updates of x [T, in], run by run."""
        batch = self.batch
        if batch.kernels:
            if batch.launch:
                from pagellm.kernels.triton_lora import lora_add

                assert batch.device_runs is not None, "the runner stages the runs"
                lora_add(x, y, self.a, self.b, self.device_widths, batch.device_runs)
            return
        for slot, start, end in batch.runs:
            width = self.widths[slot]
            if width:
                shrunk = torch.mm(x[start:end], self.a[slot, :width].t())  # [n, w]
                y[start:end].addmm_(shrunk, self.b[slot, :, :width].t())
