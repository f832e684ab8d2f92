"""Engine statistics, returned by `get_stats()` on every client."""

from __future__ import annotations

import msgspec


class StepTimings(msgspec.Struct, array_like=True, gc=False):
    """Seconds spent in each phase of one engine step."""

    schedule_s: float = 0.0
    prepare_inputs_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    update_s: float = 0.0
    output_s: float = 0.0  # the busy loop handing out the step's outputs (encode, send)
    collective_s: float = 0.0  # part of forward_s + sample_s (tensor parallel, CPU only)
    dispatch_s: float = 0.0  # sending the step to the worker processes and back
    # Part of prepare_inputs_s: the attention backend's per-step plan (on the CPU, the
    # reference kernels' gather indices and masks, shared by every layer).
    attention_plan_s: float = 0.0


class EngineStats(msgspec.Struct, array_like=True, gc=False):
    """A snapshot of the engine core. `step_timings` is the mean over the last
    `STEP_WINDOW` steps (output_s: a moving mean over the last steps' outputs)."""

    num_running_reqs: int
    num_waiting_reqs: int
    num_free_blocks: int
    num_total_blocks: int
    kv_cache_usage: float  # fraction of blocks held by requests, 0..1
    prefix_cache_queries: int  # tokens looked up in the prefix cache, cumulative
    prefix_cache_hits: int  # tokens found there, cumulative
    num_preemptions: int  # cumulative
    num_steps: int  # cumulative
    step_timings: StepTimings
    # With data parallelism: each engine core's own stats, in rank order (the fields
    # above are then their sums; kv_cache_usage and step_timings their means).
    per_engine: list[EngineStats] = []
    # Speculative decoding, cumulative (vLLM's vllm:spec_decode_*): verification runs,
    # tokens proposed and accepted, and accepted per position (all 0 without it).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = []


STEP_WINDOW = 64
