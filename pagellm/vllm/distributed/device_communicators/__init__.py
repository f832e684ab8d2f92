"""vLLM's `vllm.distributed.device_communicators`."""
