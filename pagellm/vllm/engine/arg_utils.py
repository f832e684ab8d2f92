"""vLLM's `vllm.engine.arg_utils`: one dataclass of options serves both (vLLM's async
one adds request logging, which pagellm does not do)."""

from pagellm.protocol.engine_args import AsyncEngineArgs, EngineArgs

__all__ = ["AsyncEngineArgs", "EngineArgs"]
