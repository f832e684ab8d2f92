"""vLLM's `vllm.lora`."""
