"""`EngineCore`: the step loop. No sockets here, so tests and `InprocClient` drive it
directly; `EngineCoreProc` (the process wrapper) adds the I/O threads."""

from __future__ import annotations

import time
from collections import deque

from enginecore.kv_cache_manager import KVCacheManager
from enginecore.request import Request
from enginecore.scheduler import Scheduler, SchedulerConfig
from executor.executor import Executor
from protocol.engine_args import EngineArgs
from protocol.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineInfo,
    FinishReason,
)
from protocol.stats import STEP_WINDOW, EngineStats, StepTimings


class EngineCore:
    def __init__(self, args: EngineArgs) -> None:
        self.executor = Executor(args)
        model_config = self.executor.model_config
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=args.max_num_seqs,
                            max_num_batched_tokens=self.executor.max_num_batched_tokens,
                            max_model_len=model_config.max_model_len,
                            long_prefill_token_threshold=args.long_prefill_token_threshold,
                            policy=args.scheduling_policy),
            KVCacheManager(self.executor.num_kv_blocks, args.block_size,
                           args.enable_prefix_caching))
        # Requests hash their blocks only when the prefix cache can use the hashes.
        self._hash_block_size = args.block_size if args.enable_prefix_caching else None
        self.info = EngineInfo(
            model=args.model, max_model_len=model_config.max_model_len,
            vocab_size=model_config.vocab_size, block_size=args.block_size,
            num_kv_blocks=self.executor.num_kv_blocks,
            max_num_batched_tokens=self.executor.max_num_batched_tokens,
            device=str(self.executor.device), dtype=str(model_config.dtype).removeprefix("torch."),
            max_logprobs=args.max_logprobs)
        self._rejected: list[EngineCoreOutput] = []  # bad requests, reported next step
        self.recent_steps: deque[StepTimings] = deque(maxlen=STEP_WINDOW)
        self.num_steps = 0

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request; one the engine cannot serve finishes with FinishReason.ERROR
        in the next step's outputs instead of raising into the busy loop."""
        self.add_preprocessed(self.preprocess(request))

    def preprocess(self, request: EngineCoreRequest) -> Request | EngineCoreOutput:
        """Validate and hash the prompt's blocks. Touches no scheduler state, so
        `EngineCoreProc` runs it in its input thread, off the busy loop."""
        error = self._validate(request)
        if error is not None:
            return EngineCoreOutput(request.request_id, [], FinishReason.ERROR, error=error)
        return Request.from_engine_core_request(request, self._hash_block_size)

    def add_preprocessed(self, item: Request | EngineCoreOutput) -> None:
        if isinstance(item, EngineCoreOutput):
            self._rejected.append(item)
        elif item.request_id in self.scheduler.requests:
            self._rejected.append(EngineCoreOutput(
                item.request_id, [], FinishReason.ERROR,
                error=f"request id {item.request_id!r} is already in use"))
        else:
            self.scheduler.add_request(item)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, FinishReason.ABORT)

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._rejected)

    def step(self) -> EngineCoreOutputs:
        """Schedule, execute, update: one continuous-batching iteration."""
        outputs, self._rejected = self._rejected, []
        # A step with nothing to run still tells the runner which requests to forget.
        if self.scheduler.has_unfinished_requests() or self.scheduler.has_finished_requests():
            t0 = time.perf_counter()
            scheduler_output = self.scheduler.schedule()
            t1 = time.perf_counter()
            runner_output = self.executor.execute_model(scheduler_output)
            t2 = time.perf_counter()
            outputs += self.scheduler.update_from_output(scheduler_output, runner_output)
            t3 = time.perf_counter()
            self.recent_steps.append(StepTimings(
                schedule_s=t1 - t0, prepare_inputs_s=runner_output.prepare_inputs_s,
                forward_s=runner_output.forward_s, sample_s=runner_output.sample_s,
                update_s=t3 - t2))
            self.num_steps += 1
        return EngineCoreOutputs(outputs=outputs, timestamp=time.monotonic())

    def get_stats(self) -> EngineStats:
        kv = self.scheduler.kv_cache_manager
        return EngineStats(
            num_running_reqs=self.scheduler.num_running,
            num_waiting_reqs=self.scheduler.num_waiting,
            num_free_blocks=kv.num_free_blocks, num_total_blocks=kv.num_total_blocks,
            kv_cache_usage=kv.usage(), prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions, num_steps=self.num_steps,
            step_timings=mean_timings(self.recent_steps))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (e.g. after new weights); False while any request
        holds blocks."""
        return self.scheduler.kv_cache_manager.reset_prefix_cache()

    def shutdown(self) -> None:
        self.executor.shutdown()

    def _validate(self, request: EngineCoreRequest) -> str | None:
        """The engine's own checks: the frontend validates too, but a standalone engine
        core serves clients we did not write."""
        prompt = request.prompt_token_ids
        if not prompt:
            return "prompt_token_ids must not be empty"
        vocab = self.info.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            return f"prompt token ids outside the vocabulary [0, {vocab}): {bad[:5]}"
        params = request.sampling_params
        for name, ids in (("allowed_token_ids", params.allowed_token_ids),
                          ("logit_bias", list(params.logit_bias or ())),
                          ("stop_token_ids", params.stop_token_ids),
                          ("bad_words_token_ids",
                           [t for word in params.bad_words_token_ids or () for t in word])):
            bad = [t for t in ids or () if not 0 <= t < vocab]
            if bad:
                return f"{name} outside the vocabulary [0, {vocab}): {bad[:5]}"
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if asked is not None and asked > self.info.max_logprobs:
                return f"{name}={asked} is more than max_logprobs={self.info.max_logprobs}"
        max_tokens = params.max_tokens
        if max_tokens is None:
            return "sampling_params.max_tokens must be resolved before the engine core"
        if len(prompt) + max_tokens > self.info.max_model_len:
            return (f"prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) exceeds "
                    f"max_model_len ({self.info.max_model_len})")
        return None


def mean_timings(steps: deque[StepTimings]) -> StepTimings:
    n = max(len(steps), 1)
    return StepTimings(*(sum(getattr(s, f) for s in steps) / n
                         for f in StepTimings.__struct_fields__))
