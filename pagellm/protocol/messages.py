"""Messages between the frontend and the engine core.

Everything here is a msgspec Struct encoded with msgpack; `array_like=True` sends
fields by position (no key strings on the wire) and `gc=False` keeps the many small
objects of a busy step out of the cyclic garbage collector. New fields go at the end
with a default so that `omit_defaults` keeps messages short.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from pagellm.protocol.lora import LoRARequest
from pagellm.protocol.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    """Why a request finished. `str()` gives the OpenAI spelling ("stop", "length")."""

    STOP = 0  # EOS, a stop token id or a stop string
    LENGTH = 1  # max_tokens or max_model_len reached
    ABORT = 2  # aborted by the client
    ERROR = 3  # the request could not be served; `EngineCoreOutput.error` says why

    def __str__(self) -> str:
        return self.name.lower()


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A tokenized, validated request, as the frontend hands it to the engine core."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams  # max_tokens already resolved (never None here)
    eos_token_id: int | None
    arrival_time: float
    priority: int = 0  # lower runs first under scheduling_policy="priority"
    # Requests with different salts never share KV blocks. At most MAX_CACHE_SALT_CHARS:
    # a salt travels in each of a request's n engine requests.
    cache_salt: str | None = None
    # sampling_params.bad_words as token ids, each word alone and after a space.
    bad_words_token_ids: list[list[int]] | None = None
    # The adapter it runs with (None: the base model). Needs enable_lora.
    lora_request: LoRARequest | None = None


class TokenLogprobs(msgspec.Struct, array_like=True, gc=False):
    """Log-probabilities at one position: the chosen token first (the sampled one, or
    the prompt's actual next token), then the top-k alternatives, most likely first.
    Ranks are 1-based among the whole vocabulary."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one request produced in one engine step."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id (or stop string) that hit
    error: str | None = None  # set with FinishReason.ERROR
    new_logprobs: list[TokenLogprobs] | None = None  # one per new token, if asked for
    # Prompt positions computed this step: entry j predicts the prompt's next token.
    new_prompt_logprobs: list[TokenLogprobs] | None = None
    # With FinishReason.ERROR: refused for the engine's state (paused or asleep), not
    # for the request itself; trying again later may succeed (HTTP 503).
    unavailable: bool = False
    # Prompt tokens found in the prefix cache when the request was first scheduled
    # (vLLM's num_cached_tokens); sent with every output that carries tokens.
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class UtilityMethod(enum.IntEnum):
    """The fixed allow-list of calls a client may make into the engine core."""

    GET_STATS = 0
    RESET_PREFIX_CACHE = 1
    SLEEP = 2
    WAKE_UP = 3
    IS_SLEEPING = 4
    PAUSE = 5
    RESUME = 6
    IS_PAUSED = 7
    COLLECTIVE_RPC = 8
    UPDATE_WEIGHTS = 9
    INIT_WEIGHT_TRANSFER_ENGINE = 10
    START_WEIGHT_UPDATE = 11
    FINISH_WEIGHT_UPDATE = 12
    ADD_LORA = 13
    REMOVE_LORA = 14
    LIST_LORAS = 15
    # Arguments and result types: pagellm.protocol.utility.SIGNATURES.


class UtilityRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    call_id: int
    method: UtilityMethod
    args: list[Any] = []  # converted to the method's argument tuple, which checks them


class UtilityOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The answer to one UtilityRequest: msgpack bytes of the method's result type
    (see `pagellm.protocol.utility.SIGNATURES`), or a failure message."""

    call_id: int
    result: bytes | None = None
    failure: str | None = None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """All outputs of one engine step for one client (possibly empty: a heartbeat).

    `timestamp` is the engine's time.monotonic() when the step ended (system-wide on
    Linux, so a frontend on the same host can measure its lag). `engine_dead` is the
    engine's last message: why it stopped. `num_waiting` / `num_running` are the
    engine's load when the message left (every message, heartbeats too), and
    `num_adds_taken` how many of this client's ADDs that load accounts for (queued in
    the scheduler, or refused): a data-parallel frontend routes each new request to the
    least loaded engine core, counting the ADDs it sent beyond those as load too.

    Most of a busy step's news is one plain token per running request: those travel as
    two columns (`token_req_ids[i]` sampled `token_ids[i]`, and nothing else happened
    to it: not its first token, not finished, no logprobs) instead of an
    EngineCoreOutput each, which cost the engine core a quarter of its per-request
    update to build and encode (benchmarks/engine_overhead.py). Everything else, and
    every request's first and last token, is in `outputs`.
    """

    outputs: list[EngineCoreOutput] = []
    timestamp: float = 0.0
    utility_output: UtilityOutput | None = None
    engine_dead: str | None = None
    num_waiting: int = 0
    num_running: int = 0
    num_adds_taken: int = 0
    token_req_ids: list[str] = []
    token_ids: list[int] = []
    # How long the busy loop had been inside its current step or control call when this
    # message left (0 while it turns, idle included): a loop blocked in one call (a
    # weight transfer waiting on a trainer, a stuck extension) still heartbeats, from
    # the output thread, and this is how a frontend tells it from a healthy one.
    loop_busy_s: float = 0.0

    @property
    def has_outputs(self) -> bool:
        """Anything for the requests (not only load, a heartbeat or a utility answer)."""
        return bool(self.outputs or self.token_req_ids)

    def all_outputs(self) -> list[EngineCoreOutput]:
        """Every request's news as EngineCoreOutputs, the columns' too: one-token
        outputs, made by one list comprehension on the receiving side (where the
        output processor reads them)."""
        if not self.token_req_ids:
            return self.outputs
        return self.outputs + [EngineCoreOutput(r, [t]) for r, t in
                               zip(self.token_req_ids, self.token_ids, strict=True)]


def message_for(outputs: dict[int, EngineCoreOutputs], client: int) -> EngineCoreOutputs:
    """Client `client`'s message in a step's `outputs` (by client), added if none yet."""
    message = outputs.get(client)
    if message is None:
        message = outputs[client] = EngineCoreOutputs()
    return message


class RequestType(bytes, enum.Enum):
    """The first frame of every message a client sends to the engine core's socket;
    the second (and last) frame is the payload."""

    ADD = b"\x00"  # payload: EngineCoreRequest
    ABORT = b"\x01"  # payload: list[str] of request ids
    UTILITY = b"\x02"  # payload: UtilityRequest
    HELLO = b"\x03"  # payload: HandshakeRequest; answered by a HandshakeReply
    BYE = b"\x04"  # payload: empty; the engine aborts what the client left running


class EngineInfo(msgspec.Struct, array_like=True, gc=False):
    """What the frontend learns from the engine core once it is ready."""

    model: str
    max_model_len: int
    vocab_size: int
    block_size: int
    num_kv_blocks: int
    max_num_batched_tokens: int
    device: str
    dtype: str
    max_logprobs: int = 20
    max_num_seqs: int = 256
    world_size: int = 1  # this core's workers (tensor-parallel ranks)
    data_parallel_size: int = 1  # engine cores behind this frontend (set by the DP client)
    scheduling_policy: str = "fcfs"  # "priority" honours requests' priority
    # the reasoning parser in effect (configured, or the model family's: reasoning.py)
    reasoning_parser: str | None = None


class HandshakeRequest(msgspec.Struct, array_like=True, gc=False):
    """HELLO: a client asks to attach."""

    protocol_version: int


class HandshakeReply(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """READY (what the client needs to talk to the engine), or an error."""

    info: EngineInfo | None = None
    client_index: int | None = None
    output_endpoint: str = ""  # PULL this client's outputs here
    error: str | None = None
    # The PLAIN password of that socket (user "pagellm"); None when the engine uses
    # CURVE, whose keys admit the client instead.
    output_password: str | None = None


# What a launched engine core writes on its status pipe once it serves (until then a
# failure is a StartupFailure instead): it binds before it loads, so accepting
# connections no longer means loaded, and a headless node waits for this before it
# registers its cores. No msgpack array starts with this byte.
READY = b"\x00"


class StartupFailure(msgspec.Struct, array_like=True, gc=False):
    """Written by a locally launched engine core on its status pipe when it cannot
    start, so the frontend can name the cause."""

    message: str
    error_type: str = "RuntimeError"  # the exception's class name, e.g. "ValueError"


class DPRegister(msgspec.Struct, array_like=True, gc=False):
    """A headless node's engine cores (data parallel across nodes), sent to the
    frontend's registration socket (--data-parallel-address:--data-parallel-rpc-port):
    where the frontend attaches to each of them, by data-parallel rank."""

    protocol_version: int
    ranks: list[int]
    addresses: list[str]  # tcp://HOST:PORT, one per rank


class DPRegisterReply(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The frontend's answer to a DPRegister: accepted, or why not."""

    error: str | None = None


PROTOCOL_VERSION = 8
# The largest message an engine core takes from a client; ZeroMQ drops the connection
# of a client that sends a larger one, so clients refuse to send one (`MPClient._send`).
MAX_MESSAGE_BYTES = 64 * 2**20
MAX_CACHE_SALT_CHARS = 1024  # a salt is an opaque key (vLLM's are short tokens)
# A request id travels in every output of its request: bounded (the frontend leaves
# REQUEST_ID_SUFFIX_CHARS of it for the parts it adds: completion and prompt indices).
MAX_REQUEST_ID_CHARS = 1024
REQUEST_ID_SUFFIX_CHARS = 64
