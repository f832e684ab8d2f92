"""Attention kernels: pure-torch references (the CPU path) and, for CUDA, Triton; and
the decoder's fused elementwise kernels for CUDA (triton_fused).

Kernels know nothing about requests or schedulers: they take tensors and offsets.
"""

from __future__ import annotations

from types import ModuleType

import torch


def fused_for(x: torch.Tensor) -> ModuleType | None:
    """kernels.triton_fused where x lives on CUDA, else None: the torch code beside each
    call is the CPU path and the kernels' reference. Imported on first use, so a CPU
    engine never loads Triton for them."""
    if x.device.type != "cuda":
        return None
    from pagellm.kernels import triton_fused

    return triton_fused
