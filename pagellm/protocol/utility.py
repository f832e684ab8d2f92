"""Typed utility calls: one row per allowed method (`SIGNATURES`), saying what it takes
and returns and how every side treats it.

A `UtilityRequest` carries its arguments as a plain msgpack list; the engine core
converts it to the method's argument tuple below (msgspec checks arity, types and the
Literal spellings), so a bad call fails alone with a message naming the method. Results
are msgpack bytes of the method's result type.

Adding a call: a `UtilityMethod` member (the closed set a client may name), its row
here, its handler in `EngineCore._utility_handlers`, and its public method (`LLM`,
`AsyncLLM`, a dev route). How data-parallel results merge, when the engine refuses it
and how long the frontend waits for it are the row's.
"""

from __future__ import annotations

import enum
import re
from typing import Annotated, Any, Literal, NamedTuple

import msgspec

from pagellm.protocol.messages import UtilityMethod
from pagellm.protocol.stats import EngineStats
from pagellm.protocol.validation import check_int

SleepLevel = Literal[0, 1, 2]  # 0: pause only; 1: free the KV cache, weights to host; 2: both
PauseMode = Literal["abort", "wait", "keep"]
WakeTag = Literal["weights", "kv_cache", "scheduling"]  # "scheduling" ends a level-0 sleep
WEIGHT_DTYPES = ("float32", "float16", "bfloat16")
CUDA_IPC_HANDLE_SIZE = 64  # cudaIpcEventHandle_t; a memory handle may carry more (torch's)
MAX_IPC_HANDLE_BYTES = 4096
REF_COUNTER_NAME = re.compile(rb"/torch_\d{1,10}_\d{1,20}_\d{1,20}")  # at::NewProcessWideShmHandle
REF_COUNTER_SLOTS = 10000  # torch::CUDA_IPC_REF_COUNTER_FILE_SIZE: slots per counter file


# A tensor dimension or byte offset: bounded where it enters (a value past 2**64 could
# not even be encoded again, and a 500 was all a client got).
Size = Annotated[int, msgspec.Meta(ge=0, le=2**62)]


class WeightSpec(msgspec.Struct, array_like=True, gc=False):
    """One tensor of a weight update: its checkpoint name (Hugging Face's), dtype, shape
    and where its bytes start in the update's buffer."""

    name: str
    dtype: str
    shape: list[Size]
    offset: Size = 0


class CudaIpcBuffer(msgspec.Struct, array_like=True, gc=False):
    """One device buffer shared through CUDA IPC: the eight values torch's
    `UntypedStorage._share_cuda_()` returns, as named fields (vLLM pickles them). One
    per receiving worker: torch counts each share once, and each receiver releases its
    own, so the sender's buffer is freed once every receiver let go.

    Checked on arrival, before anything is opened: torch trusts these values, and a
    counter slot outside torch's counter file would be written to."""

    device_uuid: str  # the GPU the buffer lives on (receivers number devices their own way)
    handle: bytes  # the cudaIpcMemHandle of the allocation the buffer lies in
    buffer_bytes: int
    offset_bytes: int  # where the buffer starts in that allocation
    ref_counter: bytes  # torch's shared-memory counter file ("/torch_<pid>_<n>_<n>")
    ref_counter_offset: int  # this share's slot in that file
    event_handle: bytes  # the sender's cudaIpcEventHandle: the bytes are written when it fires
    event_sync_required: bool

    def __post_init__(self) -> None:
        if not 0 < len(self.device_uuid) <= 64:
            raise ValueError("cuda_ipc device_uuid must be a GPU's UUID")
        if not 0 < len(self.handle) <= MAX_IPC_HANDLE_BYTES:
            raise ValueError(f"cuda_ipc handle must be 1-{MAX_IPC_HANDLE_BYTES} bytes")
        check_int("cuda_ipc buffer_bytes", self.buffer_bytes, minimum=1, maximum=2**62)
        check_int("cuda_ipc offset_bytes", self.offset_bytes, minimum=0, maximum=2**62)
        if REF_COUNTER_NAME.fullmatch(self.ref_counter) is None:
            raise ValueError("cuda_ipc ref_counter must name one of torch's counter files "
                             "(/torch_<pid>_<n>_<n>)")
        check_int("cuda_ipc ref_counter_offset", self.ref_counter_offset, minimum=0,
                  maximum=REF_COUNTER_SLOTS - 1)
        if len(self.event_handle) != CUDA_IPC_HANDLE_SIZE:
            raise ValueError(f"cuda_ipc event_handle must be {CUDA_IPC_HANDLE_SIZE} bytes")


