"""vLLM's `vllm.engine`."""
