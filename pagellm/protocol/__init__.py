"""Messages and configuration shared by the frontend and the engine core.

No torch and no zmq here: both processes import this package, and so may anything
that only wants to speak the protocol.
"""

from pagellm.protocol.codec import MsgpackDecoder, MsgpackEncoder
from pagellm.protocol.engine_args import EngineArgs
from pagellm.protocol.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
)
from pagellm.protocol.sampling_params import RequestOutputKind, SamplingParams
from pagellm.protocol.scheduling import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from pagellm.protocol.stats import EngineStats, StepTimings

__all__ = [
    "CachedRequestData",
    "EngineArgs",
    "EngineCoreOutput",
    "EngineCoreOutputs",
    "EngineCoreRequest",
    "EngineStats",
    "FinishReason",
    "ModelRunnerOutput",
    "MsgpackDecoder",
    "MsgpackEncoder",
    "NewRequestData",
    "RequestOutputKind",
    "SamplingParams",
    "SchedulerOutput",
    "StepTimings",
]