class WeightUpdate(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One chunk of new weights, `buffer_bytes` long, each spec's tensor at its offset.
    Where those bytes are (no pickle either way):
    - `buffer`: a shared-memory file under /dev/shm, made by the sender (backend "ipc");
    - `cuda_ipc`: a device buffer of the sender's, one share per receiving worker
      (backend "ipc" with CUDA tensors, to a CUDA engine in another process);
    - neither: they arrive by broadcast from the trainer's rank 0, in `specs` order
      (backend "nccl", after init_weight_transfer_engine)."""

    specs: list[WeightSpec]
    buffer: str | None = None
    buffer_bytes: int = 0
    cuda_ipc: list[CudaIpcBuffer] | None = None

    def __post_init__(self) -> None:
        if self.buffer is not None and self.cuda_ipc is not None:
            raise ValueError("a weight update's bytes are in a buffer file or behind CUDA "
                             "IPC handles, not both")


class Merge(enum.Enum):
    """How one call's results from every data-parallel engine core (in rank order)
    combine into one (`frontend/engine_client/dp_routing.merge_results`)."""

    NOTHING = enum.auto()  # no result: None
    STATS = enum.auto()  # `merge_stats`: counts summed, KV usage over all blocks, timings averaged
    ALL = enum.auto()  # True only if every core's is (reset everywhere, awake everywhere)
    ANY = enum.auto()  # True if any core's is (not all serving)
    CONCAT = enum.auto()  # the cores' lists joined: one result per worker, rank order
    MIN = enum.auto()  # the least (tensors every core loaded)


class WeightsEffect(enum.Enum):
    """Whether a call may change which checkpoint tensors are loaded: after one that
    may, the engine core counts the missing ones again (requests are refused while any
    is missing, after a wake from sleep level 2)."""

    NONE = enum.auto()
    MAY_LOAD = enum.auto()  # it may load some: counted again while any is missing
    MAY_EMPTY = enum.auto()  # waking from level 2 allocates them empty: always counted


class Signature(NamedTuple):
    """One utility call's row: all of it but its handler and its public methods."""

    args: Any  # a tuple type: msgspec.convert(request.args, args) checks a call
    result: Any
    merge: Merge = Merge.NOTHING  # data parallelism: how the cores' results combine
    weights: WeightsEffect = WeightsEffect.NONE
    # Refused while any memory sleeps ("cannot <call>: the engine is sleeping ...; call
    # wake_up() first"): resuming then would schedule into freed memory.
    refused_asleep: bool = False
    # The frontend waits for the answer with no timeout: the call lasts as long as what
    # it waits for (the requests a pause in mode "wait" lets finish, weights copied in or
    # back and CUDA graphs captured again, a trainer joining: bounded by the engine).
    no_timeout: bool = False


SIGNATURES: dict[UtilityMethod, Signature] = {
    UtilityMethod.GET_STATS: Signature(tuple[()], EngineStats, Merge.STATS),
    # False while blocks are held
    UtilityMethod.RESET_PREFIX_CACHE: Signature(tuple[()], bool, Merge.ALL),
    UtilityMethod.SLEEP: Signature(tuple[SleepLevel, PauseMode], None, no_timeout=True),
    UtilityMethod.WAKE_UP: Signature(  # True: all awake
        tuple[list[WakeTag] | None], bool, Merge.ALL, WeightsEffect.MAY_EMPTY,
        no_timeout=True),
    UtilityMethod.IS_SLEEPING: Signature(tuple[()], bool, Merge.ANY),
    UtilityMethod.PAUSE: Signature(tuple[PauseMode], None, no_timeout=True),
    UtilityMethod.RESUME: Signature(tuple[()], None, refused_asleep=True),
    UtilityMethod.IS_PAUSED: Signature(tuple[()], bool, Merge.ANY),
    # (method name, positional args, keyword args) -> one result per worker; the
    # caller gives the timeout
    UtilityMethod.COLLECTIVE_RPC: Signature(tuple[str, list[Any], dict[str, Any]], list[Any],
                                            Merge.CONCAT, WeightsEffect.MAY_LOAD),
    UtilityMethod.UPDATE_WEIGHTS: Signature(  # tensors loaded
        tuple[WeightUpdate], int, Merge.MIN, WeightsEffect.MAY_LOAD, no_timeout=True),
    # vLLM's phases: init once (backend "nccl": joins the trainer's group; the init_info
    # dict is checked by the backend), then per round start, update(s), finish.
    UtilityMethod.INIT_WEIGHT_TRANSFER_ENGINE: Signature(tuple[dict[str, Any]], None,
                                                         no_timeout=True),
    UtilityMethod.START_WEIGHT_UPDATE: Signature(tuple[()], None),
    UtilityMethod.FINISH_WEIGHT_UPDATE: Signature(tuple[str | None], None),  # weight_version
}


def convert_args(method: UtilityMethod, args: list[Any]) -> tuple[Any, ...]:
    """The call's arguments as the method's tuple; ValueError naming the method."""
    try:
        return msgspec.convert(args, SIGNATURES[method].args)
    except msgspec.ValidationError as e:
        raise ValueError(f"bad arguments for {method.name.lower()}: {e}") from None
