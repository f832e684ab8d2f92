"""vLLM's `vllm.sampling_params`, where scripts written for vLLM import from
(`from pagellm.sampling_params import SamplingParams`)."""

from pagellm.protocol.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)

__all__ = ["RequestOutputKind", "SamplingParams", "StructuredOutputsParams"]
