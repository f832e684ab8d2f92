"""pagellm's frontend: `LLM` for scripts, the engine-core clients, tokenization and
output processing. Text lives here; token ids, KV blocks and tensors live in the
engine core."""

from frontend.llm import LLM
from frontend.outputs import CompletionOutput, RequestOutput
from protocol.engine_args import EngineArgs
from protocol.sampling_params import RequestOutputKind, SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineArgs",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
]
