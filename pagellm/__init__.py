"""pagellm: a fast LLM inference engine in the shape of vLLM V1.

    from pagellm import LLM, SamplingParams

The design's five parts are subpackages, imported one way (frontend -> enginecore ->
executor -> kernels, each may import protocol): `pagellm.frontend` (LLM, AsyncLLM,
tokenization, the engine-core clients, the OpenAI server, the CLI),
`pagellm.enginecore` (the step loop, the scheduler, the KV-cache manager, the
engine-core process), `pagellm.executor` (the process layer, one rank's worker, the
model), `pagellm.kernels` (Triton kernels and their torch references) and
`pagellm.protocol` (the messages both processes speak); beside them `pagellm.transport`
(ZeroMQ sockets, CURVE), `pagellm.weights` (weight updates: the sender, the trainer's
side), `pagellm.demo` (the demo model) and `pagellm.vllm` (vLLM's import tree,
which `pagellm.install_as_vllm()` makes `import vllm` resolve to, for RL frameworks).
`pagellm.inputs` and `pagellm.sampling_params` are vLLM's import paths for the prompt
forms and SamplingParams.

The names below are imported on first use (PEP 562), so `import pagellm.protocol` in
the engine-core process does not load the frontend.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pagellm.version import __version__

# name -> module that defines it
_PUBLIC = {
    "LLM": "pagellm.frontend.llm",
    "AsyncLLM": "pagellm.frontend.async_llm",
    "EngineDeadError": "pagellm.frontend.engine_client.core_client",
    "RequestOutput": "pagellm.frontend.outputs",
    "CompletionOutput": "pagellm.frontend.outputs",
    "Logprob": "pagellm.frontend.outputs",
    "PromptType": "pagellm.frontend.input_processor",
    "TextPrompt": "pagellm.frontend.input_processor",
    "TokensPrompt": "pagellm.frontend.input_processor",
    "SamplingParams": "pagellm.protocol.sampling_params",
    "RequestOutputKind": "pagellm.protocol.sampling_params",
    "StructuredOutputsParams": "pagellm.protocol.sampling_params",
    "EngineArgs": "pagellm.protocol.engine_args",
    "AsyncEngineArgs": "pagellm.protocol.engine_args",
    "install_as_vllm": "pagellm.vllm_alias",
    "LoRARequest": "pagellm.protocol.lora",
}

__all__ = ["LLM", "AsyncEngineArgs", "AsyncLLM", "CompletionOutput", "EngineArgs",
           "EngineDeadError", "LoRARequest", "Logprob",
           "PromptType", "RequestOutput", "RequestOutputKind", "SamplingParams",
           "StructuredOutputsParams", "TextPrompt", "TokensPrompt", "__version__",
           "install_as_vllm"]

if TYPE_CHECKING:
    from pagellm.frontend.async_llm import AsyncLLM
    from pagellm.frontend.engine_client.core_client import EngineDeadError
    from pagellm.frontend.input_processor import PromptType, TextPrompt, TokensPrompt
    from pagellm.frontend.llm import LLM
    from pagellm.frontend.outputs import CompletionOutput, Logprob, RequestOutput
    from pagellm.protocol.engine_args import AsyncEngineArgs, EngineArgs
    from pagellm.protocol.lora import LoRARequest
    from pagellm.protocol.sampling_params import (
        RequestOutputKind,
        SamplingParams,
        StructuredOutputsParams,
    )
    from pagellm.vllm_alias import install_as_vllm


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'pagellm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
