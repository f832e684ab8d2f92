"""vLLM's packed broadcast (`vllm/distributed/weight_transfer/packed_tensor.py`): many
tensors travel as one uint8 broadcast, so a checkpoint of hundreds of tensors costs a
few collectives instead of hundreds. Names, signatures and wire format are vLLM's, so a
trainer written for vLLM (TRL's VLLMClient) streams into pagellm unchanged, and
pagellm's trainer side can feed vLLM.

The wire format is the chunking rule alone (no header travels): both sides walk the
same (name, shape, dtype) list and cut it the same way. Tensors join the current chunk
until its bytes EXCEED `buffer_size_bytes`; the crossing tensor stays in that chunk,
which is then sent as its tensors' bytes back to back:

    buffer_size_bytes = 100, tensors of 60, 60, 30, 250, 10 bytes
    chunk 0: [60][60]      120 > 100: cut after the crossing tensor
    chunk 1: [30][250]     280 > 100 (a tensor larger than the buffer rides along)
    chunk 2: [10]          the rest, however small

A chunk is therefore at most `buffer_size_bytes` + its last tensor's bytes.

vLLM overlaps packing the next chunk with broadcasting this one on `num_buffers` CUDA
streams. Here each chunk is packed, broadcast and released before the next, on CPUs and
GPUs alike (a broadcast over torch's NCCL group is already ordered on the current
stream): `num_buffers` is accepted and checked, for vLLM's signature, and never changes
the bytes on the wire (vLLM's neither: it is the overlap's depth).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol, TypeVar

import torch

from pagellm.protocol.utility import MAX_PACKED_BUFFER_BYTES, MAX_PACKED_NUM_BUFFERS
from pagellm.protocol.validation import check_int

DEFAULT_PACKED_BUFFER_SIZE_BYTES = 1024 * 1024 * 1024  # vLLM's: 1 GiB
DEFAULT_PACKED_NUM_BUFFERS = 2  # vLLM's: double buffering

T = TypeVar("T")


class BroadcastGroup(Protocol):
    """What the producer and consumer need of a group: `pagellm.weights.nccl.WeightGroup`
    (or vLLM's PyNcclCommunicator, which has both)."""

    device: torch.device

    def broadcast(self, tensor: torch.Tensor, src: int) -> None: ...


def check_packing(buffer_size_bytes: int, num_buffers: int) -> None:
    """ValueError/TypeError naming the field unless both are in bounds: a buffer size
    is what a chunk is allocated for, so it is bounded where a client names it."""
    check_int("packed_buffer_size_bytes", buffer_size_bytes, minimum=1,
              maximum=MAX_PACKED_BUFFER_BYTES)
    check_int("packed_num_buffers", num_buffers, minimum=1, maximum=MAX_PACKED_NUM_BUFFERS)


def _chunks(items: Iterator[T], nbytes: Callable[[T], int], buffer_size_bytes: int
            ) -> Iterator[list[T]]:
    """vLLM's chunking rule (module docstring), lazily: one chunk's items at a time."""
    chunk: list[T] = []
    total = 0
    for item in items:
        chunk.append(item)
        total += nbytes(item)
        if total > buffer_size_bytes:
            yield chunk
            chunk, total = [], 0
    if chunk:
        yield chunk


def chunk_bounds(sizes: Sequence[int], buffer_size_bytes: int) -> list[range]:
    """Which tensors (by index) each chunk holds, for tensors of `sizes` bytes: what
    the receiver plans before the first byte arrives."""
    bounds, start = [], 0
    for chunk in _chunks(iter(sizes), int, buffer_size_bytes):
        bounds.append(range(start, start + len(chunk)))
        start += len(chunk)
    return bounds


def unpack_tensor(packed_tensor: torch.Tensor, names: list[str], shapes: list[list[int]],
                  dtypes: list[torch.dtype], tensor_sizes: list[int]
                  ) -> list[tuple[str, torch.Tensor]]:
    """vLLM's: the named tensors of one chunk, as views of `packed_tensor` ([bytes]
    uint8); a caller that keeps one past the buffer's reuse must clone it. A tensor
    whose bytes start off its dtype's alignment (a float32 after an odd count of
    16-bit values: torch views no such bytes as float32) comes as a copy instead."""
    parts = packed_tensor.split(tensor_sizes)
    return [(name, (part if part.storage_offset() % dtype.itemsize == 0 else part.clone())
             .view(dtype).view(shape))
            for name, shape, dtype, part in zip(names, shapes, dtypes, parts, strict=True)]


def _as_bytes(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[nbytes] uint8 view of `tensor`'s elements in row-major order, on `device`
    (flattened first: a 0-dim tensor cannot be viewed as another dtype)."""
    return tensor.detach().to(device).contiguous().reshape(-1).view(torch.uint8)


def packed_nccl_broadcast_producer(
        iterator: Iterator[tuple[str, torch.Tensor]], group: BroadcastGroup, src: int,
        post_iter_func: Callable[[tuple[str, torch.Tensor]], torch.Tensor],
        buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES,
        num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS) -> None:
    """The trainer's side: broadcast `post_iter_func(item)` of every `(name, tensor)`
    item, packed into chunks. Only one chunk (and the tensors it is made of) is held
    at a time, so a generator of parameters is never materialized whole. The receivers
    must cut with the same `buffer_size_bytes` (the engine takes it from init_info)."""
    check_packing(buffer_size_bytes, num_buffers)
    flats = ((name, _as_bytes(post_iter_func((name, tensor)), group.device))
             for name, tensor in iterator)
    for chunk in _chunks(flats, lambda item: item[1].numel(), buffer_size_bytes):
        packed = torch.cat([flat for _, flat in chunk])  # [chunk bytes] uint8
        chunk.clear()  # the tensors' own copies (a device move) go before the broadcast
        group.broadcast(packed, src=src)


def packed_nccl_broadcast_consumer(
        iterator: Iterator[tuple[str, tuple[list[int], torch.dtype]]],
        group: BroadcastGroup, src: int,
        post_unpack_func: Callable[[list[tuple[str, torch.Tensor]]], None],
        buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES,
        num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS,
        device: torch.device | str = "cuda") -> None:
    """A receiver's side, for `(name, (shape, dtype))` items in the producer's order:
    each chunk arrives into a buffer of its own (on `device`) and `post_unpack_func`
    gets its named tensors, views of that buffer (it may keep them: the buffer is never
    reused). The engine's worker receives with its own loop instead
    (`weight_receiver.receive`: one reused buffer, every name checked first)."""
    check_packing(buffer_size_bytes, num_buffers)

    def nbytes(item: tuple[str, tuple[list[int], torch.dtype]]) -> int:
        shape, dtype = item[1]
        return math.prod(shape) * dtype.itemsize

    for chunk in _chunks(iterator, nbytes, buffer_size_bytes):
        sizes = [nbytes(item) for item in chunk]
        packed = torch.empty(sum(sizes), dtype=torch.uint8, device=device)  # [chunk bytes]
        group.broadcast(packed, src=src)
        post_unpack_func(unpack_tensor(packed, [name for name, _ in chunk],
                                       [list(shape) for _, (shape, _) in chunk],
                                       [dtype for _, (_, dtype) in chunk], sizes))
