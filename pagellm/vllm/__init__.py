"""vLLM's import tree, made of pagellm's classes: what `import vllm` resolves to after
`pagellm.install_as_vllm()` (pagellm/vllm_alias.py), and importable as `pagellm.vllm`
without the alias.

Each module here is one vLLM module an RL framework imports (TRL 1.16, OpenRLHF 0.11,
verl 0.9), holding the names they use, with vLLM's semantics. Nothing here is a stub:
a vLLM module or name pagellm does not serve is absent, so its import fails at once,
naming it. The top-level names load on first use (PEP 562): an engine process that
imports `vllm.utils` does not load the frontend.
"""

from __future__ import annotations

import importlib
from typing import Any

from pagellm.vllm_alias import VLLM_API_VERSION

__version__ = VLLM_API_VERSION

# name -> module that defines it
_PUBLIC = {
    "LLM": "pagellm.frontend.llm",
    "AsyncLLMEngine": "pagellm.vllm.engine.async_llm_engine",
    "EngineArgs": "pagellm.protocol.engine_args",
    "AsyncEngineArgs": "pagellm.protocol.engine_args",
    "SamplingParams": "pagellm.protocol.sampling_params",
    "RequestOutput": "pagellm.frontend.outputs",
    "CompletionOutput": "pagellm.frontend.outputs",
    "PromptType": "pagellm.frontend.input_processor",
    "TextPrompt": "pagellm.frontend.input_processor",
    "TokensPrompt": "pagellm.frontend.input_processor",
}

__all__ = [*_PUBLIC, "__version__"]


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'vllm' (pagellm's vLLM API) has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
