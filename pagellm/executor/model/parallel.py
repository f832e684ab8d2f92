"""Tensor parallelism: which slice of the model one rank holds, and its collectives.

Megatron's layout, as vLLM uses it. Each of N ranks holds
- 1/N of the attention heads: the q/k/v projection's output columns for its heads
  (column parallel) and the o_proj's matching input columns (row parallel, summed by one
  all-reduce);
- its KV heads: 1/N of them, or, when there are fewer KV heads than ranks, one KV head
  replicated on N / num_kv_heads ranks (those whose query heads read it);
- 1/N of the MLP's intermediate columns (gate/up column parallel, down row parallel,
  one all-reduce); in a mixture-of-experts layer, 1/N of every expert's columns (the
  router whole), the experts' partial sums reduced by the same one all-reduce;
- 1/N of the vocabulary, rounded up (embedding rows: masked lookup, one all-reduce;
  LM head rows: logits all-gathered, so every rank samples from the same full logits);
- every norm and the RoPE table whole.

`TensorParallel` is that layout plus the process group; with one rank it is the whole
model and every collective is the identity, so the single-device path runs the same
code without a process group.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class TensorParallel:
    rank: int
    size: int
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank (1 when replicated)
    kv_head_start: int  # the first of them among the model's KV heads
    intermediate_size: int  # MLP columns on this rank
    moe_intermediate_size: int  # each expert's columns on this rank (0: no experts)
    vocab_start: int  # first vocabulary row on this rank
    vocab_size: int  # rows per rank (ceil(V / N)); the last rank's tail is padding
    group: Any = None  # torch.distributed ProcessGroup (None: the default group)
    # Seconds spent in collectives since the model runner last read it. Measured only
    # where they are synchronous (gloo, on the CPU); NCCL's are asynchronous, so on CUDA
    # this stays 0 (use a profiler there).
    collective_s: float = 0.0

    @classmethod
    def layout(cls, spec: Any, rank: int = 0, size: int = 1, group: Any = None
               ) -> TensorParallel:
        """The slice of the model `spec` (a DecoderSpec) rank `rank` of `size` holds.
        Raises ValueError naming the counts when the model cannot be split `size` ways."""
        check_divisible(spec, size)
        heads, kv_heads = spec.num_heads, spec.num_kv_heads
        if kv_heads >= size:
            local_kv, kv_start = kv_heads // size, rank * (kv_heads // size)
        else:  # replicated: ranks r*k .. r*k+k-1 (k = size / kv_heads) share KV head r
            local_kv, kv_start = 1, rank // (size // kv_heads)
        per_rank_vocab = -(-spec.vocab_size // size)
        moe = getattr(spec, "moe", None)
        return cls(rank, size, heads // size, local_kv, kv_start,
                   spec.intermediate_size // size,
                   moe.intermediate_size // size if moe is not None else 0,
                   rank * per_rank_vocab, per_rank_vocab, group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks (in place); the identity on one rank."""
        if self.size > 1:
            import torch.distributed as dist

            t0 = time.perf_counter()
            dist.all_reduce(x, group=self.group)
            if x.device.type == "cpu":
                self.collective_s += time.perf_counter() - t0
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on each rank -> [..., size * n], ranks in order."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        t0 = time.perf_counter()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        if x.device.type == "cpu":
            self.collective_s += time.perf_counter() - t0
        return torch.cat(parts, dim=-1)


def check_divisible(spec: Any, size: int) -> None:
    """The one check that a model splits `size` ways; the error names every count."""
    problems = []
    if spec.num_heads % size:
        problems.append(f"num_attention_heads={spec.num_heads} is not divisible by it")
    kv = spec.num_kv_heads
    if (kv >= size and kv % size) or (kv < size and size % kv):
        problems.append(f"num_key_value_heads={kv} neither divides it nor is divisible by it")
    if spec.intermediate_size % size:
        problems.append(f"intermediate_size={spec.intermediate_size} is not divisible by it")
    moe = getattr(spec, "moe", None)
    if moe is not None and moe.intermediate_size % size:
        problems.append(f"moe_intermediate_size={moe.intermediate_size} is not divisible "
                        "by it")
    if moe is not None and moe.shared_expert_size % size:
        problems.append(f"shared_expert_intermediate_size={moe.shared_expert_size} is not "
                        "divisible by it")
    linear = getattr(spec, "linear_attention", None)  # Qwen3.5: by key heads (and the
    if linear is not None and linear.num_k_heads % size:  # value heads they serve)
        problems.append(f"linear_num_key_heads={linear.num_k_heads} is not divisible by it")
    mamba = getattr(spec, "mamba", None)  # Mamba-2: by heads, groups split or shared
    if mamba is not None and mamba.num_heads % size:
        problems.append(f"mamba_n_heads={mamba.num_heads} is not divisible by it")
    if mamba is not None and mamba.n_groups % size and size % mamba.n_groups:
        problems.append(f"mamba_n_groups={mamba.n_groups} neither divides it nor is "
                        "divisible by it")
    if getattr(spec, "short_conv", None) is not None and spec.hidden_size % size:
        problems.append(f"hidden_size={spec.hidden_size} is not divisible by it (LFM2's "
                        "convolutions split their channels)")
    if problems:
        raise ValueError(f"tensor_parallel_size={size} cannot split this model: "
                         + "; ".join(problems))
