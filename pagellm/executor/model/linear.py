"""A linear layer on the CPU through the fastest of five GEMMs for its shape and CPU.

    x [M, in] @ W^T [in, out] -> [M, out], computed one of five ways:
      W_XT    torch.mm(W, x^T): W as the big left operand, streamed (one row of x
              padded to two: a stride-0 expand is slow there)
      ONEDNN  oneDNN's fp32 linear on the plain weights
      ATEN    F.linear: MKL's sgemv/sgemm for fp32, oneDNN's matmul for bf16
      PACKED  oneDNN's linear on a packed copy of W (fp32 off Intel; bf16 on CPUs with
              AMX or AVX512-BF16)
      GEMV    pagellm's bf16 GEMV (kernels/csrc/cpu_bf16.cpp: AVX-512, and AVX512-BF16's
              dot products where the CPU has them)

Which one is fastest depends on the CPU's vendor, because MKL runs its own fast
kernels only on Intel CPUs and a generic AVX2 path elsewhere (benchmarks/small_gemm.py
measures them all; docs/benchmarks-log.md, "CPU GEMMs on Intel" and "Small-batch GEMMs
by width", has the tables):
- AMD (EPYC with AVX-512, 2026-11-24), fp32: with 1-4 rows MKL reads W at a third to a
  half of the memory bandwidth and W_XT near it, except from 2048 input features up,
  where ONEDNN streams W faster; with more rows ONEDNN's GEMM reaches 450 GFLOP/s where
  MKL's reaches 205, and PACKED more again (2026-11-29: SmolLM2-135M's shapes with their
  weights read from memory, 1.4-1.9x ONEDNN at 16 rows, 1.2-1.7x at 48, 1.03-1.5x at
  2048: on plain weights oneDNN copies panels of W into its layout at every call; a
  48-request fp32 run 11% faster).
- Intel (Xeon with AMX, 2026-11-26), fp32: with 1-3 rows MKL's sgemv/sgemm reads W
  1.3-2.8x faster than W_XT (which stays at 11-14 GB/s) and 1.1-1.5x faster than
  ONEDNN; from 4 rows ONEDNN is fastest. Qwen2.5-0.5B's batch-1 decode: 2x.
- Anything else keeps the AMD rules, the first measured.
- bf16 up to 4 rows on CPUs with AVX-512: GEMV. W_XT read SmolLM2's bf16 weights at
  7-12 GB/s on the AMD EPYC, the GEMV at 20-35 (2.2-3.5x; 2026-11-29,
  docs/benchmarks-log.md). Without AVX-512 (or a compiler for the C++ ops): W_XT.
- bf16 and fp16, any CPU: W_XT up to 4 rows (no reorder of W: it is the streamed
  left operand), more rows ATEN, except bf16 on CPUs with AMX or AVX512-BF16 (below).
  On the Intel machine W_XT also times 1.2-1.7x faster alone at 8-256 rows in bf16, but
  a 48-request run through the engine was 5-9% slower with it: not adopted.
- bf16 on CPUs with AMX (Intel Xeon from Sapphire Rapids), more than 4 rows: PACKED,
  oneDNN on a copy of W reordered once into its blocked layout. F.linear on the plain
  bf16 weights was 1.2-2.3x slower at 5-2048 rows (oneDNN seems to reorder W on every
  call: AMX wants it in pairs of rows); a 48-request bf16 run is ~20% faster packed.
  The same on CPUs with AVX512-BF16 (AMD EPYC, 2026-11-29): packed 1.1-1.7x F.linear's
  rate at 16-48 rows, 1.03-1.05x at 2048 (SmolLM2-135M's shapes and its LM head), a
  48-request bf16 run 6-12% faster (against the fused decode step on plain weights).

On Intel fp32 keeps ONEDNN on the plain weights: PACKED there is not measured.

Packed copies (`PackedWeights`) cost a second copy of every linear weight in memory:
the loader makes them only when weights and copies together take at most half of this
worker's share of the memory available (a model too big for that runs on its plain
weights, as before). The
plain parameters stay the truth that loading, weight updates, sleep and extensions read
and write. A copy is made again when its parameter's storage or version changed (every
in-place write through the parameter or a view of it); writes that bypass the version
counter (a collective's receive, an extension writing `param.data`) are covered by the
worker dropping every copy after each weight update, sleep and collective_rpc
(`drop_packed`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import logging
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from pagellm.kernels import cpu_int_gemm, cpu_ops

logger = logging.getLogger("pagellm")


class Way(enum.Enum):
    W_XT = "W @ x^T"
    ONEDNN = "oneDNN"
    ATEN = "F.linear"
    PACKED = "oneDNN, packed W"
    GEMV = "pagellm's bf16 GEMV"


# Rows of x up to which an fp32 GEMM off Intel runs as W @ x^T ...
SMALL_BATCH_ROWS = 4
# ... unless x is this wide: W @ x^T then reads W at 17-30 GB/s where oneDNN's unpacked
# GEMM streams it at 30-48 (K = in features from 2048 up, out features 576 to 4864,
# 1-4 rows; below it W @ x^T wins, by up to 40% at K = 896). Every MLP down projection
# of a real model is that wide.
SMALL_BATCH_ONEDNN_MIN_IN = 2048
# Rows of x up to which an fp32 GEMM on Intel runs through MKL (F.linear).
INTEL_MKL_MAX_ROWS = 3


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Run the import-time probes on one thread: a parallel region here would give the
    importing thread an OpenMP team for good, and a second team (an engine's step
    thread with async_scheduling: executor/executor.py `_on_step_thread`) makes
    libgomp stop its idle threads from spinning, which slowed CPU steps by half."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _onednn_linear() -> Callable[..., torch.Tensor] | None:
    """oneDNN's fp32 linear on plain (unpacked) weights, where this torch has it."""
    op = getattr(torch.ops.mkldnn, "_linear_pointwise", None) \
        if torch.backends.mkldnn.is_available() else None
    if op is None:
        return None
    try:  # present is not enough: some builds register it without a CPU kernel
        with _one_thread():
            op(torch.ones(2, 2), torch.ones(2, 2), None, "none", [], "")
    except RuntimeError:
        return None
    return op


