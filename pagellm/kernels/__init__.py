"""Attention kernels: pure-torch references (the CPU path) and, for CUDA, Triton; and
the decoder's fused elementwise kernels: triton_fused on CUDA, cpu_fused (C++) on the
CPU.

Kernels know nothing about requests or schedulers: they take tensors and offsets.
"""

from __future__ import annotations

from types import ModuleType

import torch


def fused_for(x: torch.Tensor) -> ModuleType | None:
    """The fused elementwise kernels for x's device: kernels.triton_fused on CUDA,
    kernels.cpu_fused for an fp32 or bf16 CPU tensor where pagellm's C++ ops build; else
    None, and the torch code beside each call (the kernels' reference) runs. Imported on
    first use, so a CPU engine never loads Triton for them."""
    if x.device.type == "cuda":
        from pagellm.kernels import triton_fused

        return triton_fused
    if x.device.type == "cpu":
        from pagellm.kernels import cpu_fused, cpu_ops

        if x.dtype in cpu_fused.DTYPES and cpu_ops.available():
            return cpu_fused
    return None
