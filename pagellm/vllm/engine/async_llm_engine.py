"""vLLM's `vllm.engine.async_llm_engine`: in vLLM V1, `AsyncLLMEngine` is `AsyncLLM`."""

from pagellm.frontend.async_llm import AsyncLLM

AsyncLLMEngine = AsyncLLM

__all__ = ["AsyncLLMEngine"]
