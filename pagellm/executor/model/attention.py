"""The attention layer, the per-step metadata it reads, and the kernel backends.

`Attention` writes the step's keys and values into its layer's paged cache and then
attends over each request's context through the block tables, with the backend the
model runner chose: "torch" (kernels/reference.py, the CPU path) or "triton"
(kernels/triton_attention.py; on the CPU through Triton's interpreter, for tests).
The backend travels in the metadata, so the model code never branches on it.

Each layer carries its own `sliding_window` (Mistral; Gemma 2/3 alternate local and
global layers) and `softcap` (Gemma 2's attention logit soft-capping) and hands them to
the backend with every call: one step's metadata serves layers of either kind; a
family with attention sinks (gpt-oss: a learned logit per head in each softmax's
denominator, kernels/reference.py) hands its layer's `sinks` [heads] in with the call.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from pagellm.kernels import cpu_ops, reference
from pagellm.protocol.engine_args import ATTENTION_BACKENDS

logger = logging.getLogger("pagellm")


class AttentionBackend(Protocol):
    name: str

    def prepare(self, meta: AttentionMetadata) -> None:
        """Once per step, before the first layer: index work every layer shares."""

    def release(self) -> None:
        """Free what is kept from step to step (sleep frees the KV cache)."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                 sliding_window: int | None = None, softcap: float | None = None,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Write k, v into kv_cache and attend: q [T, H, D]; k, v [T, H_kv, D] ->
        [T, H, D]. A query at position p sees keys p - sliding_window < j <= p (None:
        j <= p); softcap c turns scores s into c * tanh(s / c) before the mask; sinks
        [H]: one more logit per head in every softmax's denominator (None: none)."""
        ...


