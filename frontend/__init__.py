"""pagellm's frontend: `LLM` for scripts, the engine-core clients, tokenization and
output processing. Text lives here; token ids, KV blocks and tensors live in the
engine core."""

from frontend.async_llm import AsyncLLM
from frontend.core_client import EngineDeadError
from frontend.llm import LLM
from frontend.outputs import CompletionOutput, Logprob, RequestOutput
from protocol.engine_args import EngineArgs
from protocol.sampling_params import RequestOutputKind, SamplingParams

__all__ = [
    "LLM",
    "AsyncLLM",
    "CompletionOutput",
    "EngineArgs",
    "EngineDeadError",
    "Logprob",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
]
