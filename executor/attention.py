"""The attention layer and the per-step metadata it reads.

`Attention` writes the step's keys and values into its layer's paged cache and then
attends over each request's context through the block tables. The torch reference
kernels are the CPU path; the Triton kernels slot in here for CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kernels import reference


@dataclass
class AttentionMetadata:
    """Where each token of the flat batch goes and what it attends to."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset
    block_tables: torch.Tensor  # [num_reqs, max_blocks_per_req] int32
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32, context length including this step
    query_start_loc_cpu: list[int]  # host copies: the reference path slices with them
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int


class Attention(nn.Module):
    def __init__(self, layer_idx: int, scale: float) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, H_kv, D] -> [T, H, D]."""
        kv_cache = kv_caches[self.layer_idx]  # [2, num_blocks, block_size, H_kv, D]
        reference.write_kv_cache(k, v, kv_cache, meta.slot_mapping)
        return reference.paged_attention(q, kv_cache, meta.block_tables,
                                         meta.query_start_loc_cpu, meta.seq_lens_cpu,
                                         self.scale)
