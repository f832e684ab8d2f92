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
import warnings
from typing import Annotated, Any, Literal, NamedTuple

import msgspec

from pagellm.protocol.lora import LoRARequest
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
# vLLM's packed broadcasts (weights/packed.py): a chunk is received into a buffer of
# about this size, so a client's value is bounded where it enters (vLLM's default: 1 GiB).
MAX_PACKED_BUFFER_BYTES = 16 * 2**30
MAX_PACKED_NUM_BUFFERS = 16


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


class PackingFields(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """vLLM's packing fields as an update_info names them (vLLM < 0.28 read them there;
    newer vLLM, and pagellm, from init_info): each one named overrides the init_info's
    for this update; None, not named. Bounded here: a foreign client reaches the engine
    core with these without passing the frontend."""

    packed: bool | None = None
    packed_buffer_size_bytes: int | None = None
    packed_num_buffers: int | None = None

    def __post_init__(self) -> None:
        if self.packed is not None and not isinstance(self.packed, bool):
            raise TypeError(f"packed must be a boolean, got {self.packed!r}")
        check_int("packed_buffer_size_bytes", self.packed_buffer_size_bytes, minimum=1,
                  maximum=MAX_PACKED_BUFFER_BYTES, allow_none=True)
        check_int("packed_num_buffers", self.packed_num_buffers, minimum=1,
                  maximum=MAX_PACKED_NUM_BUFFERS, allow_none=True)


class WeightUpdate(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One chunk of new weights, `buffer_bytes` long, each spec's tensor at its offset.
    Where those bytes are (no pickle either way):
    - `buffer`: a shared-memory file under /dev/shm, made by the sender (backend "ipc");
    - `cuda_ipc`: a device buffer of the sender's, one share per receiving worker
      (backend "ipc" with CUDA tensors, to a CUDA engine in another process);
    - neither: they arrive by broadcast from the trainer's rank 0, in `specs` order
      (backend "nccl", after init_weight_transfer_engine), one tensor per broadcast or
      packed as the group's init_info said, unless `packing` (old vLLM's update_info
      fields) says otherwise for this update."""

    specs: list[WeightSpec]
    buffer: str | None = None
    buffer_bytes: int = 0
    cuda_ipc: list[CudaIpcBuffer] | None = None
    packing: PackingFields | None = None

    def __post_init__(self) -> None:
        if self.buffer is not None and self.cuda_ipc is not None:
            raise ValueError("a weight update's bytes are in a buffer file or behind CUDA "
                             "IPC handles, not both")
        if self.packing is not None and (self.buffer is not None
                                         or self.cuda_ipc is not None):
            raise ValueError("packing fields describe a broadcast update (backend "
                             "'nccl'), not one in a buffer")


class PauseArgs(NamedTuple):
    """PAUSE's arguments. `clear_cache` (vLLM's `pause_generation(clear_cache=...)`):
    once the pause has settled, reset the prefix cache, preempting what a pause in mode
    "keep" froze so that no block is held (they recompute after the resume). It defaults
    to False on the wire, so a client that sends the mode alone keeps the cache as
    before; `LLM` and `AsyncLLM` default to vLLM's True."""

    mode: PauseMode
    clear_cache: bool = False

    @classmethod
    def from_vllm(cls, mode: str, wait_for_inflight_requests: bool | None,
                  clear_cache: bool) -> PauseArgs:
        """vLLM's `pause_generation` keywords, checked by name: its deprecated
        `wait_for_inflight_requests=True` is mode "wait" (with a DeprecationWarning, as
        vLLM gives), and refused beside a mode other than "abort" (vLLM's default) or
        "wait", which vLLM would silently override. The mode itself is checked by the
        engine core (its Literal)."""
        if not isinstance(clear_cache, bool):
            raise TypeError(f"clear_cache must be a bool, got {type(clear_cache).__name__}")
        if wait_for_inflight_requests is not None and not isinstance(
                wait_for_inflight_requests, bool):
            raise TypeError(f"wait_for_inflight_requests must be a bool or None, got "
                            f"{type(wait_for_inflight_requests).__name__}")
        if wait_for_inflight_requests:
            if mode not in ("abort", "wait"):
                raise ValueError(f"wait_for_inflight_requests=True (the old spelling of "
                                 f"mode='wait') contradicts mode={mode!r}; pass mode alone")
            warnings.warn("pause_generation(wait_for_inflight_requests=...) is deprecated "
                          "(as in vLLM); pass mode='wait' instead", DeprecationWarning,
                          stacklevel=3)
            mode = "wait"
        return cls(mode, clear_cache)  # type: ignore[arg-type]  # the core checks the Literal


class AddLoRAArgs(NamedTuple):
    """ADD_LORA's arguments: the adapter, and for one from tensors in memory (RL adapter
    sync, no file written) its PEFT config and the tensors as a weight update (through
    the "ipc" path: shared memory or CUDA IPC, never the socket)."""

    lora: LoRARequest
    peft_config: dict[str, Any] | None = None
    tensors: WeightUpdate | None = None


class ResetPrefixCacheArgs(NamedTuple):
    """RESET_PREFIX_CACHE's arguments, vLLM's (both False when a client sends none)."""

    reset_running_requests: bool = False  # preempt running requests so no block is held
    reset_connector: bool = False  # there is no KV connector: the result is then False


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

    args: Any  # a tuple or NamedTuple type (one with defaults: trailing arguments may
    # be left out): msgspec.convert(request.args, args) checks a call
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
    # False while blocks are held (and with reset_connector=True: no connector to reset)
    UtilityMethod.RESET_PREFIX_CACHE: Signature(ResetPrefixCacheArgs, bool, Merge.ALL),
    UtilityMethod.SLEEP: Signature(tuple[SleepLevel, PauseMode], None, no_timeout=True),
    UtilityMethod.WAKE_UP: Signature(  # True: all awake
        tuple[list[WakeTag] | None], bool, Merge.ALL, WeightsEffect.MAY_EMPTY,
        no_timeout=True),
    UtilityMethod.IS_SLEEPING: Signature(tuple[()], bool, Merge.ANY),
    UtilityMethod.PAUSE: Signature(PauseArgs, None, no_timeout=True),
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
    # LoRA adapters: True once added (every worker read it) / removed (False: unknown);
    # the ids added, each core's (data parallelism: joined, as every core adds each).
    UtilityMethod.ADD_LORA: Signature(AddLoRAArgs, bool, Merge.ALL, no_timeout=True),
    UtilityMethod.REMOVE_LORA: Signature(tuple[int], bool, Merge.ALL),
    UtilityMethod.LIST_LORAS: Signature(tuple[()], list[int], Merge.CONCAT),
}


def convert_args(method: UtilityMethod, args: list[Any]) -> tuple[Any, ...]:
    """The call's arguments as the method's tuple; ValueError naming the method."""
    try:
        return msgspec.convert(args, SIGNATURES[method].args)
    except msgspec.ValidationError as e:
        raise ValueError(f"bad arguments for {method.name.lower()}: {e}") from None
