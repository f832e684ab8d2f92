"""vLLM's `vllm.distributed.weight_transfer.packed_tensor`: the packed broadcast (many
tensors per collective), vLLM's wire format."""

from pagellm.weights.packed import (
    DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    DEFAULT_PACKED_NUM_BUFFERS,
    packed_nccl_broadcast_consumer,
    packed_nccl_broadcast_producer,
)

__all__ = ["DEFAULT_PACKED_BUFFER_SIZE_BYTES", "DEFAULT_PACKED_NUM_BUFFERS",
           "packed_nccl_broadcast_consumer", "packed_nccl_broadcast_producer"]
