"""Typed utility calls: what each allowed method takes and returns.

A `UtilityRequest` carries its arguments as a plain msgpack list; the engine core
converts it to the method's argument tuple below (msgspec checks arity, types and the
Literal spellings), so a bad call fails alone with a message naming the method. Results
are msgpack bytes of the method's result type.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

import msgspec

from pagellm.protocol.messages import UtilityMethod
from pagellm.protocol.stats import EngineStats

SleepLevel = Literal[0, 1, 2]  # 0: pause only; 1: free the KV cache, weights to host; 2: both
PauseMode = Literal["abort", "wait", "keep"]
WakeTag = Literal["weights", "kv_cache", "scheduling"]  # "scheduling" ends a level-0 sleep
WEIGHT_DTYPES = ("float32", "float16", "bfloat16")


class WeightSpec(msgspec.Struct, array_like=True, gc=False):
    """One tensor of a weight update: its checkpoint name (Hugging Face's), dtype, shape
    and where its bytes start in the update's buffer."""

    name: str
    dtype: str
    shape: list[int]
    offset: int = 0


class WeightUpdate(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One chunk of new weights. With a `buffer`, the bytes lie in a shared-memory file
    (under /dev/shm, made by the sender: backend "ipc"); without one, they arrive by
    broadcast from the trainer's rank 0, in `specs` order (backend "nccl", after
    init_weight_transfer_engine). No pickle either way."""

    specs: list[WeightSpec]
    buffer: str | None = None
    buffer_bytes: int = 0


class Signature(NamedTuple):
    args: Any  # a tuple type: msgspec.convert(request.args, args) checks a call
    result: Any


SIGNATURES: dict[UtilityMethod, Signature] = {
    UtilityMethod.GET_STATS: Signature(tuple[()], EngineStats),
    UtilityMethod.RESET_PREFIX_CACHE: Signature(tuple[()], bool),  # False while blocks held
    UtilityMethod.SLEEP: Signature(tuple[SleepLevel, PauseMode], None),
    UtilityMethod.WAKE_UP: Signature(tuple[list[WakeTag] | None], bool),  # True: all awake
    UtilityMethod.IS_SLEEPING: Signature(tuple[()], bool),
    UtilityMethod.PAUSE: Signature(tuple[PauseMode], None),
    UtilityMethod.RESUME: Signature(tuple[()], None),
    UtilityMethod.IS_PAUSED: Signature(tuple[()], bool),
    # (method name, positional args, keyword args) -> one result per worker
    UtilityMethod.COLLECTIVE_RPC: Signature(tuple[str, list[Any], dict[str, Any]], list[Any]),
    UtilityMethod.UPDATE_WEIGHTS: Signature(tuple[WeightUpdate], int),  # tensors loaded
    # vLLM's phases: init once (backend "nccl": joins the trainer's group; the init_info
    # dict is checked by the backend), then per round start, update(s), finish.
    UtilityMethod.INIT_WEIGHT_TRANSFER_ENGINE: Signature(tuple[dict[str, Any]], None),
    UtilityMethod.START_WEIGHT_UPDATE: Signature(tuple[()], None),
    UtilityMethod.FINISH_WEIGHT_UPDATE: Signature(tuple[str | None], None),  # weight_version
}


def convert_args(method: UtilityMethod, args: list[Any]) -> tuple[Any, ...]:
    """The call's arguments as the method's tuple; ValueError naming the method."""
    try:
        return msgspec.convert(args, SIGNATURES[method].args)
    except msgspec.ValidationError as e:
        raise ValueError(f"bad arguments for {method.name.lower()}: {e}") from None
