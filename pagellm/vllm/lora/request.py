"""vLLM's `vllm.lora.request`: `LoRARequest`."""

from pagellm.protocol.lora import LoRARequest

__all__ = ["LoRARequest"]