def _cpuinfo(field: str) -> str:
    """/proc/cpuinfo's first `field` line's value ("" where unknown)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(field):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return ""


def _reorder_weight() -> Callable[[torch.Tensor], torch.Tensor] | None:
    """oneDNN's reorder of a linear weight into its blocked layout, where this torch has
    it and the packed weights of both dtypes compute (probed, like `_onednn_linear`)."""
    linear = ONEDNN_LINEAR
    op = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
    if linear is None or op is None:
        return None
    try:
        for dtype in (torch.bfloat16, torch.float32):
            w = torch.ones(16, 32, dtype=dtype)
            with _one_thread():
                linear(torch.ones(5, 32, dtype=dtype), op(w), None, "none", [], "")
    except RuntimeError:
        return None
    return op


@dataclasses.dataclass(frozen=True)
class Cpu:
    """What `choose` needs to know of a CPU."""

    intel_mkl: bool  # MKL's own kernels, as torch links it: only on Intel CPUs
    packed_bf16: bool  # oneDNN's packed bf16 weights (AMX or AVX512-BF16 here)
    packed_fp32: bool  # oneDNN's packed fp32 weights, measured faster off Intel (AMD)
    avx512: bool  # the bf16 GEMV's vectors


ONEDNN_LINEAR = _onednn_linear()
REORDER_WEIGHT = _reorder_weight()
_FLAGS = set(_cpuinfo("flags").split())
THIS_CPU = Cpu(
    intel_mkl=torch.backends.mkl.is_available() and _cpuinfo("vendor_id") == "GenuineIntel",
    packed_bf16=REORDER_WEIGHT is not None and not {"amx_bf16", "avx512_bf16"}.isdisjoint(_FLAGS),
    packed_fp32=REORDER_WEIGHT is not None and _cpuinfo("vendor_id") != "GenuineIntel",
    avx512="avx512f" in _FLAGS)


class PackedWeights:
    """A packed copy of each weight registered with `pack`, by parameter, made by this
    registry's `packer`: oneDNN's reorder (`PACKED_WEIGHTS`) or the CPU int kernel's
    int8 layout (`INT_WEIGHTS`).

    The loader registers a model's linear weights when their copies fit (`pack`); other
    weights are not packed (`get` is None: the GEMM takes F.linear). A copy is reused
    while its parameter keeps the storage and version it was packed from (an in-place
    write bumps the version of the tensor and of all its views); `clear` drops every
    copy, for the writes no version counter sees, and the next `get` packs again.
    Weights are held weakly: one that is garbage collected takes its copy with it.
    (Keyed by id: a WeakKeyDictionary would compare two tensors with ==, elementwise.)"""

    def __init__(self, packer: Callable[[torch.Tensor], Any] | None) -> None:
        self.packer = packer  # weight [out, in] -> its packed copy
        self._registered: dict[int, weakref.ref[torch.Tensor]] = {}  # id -> weight
        # id(weight) -> (data_ptr, version, packed copy of the weight [out, in])
        self._copies: dict[int, tuple[int, int, Any]] = {}

    def pack(self, weights: Iterable[torch.Tensor]) -> None:
        """Register these and pack them now (the loader does, before the engine measures
        the memory left for the KV cache). Without a packer (`REORDER_WEIGHT`: some
        torch builds lack oneDNN's packed weights) none is registered: F.linear."""
        if self.packer is None:
            return
        for w in weights:
            self._registered[id(w)] = weakref.ref(w, functools.partial(self._forget, id(w)))
            self.get(w)

    def get(self, weight: torch.Tensor) -> Any:
        """weight's packed copy, made now if it has none or the weight changed; None for
        a weight never registered."""
        key = id(weight)
        registered = self._registered.get(key)
        if registered is None or registered() is not weight:
            return None
        entry = self._copies.get(key)
        # (A tensor made in inference mode has no version counter: `clear` covers it.)
        version = -1 if weight.is_inference() else weight._version
        if entry is None or entry[0] != weight.data_ptr() or entry[1] != version:
            assert self.packer is not None
            with torch.no_grad():
                entry = (weight.data_ptr(), version, self.packer(weight.detach()))
            self._copies[key] = entry
        return entry[2]

    def _forget(self, key: int, _: object = None) -> None:
        """A registered weight was collected (a weakref callback)."""
        self._copies.pop(key, None)
        self._registered.pop(key, None)

    def clear(self) -> None:
        """Drop every copy (the weights stay registered)."""
        self._copies.clear()

    def __len__(self) -> int:
        """Copies held now."""
        return len(self._copies)


def _int8_copy(weight: torch.Tensor) -> cpu_int_gemm.CpuIntWeight:
    """weight [out, in] as int8 codes in groups for the CPU int kernel: the LM head of a
    model whose projections run that kernel (the model runner registers it)."""
    # (quantize imports us)
    from pagellm.executor.model.quantize import group_size_for, in_huge_pages

    return in_huge_pages(cpu_int_gemm.quantize(weight.float(), 8,
                                               group_size_for(weight.shape[1])))


PACKED_WEIGHTS = PackedWeights(REORDER_WEIGHT)
INT_WEIGHTS = PackedWeights(_int8_copy)


def drop_packed() -> None:
    """Drop every packed copy: the weights were written in a way no version counter saw,
    or their memory must go (sleep). The next GEMM packs again (~1 s per GB)."""
    PACKED_WEIGHTS.clear()
    INT_WEIGHTS.clear()


def packs_weights(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether GEMMs of a model of `dtype` on `device` take the PACKED way (the loader
    packs its linear weights if their copies fit)."""
    cpu = THIS_CPU
    return device.type == "cpu" and ((dtype == torch.bfloat16 and cpu.packed_bf16)
                                     or (dtype == torch.float32 and cpu.packed_fp32))


def choose(rows: int, in_features: int, dtype: torch.dtype, cpu: Cpu) -> Way:
    """The GEMM for x [rows, in_features] of `dtype` on `cpu` (the module doc's rules)."""
    if dtype == torch.float32:
        if ONEDNN_LINEAR is None:
            return Way.W_XT if rows <= SMALL_BATCH_ROWS and not cpu.intel_mkl else Way.ATEN
        if cpu.intel_mkl:
            return Way.ATEN if rows <= INTEL_MKL_MAX_ROWS else Way.ONEDNN
        if rows <= SMALL_BATCH_ROWS:
            return Way.W_XT if in_features < SMALL_BATCH_ONEDNN_MIN_IN else Way.ONEDNN
        return Way.PACKED if cpu.packed_fp32 else Way.ONEDNN
    if rows <= SMALL_BATCH_ROWS:
        return Way.GEMV if dtype == torch.bfloat16 and cpu.avx512 else Way.W_XT
    return Way.PACKED if dtype == torch.bfloat16 and cpu.packed_bf16 else Way.ATEN


def gemm(way: Way, x: torch.Tensor, weight: torch.Tensor,
         bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, in] @ weight^T [in, out] (+ bias [out]) -> [M, out], contiguous, computed
    `way` (benchmarks/small_gemm.py times each through here)."""
    if way is Way.GEMV:
        op = _bf16_gemv()
        if op is not None:
            y = op(x.contiguous(), weight.contiguous())
            return y if bias is None else y + bias
        way = Way.W_XT
    if way is Way.W_XT:
        rows = x.shape[0]
        padded = x if rows > 1 else torch.cat((x, x))  # [max(M, 2), in]
        y = torch.mm(weight, padded.t())[:, :rows].t().contiguous()  # [M, out]
        return y if bias is None else y + bias
    if way is Way.ONEDNN or way is Way.PACKED:
        assert ONEDNN_LINEAR is not None
        w = PACKED_WEIGHTS.get(weight) if way is Way.PACKED else weight
        if w is None and weight.dtype == torch.float32:
            w = weight  # not packed: oneDNN on the plain fp32 weight (bf16: F.linear)
        if w is not None:
            return ONEDNN_LINEAR(x.contiguous(), w, bias, "none", [], "")
    return F.linear(x, weight, bias)


@functools.cache
def _bf16_gemv() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """The C++ bf16 GEMV, built on first use; None (with a warning: W @ x^T instead)
    where the C++ ops cannot be built."""
    try:
        return cpu_ops.load().bf16_linear
    except RuntimeError as e:
        logger.warning("bf16 GEMMs of up to %d rows take W @ x^T (slower): %s",
                       SMALL_BATCH_ROWS, e)
        return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """F.linear (x: [M, in], weight: [out, in] -> [M, out]) with the CPU's fastest GEMM:
    the int kernel for a weight registered in INT_WEIGHTS."""
    if x.is_cuda or x.dim() != 2 or x.shape[0] == 0:
        return F.linear(x, weight, bias)
    copy = INT_WEIGHTS.get(weight)
    if copy is not None:
        return cpu_int_gemm.int_linear(x, copy, bias)
    if x.dtype != weight.dtype:
        return F.linear(x, weight, bias)
    return gemm(choose(x.shape[0], x.shape[1], x.dtype, THIS_CPU), x, weight, bias)
