"""vLLM's `vllm.distributed`: the weight-transfer helpers trainers import."""
