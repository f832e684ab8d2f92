"""vLLM's `vllm.sampling_params`."""

from pagellm.protocol.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)

__all__ = ["RequestOutputKind", "SamplingParams", "StructuredOutputsParams"]