@dataclass
class AttentionMetadata:
    """Where each token of the flat batch goes and what it attends to."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset
    block_tables: torch.Tensor  # [num_reqs, max_blocks_per_req] int32
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32, context length including this step
    query_start_loc_cpu: np.ndarray  # [num_reqs + 1] int64, host copies: the CPU plan
    seq_lens_cpu: np.ndarray  # [num_reqs] int64      reads them (no list round trip)
    max_query_len: int
    backend: AttentionBackend
    num_segments: int = 1  # split-KV slices for decode-only batches (Triton)
    plan: reference.AttentionPlan | None = None  # the torch backend's per-step indices
    # [num_reqs] int64, host: each request's row of the runner's batch, where layers that
    # keep a state per request find theirs (lfm2.py); None in steps no such model runs.
    request_rows: np.ndarray | None = None


@dataclass
class PagedDecodes:
    """A step's one-token queries as the CPU's C++ decode attention takes them."""

    rows: torch.Tensor | None  # [B] int64 their query rows; None: all (decode-only step)
    block_tables: torch.Tensor  # [B(+), max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32

    @classmethod
    def of(cls, meta: AttentionMetadata) -> PagedDecodes:
        if meta.max_query_len == 1:
            return cls(None, meta.block_tables, meta.seq_lens)
        starts = meta.query_start_loc_cpu
        index = np.flatnonzero(np.diff(starts) == 1)  # [B] the decoding requests
        requests = torch.from_numpy(index)
        return cls(torch.from_numpy(starts[index]), meta.block_tables.index_select(0, requests),
                   meta.seq_lens.index_select(0, requests))


class TorchAttention:
    """The CPU path (kernels/reference.py). `prepare` plans full causal attention, which
    every model has; a sliding window's plan differs (it gathers only the blocks in the
    window), so the first layer with a given window plans it and the step's later ones
    reuse it (`window_plans`, emptied by the next `prepare`).

    With `decode_attention` (torch.ops.pagellm_cpu.paged_decode_attention,
    kernels/csrc/cpu_attention.cpp: the CPU with an fp32 or bf16 cache) one-token
    queries read their keys and values in place instead: the plans then cover the longer
    queries only. At 48 requests on a 2-core CPU the gathers, masks and SDPA it replaces
    were a third of SmolLM2-135M's fp32 offline time. With `prefill_attention`
    (torch.ops.pagellm_cpu.prefill_attention, the same file) fp32 and bf16 prompts
    attend causally in C++ instead of through SDPA (2-3x faster at 32-1024 tokens),
    unless a sliding window or softcap applies."""

    name = "torch"

    def __init__(self, block_size: int,
                 decode_attention: Callable[..., torch.Tensor] | None = None,
                 prefill_attention: reference.PrefillAttention | None = None) -> None:
        self.block_size = block_size
        self.decode_attention = decode_attention
        self.prefill_attention = prefill_attention
        self.scratch = reference.GatherScratch()
        self.window_plans: dict[int, reference.AttentionPlan] = {}  # this step's, by window
        self._step_plan: reference.AttentionPlan | None = None  # the plan they go with
        self._decodes: PagedDecodes | None = None  # this step's, with decode_attention

    def prepare(self, meta: AttentionMetadata) -> None:
        paged = self.decode_attention is not None
        meta.plan = reference.plan_attention(meta.block_tables, meta.query_start_loc_cpu,
                                             meta.seq_lens_cpu, self.block_size,
                                             self.scratch, plan_decodes=not paged)
        self.window_plans.clear()
        self._step_plan = meta.plan
        self._decodes = PagedDecodes.of(meta) if paged else None

    def release(self) -> None:
        self.scratch = reference.GatherScratch()
        self.window_plans.clear()
        self._step_plan = None
        self._decodes = None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                 sliding_window: int | None = None, softcap: float | None = None,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
        assert meta.plan is not None, "prepare(meta) runs before the first layer"
        reference.write_kv_cache(k, v, kv_cache, meta.slot_mapping)
        decodes = self._decodes
        if decodes is not None and decodes.rows is None:  # a decode-only step
            return self._attend_decodes(q, kv_cache, decodes, scale, sliding_window, softcap,
                                        sinks)
        plan = meta.plan if sliding_window is None else self._window_plan(meta, sliding_window)
        out = reference.planned_attention(q, kv_cache, plan, scale, k, v, softcap,
                                          self.prefill_attention, sinks)
        if decodes is not None and decodes.rows is not None and len(decodes.rows):
            out.index_copy_(0, decodes.rows, self._attend_decodes(
                q.index_select(0, decodes.rows), kv_cache, decodes, scale, sliding_window,
                softcap, sinks))
        return out

    def _attend_decodes(self, q: torch.Tensor, kv_cache: torch.Tensor, decodes: PagedDecodes,
                        scale: float, window: int | None, softcap: float | None,
                        sinks: torch.Tensor | None) -> torch.Tensor:
        """q [B, H, D], the decodes' queries -> [B, H, D]."""
        assert self.decode_attention is not None
        return self.decode_attention(q, kv_cache, decodes.block_tables, decodes.seq_lens,
                                     scale, window, softcap,
                                     None if sinks is None else sinks.float())

    def _window_plan(self, meta: AttentionMetadata, window: int) -> reference.AttentionPlan:
        """The step's plan under `window`, built once per step. A window that holds every
        context whole is full causal attention: the step's plan serves it."""
        full = meta.plan
        assert full is not None and full is self._step_plan, \
            "prepare(meta) runs before each step's layers"
        plan = self.window_plans.get(window)
        if plan is None:
            if window >= int(meta.seq_lens_cpu.max()):
                plan = full
            else:
                plan = reference.plan_attention(
                    meta.block_tables, meta.query_start_loc_cpu, meta.seq_lens_cpu,
                    self.block_size, self.scratch, sliding_window=window,
                    plan_decodes=self.decode_attention is None)
            self.window_plans[window] = plan
        return plan


class TritonAttention:
    name = "triton"

    def __init__(self) -> None:
        from pagellm.kernels import triton_attention

        self.kernels = triton_attention

    def prepare(self, meta: AttentionMetadata) -> None:
        pass  # the kernels read the metadata's tensors as they are

    def release(self) -> None:
        pass  # nothing kept

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                 sliding_window: int | None = None, softcap: float | None = None,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
        self.kernels.write_kv_cache(k, v, kv_cache, meta.slot_mapping)
        segments = meta.num_segments
        if sliding_window is not None:  # a window is every context's length here: its
            # slices at least 256 keys long, as `num_kv_segments` makes them
            while segments > 1 and sliding_window // segments < 256:
                segments //= 2
        return self.kernels.paged_attention(q, kv_cache, meta.block_tables,
                                            meta.query_start_loc, meta.seq_lens, scale,
                                            meta.max_query_len, segments,
                                            sliding_window=sliding_window, softcap=softcap,
                                            sinks=sinks)


