"""Torch values inside msgpack values, without pickle: msgpack extensions for what RL
frameworks pass to and get back from `collective_rpc` (OpenRLHF's
`update_weight(name, torch.bfloat16, shape, ...)`):

    code 1  a tensor      payload [dtype name, shape, raw bytes]
    code 2  a torch.dtype payload its name, from a closed table (`DTYPE_NAMES`)
    code 3  a torch.Size  payload its dimensions, a bounded list of ints

Each decodes back to the same type, so a worker extension sees `torch.bfloat16`, not
"bfloat16", and compares it with `self.model_config.dtype` as it would under vLLM
(which pickles them). Names and sizes are checked on arrival: the peer may not be ours.
Also the checks of a weight update as a whole (`check_specs`), which every backend
makes on the specs alone."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Annotated, Any

import msgspec
import torch

from pagellm.protocol.utility import WEIGHT_DTYPES, WeightSpec

TENSOR_EXT = 1
DTYPE_EXT = 2
SIZE_EXT = 3
# Tensors: dtypes whose bytes this codec copies (and `check_specs` sizes).
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in (
        "float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8",
        "uint8", "bool")}
# torch.dtype values: a name names one of these or is refused (never getattr(torch, name)
# on a peer's string). Those this torch lacks are left out.
DTYPE_NAMES: dict[str, torch.dtype] = DTYPES | {
    name: dtype for name in (
        "uint16", "uint32", "uint64", "complex64", "complex128", "float8_e4m3fn",
        "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if isinstance(dtype := getattr(torch, name, None), torch.dtype)}
MAX_DIMS = 8  # a tensor's
MAX_SIZE_DIMS = 64  # a torch.Size's (torch's own limit on a tensor's dimensions)
MAX_DIM = 2**62
SizeDims = Annotated[list[Annotated[int, msgspec.Meta(ge=-MAX_DIM, le=MAX_DIM)]],
                     msgspec.Meta(max_length=MAX_SIZE_DIMS)]


def encode_value(value: Any) -> Any:
    """`value` with every tensor, torch.dtype and torch.Size (in lists, tuples and dict
    values) replaced by an Ext. TypeError for a dtype outside the table, ValueError for a
    Size past its bounds: refused here, before anything is sent."""
    if isinstance(value, torch.Tensor):
        tensor = value.detach().to("cpu").contiguous()
        name = _dtype_name(tensor.dtype)
        if name not in DTYPES:
            raise TypeError(f"tensors of dtype {name} cannot be sent")
        raw = tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        return msgspec.msgpack.Ext(TENSOR_EXT, msgspec.msgpack.encode(
            [name, list(tensor.shape), raw]))
    if isinstance(value, torch.Size):  # before tuple: a Size is one
        payload = msgspec.msgpack.encode(list(value))
        _size(payload)  # the receiver's bounds, checked here first
        return msgspec.msgpack.Ext(SIZE_EXT, payload)
    if isinstance(value, torch.dtype):
        name = _dtype_name(value)
        if name not in DTYPE_NAMES:
            raise TypeError(f"torch.{name} cannot be sent (dtypes that can: "
                            f"{', '.join(DTYPE_NAMES)})")
        return msgspec.msgpack.Ext(DTYPE_EXT, msgspec.msgpack.encode(name))
    if isinstance(value, (list, tuple)):
        return [encode_value(v) for v in value]
    if isinstance(value, dict):
        return {k: encode_value(v) for k, v in value.items()}
    return value


def decode_value(value: Any) -> Any:
    """The inverse of `encode_value` (tuples come back as lists, as msgpack has them); a
    malformed or unknown extension raises ValueError."""
    if isinstance(value, msgspec.msgpack.Ext):
        decode = _EXT_DECODERS.get(value.code)
        if decode is None:
            raise ValueError(f"unknown msgpack extension type {value.code}")
        return decode(memoryview(value.data))
    if isinstance(value, list):
        return [decode_value(v) for v in value]
    if isinstance(value, dict):
        return {k: decode_value(v) for k, v in value.items()}
    return value


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _tensor(data: memoryview) -> torch.Tensor:
    try:
        name, shape, raw = msgspec.msgpack.decode(data, type=tuple[str, list[int], bytes])
    except msgspec.DecodeError as e:
        raise ValueError(f"malformed tensor: {e}") from None
    dtype = DTYPES.get(name)
    if dtype is None:
        raise ValueError(f"unknown tensor dtype {name[:24]!r} (known: {', '.join(DTYPES)})")
    size = nbytes("tensor", shape, dtype)
    if size != len(raw):
        raise ValueError(f"tensor of shape {shape} and dtype {name} needs {size} bytes, "
                         f"got {len(raw)}")
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


def _dtype(data: memoryview) -> torch.dtype:
    try:
        name = msgspec.msgpack.decode(data, type=str)
    except msgspec.DecodeError as e:
        raise ValueError(f"malformed torch.dtype: {e}") from None
    dtype = DTYPE_NAMES.get(name)
    if dtype is None:
        raise ValueError(f"unknown torch.dtype {name[:24]!r} (known: "
                         f"{', '.join(DTYPE_NAMES)})")
    return dtype


def _size(data: memoryview | bytes) -> torch.Size:
    try:
        dims = msgspec.msgpack.decode(data, type=SizeDims)
    except msgspec.DecodeError as e:
        raise ValueError(f"bad torch.Size (at most {MAX_SIZE_DIMS} integers, each within "
                         f"+-2**62): {e}") from None
    return torch.Size(dims)


_EXT_DECODERS: dict[int, Callable[[memoryview], Any]] = {
    TENSOR_EXT: _tensor, DTYPE_EXT: _dtype, SIZE_EXT: _size}


def nbytes(name: str, shape: list[int], dtype: torch.dtype) -> int:
    """Bytes of a tensor a peer describes; ValueError naming `name` for a shape that is
    not one (too many dimensions, a negative size)."""
    if len(shape) > MAX_DIMS or any(d < 0 for d in shape):
        shown = shape if len(shape) <= MAX_DIMS else f"of {len(shape)} dimensions"
        raise ValueError(f"{name}: bad shape {shown} (at most {MAX_DIMS} dimensions, "
                         f"none negative)")
    return math.prod(shape) * dtype.itemsize


# --- a weight update as a whole, whatever path it takes -------------------------------

MAX_NAME_CHARS = 512  # a checkpoint tensor's name (Hugging Face's are under 100)


class UpdateTooLarge(ValueError):
    """A weight update whose specs add up to more than the model allows: refused with
    nothing of it copied or received (on the "nccl" backend not even drained: receiving
    it is the cost the limit exists to refuse)."""


def check_specs(specs: list[WeightSpec], limit_bytes: int, limit_count: int) -> None:
    """The checks of an update as a whole, made on its specs alone before any byte of
    it is copied or received, whatever the path (shared-memory file, CUDA IPC, or
    broadcast): its number of tensors and total size (UpdateTooLarge beyond
    `limit_count` / `limit_bytes`; ValueError naming a spec that is no weight), then its
    names (ValueError naming the first that comes twice). Without them a few bytes of
    specs could make the engine copy, or receive, one region of the buffer any number
    of times, or look up any number of names it skips, while it serves no one."""
    if len(specs) > limit_count:
        raise UpdateTooLarge(f"weight update of {len(specs)} tensors is more than the "
                             f"model has ({limit_count} at most); refused, nothing copied "
                             f"or received")
    for spec in specs:  # before any message names one: never echo a client's megabytes
        if len(spec.name) > MAX_NAME_CHARS:
            raise ValueError(f"weight update refused: a tensor name of {len(spec.name)} "
                             f"characters ({spec.name[:40]!r}...), more than "
                             f"{MAX_NAME_CHARS}")
    total = sum(spec_bytes(spec) for spec in specs)
    if total > limit_bytes:
        raise UpdateTooLarge(f"weight update of {total} bytes is larger than the model "
                             f"allows ({limit_bytes}); refused, nothing copied or received")
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise ValueError(f"weight update refused, old weights kept: {spec.name} "
                             f"appears more than once")
        seen.add(spec.name)


def spec_bytes(spec: WeightSpec) -> int:
    """The spec's size in bytes; ValueError naming the weight if it is no weight."""
    if spec.dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight {spec.name}: dtype {spec.dtype[:24]!r} is not a weight dtype "
                         f"({', '.join(WEIGHT_DTYPES)})")
    return nbytes(f"weight {spec.name}", spec.shape, DTYPES[spec.dtype])
