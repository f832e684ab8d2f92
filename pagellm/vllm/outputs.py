"""vLLM's `vllm.outputs`."""

from pagellm.frontend.outputs import CompletionOutput, Logprob, RequestOutput

__all__ = ["CompletionOutput", "Logprob", "RequestOutput"]