def get_attention_backend(name: str, device: torch.device, block_size: int,
                          cache_dtype: torch.dtype = torch.float32,
                          head_dim: int | None = None) -> AttentionBackend:
    """"auto" is Triton on CUDA (torch where its kernels have no `head_dim`: DeepSeek's
    latent attention, 576, with a warning) and torch on the CPU; "triton" on the CPU runs
    the kernels through Triton's interpreter (slow: for tests). The torch path on the CPU
    attends one-token queries with pagellm's C++ op where the cache is fp32 or bf16, and
    fp32 and bf16 prompts with another, where the ops build (else, with a warning, on
    torch's ops alone)."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got "
                         f"{name!r}")
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
        if name == "triton" and head_dim is not None:
            from pagellm.kernels.triton_attention import SUPPORTED_HEAD_SIZES

            if head_dim not in SUPPORTED_HEAD_SIZES:
                logger.warning("head_dim=%d: the Triton attention kernels have no such "
                               "head size (%s); attending with torch's ops", head_dim,
                               SUPPORTED_HEAD_SIZES)
                name = "torch"
    if name == "torch":
        ops = _cpu_ops(device)
        return TorchAttention(
            block_size,
            ops.paged_decode_attention if ops is not None and cache_dtype in (
                torch.float32, torch.bfloat16) else None,
            ops.prefill_attention if ops is not None else None)
    if device.type == "cpu":
        # Must be set before the kernels' @triton.jit decorators run (module import).
        os.environ.setdefault("TRITON_INTERPRET", "1")
        from pagellm.kernels.triton_attention import interpreter_fault, interpreting

        if not interpreting():
            raise RuntimeError("attention_backend='triton' on the CPU needs "
                               "TRITON_INTERPRET=1 before the Triton kernels are imported")
        fault = interpreter_fault()
        if fault is not None:
            raise RuntimeError(f"attention_backend='triton' on the CPU runs Triton's "
                               f"interpreter, which cannot run here: {fault}")
    return TritonAttention()


def _cpu_ops(device: torch.device) -> Any:
    """torch.ops.pagellm_cpu on the CPU where it builds, else None (on the CPU with a
    warning: attention then runs on torch's ops alone)."""
    if device.type != "cpu":
        return None
    try:
        return cpu_ops.load()
    except RuntimeError as e:
        logger.warning("attention runs on torch's ops alone (slower): %s", e)
        return None


# 16 left batch 1 at a 32k context with 32 programs on the H200's 132 SMs (11% of copy
# bandwidth); 64 gave 26%, and 51% instead of 40% at batch 4, nothing lost elsewhere
# (kernel_bench.py --max-segments; docs/benchmarks-log.md, "Decode attention: several KV
# blocks per loop iteration").
MAX_KV_SEGMENTS = 64


def num_kv_segments(num_reqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int,
                    num_sms: int, max_segments: int = MAX_KV_SEGMENTS) -> int:
    """Split-KV slices for a decode-only batch: enough programs to fill the GPU twice
    over, each slice at least 256 keys long, at most `max_segments` slices."""
    if max_query_len != 1 or num_sms == 0:
        return 1
    programs = num_reqs * num_kv_heads
    segments = 1
    while (segments < max_segments and programs * segments < 2 * num_sms
           and max_seq_len // (segments * 2) >= 256):
        segments *= 2
    return segments


class Attention(nn.Module):
    """One layer's paged attention. sliding_window W: a query at position p attends keys
    p - W < j <= p (transformers' `sliding_window_overlay`; None: full causal).
    softcap c: Gemma 2's logit soft-capping, scores s -> c * tanh(s / c) before the mask
    and the softmax (None: off)."""

    def __init__(self, layer_idx: int, scale: float, sliding_window: int | None = None,
                 softcap: float | None = None) -> None:
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        if softcap is not None and not softcap > 0:
            raise ValueError(f"softcap must be > 0 or None, got {softcap}")
        self.layer_idx = layer_idx
        self.scale = scale
        self.sliding_window = sliding_window
        self.softcap = softcap

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata, kv_caches: list[torch.Tensor],
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, H_kv, D]; sinks: [H] (the layer's attention sinks,
        a parameter of its attention block) or None -> [T, H, D]."""
        kv_cache = kv_caches[self.layer_idx]  # [2, num_blocks, block_size, H_kv, D]
        return meta.backend(q, k, v, kv_cache, meta, self.scale, self.sliding_window,
                            self.softcap, sinks)
