"""vLLM's `vllm.distributed.weight_transfer`."""
