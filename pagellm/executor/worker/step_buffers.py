"""`StepBuffers`: the step's input tensors, allocated once at their largest size.

Each step's small host arrays (token ids, positions, slot mapping, block tables,
sampling parameters) are written into page-locked host buffers and copied to device
buffers without blocking, so the host goes straight on to launching the forward pass
while the copies run; the only wait in a step is for its sampled ids. Because the
device buffers never move, a CUDA graph captured on views of them reads each step's
new inputs when replayed (executor/worker/cuda_graphs.py).

On the CPU the host buffer is the device buffer: writing it is the whole copy.

A pinned buffer must not be rewritten while the previous step's copy out of it may
still be in flight. A step that samples waits for its sampled ids, which come after
its copies; a step that samples nothing (a prompt chunk) never waits, so it records an
event (`end_step`) and the next step waits for that first (`begin_step`), which costs
nothing when the copies are long done.
"""

from __future__ import annotations

import numpy as np
import torch


class StepBuffers:
    def __init__(self, device: torch.device, shapes: dict[str, tuple[tuple[int, ...],
                                                                    torch.dtype]]) -> None:
        """shapes: name -> (largest shape, dtype); each step uses a leading slice."""
        self.device = device
        self.on_cuda = device.type == "cuda"
        self.host: dict[str, torch.Tensor] = {}
        # numpy views of the host buffers, made once: slicing a view costs a tenth of
        # slicing the tensor and converting it, eight times a step.
        self._host_arrays: dict[str, np.ndarray] = {}
        self.device_buffers: dict[str, torch.Tensor] = {}
        for name, (shape, dtype) in shapes.items():
            host = torch.zeros(shape, dtype=dtype, pin_memory=self.on_cuda)
            self.host[name] = host
            self._host_arrays[name] = host.numpy()
            self.device_buffers[name] = (torch.zeros(shape, dtype=dtype, device=device)
                                         if self.on_cuda else host)
        self._copied: torch.cuda.Event | None = None

    def begin_step(self) -> None:
        """Wait until the last step's copies have left the pinned buffers."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None

    def put(self, name: str, array: np.ndarray | list[int], fill: int | float | None = None,
            size: int | None = None) -> torch.Tensor:
        """Stage `array` into buffer `name`'s leading rows and return the device view.

        With `size` (>= len(array)) the view has `size` rows and the rows past the
        array get `fill`: the padding of a CUDA-graph batch. Rows of a 2-D buffer keep
        its full width; only the array's columns are written.
        """
        data = np.asarray(array)
        rows = len(data)
        size = rows if size is None else size
        host = self._host_arrays[name]
        if rows == 0:
            pass  # nothing to write (an empty array has no columns to match a 2-D buffer)
        elif data.ndim == 2:
            host[:rows, :data.shape[1]] = data
        else:
            host[:rows] = data
        if size > rows:
            assert fill is not None, f"{name}: padding needs a fill value"
            host[rows:size] = fill
        device = self.device_buffers[name][:size]
        if self.on_cuda:
            device.copy_(self.host[name][:size], non_blocking=True)
        return device

    def end_step(self) -> None:
        """Mark the point after which this step's pinned buffers may be rewritten; a
        step that waits on the device after its copies anyway need not call it."""
        if self.on_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()
