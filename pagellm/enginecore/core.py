"""`EngineCore`: the step loop. No sockets here, so tests and `InprocClient` drive it
directly; `EngineCoreProc` (the process wrapper) adds the I/O threads."""

from __future__ import annotations

import math
import time
from collections import deque

from pagellm.enginecore.kv_cache_manager import KVCacheManager
from pagellm.enginecore.request import Request
from pagellm.enginecore.scheduler import Scheduler, SchedulerConfig
from pagellm.executor.executor import Executor, StepFailed
from pagellm.protocol.engine_args import EngineArgs
from pagellm.protocol.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineInfo,
    FinishReason,
)
from pagellm.protocol.sampling_params import MAX_STRINGS, check_token_ids
from pagellm.protocol.stats import STEP_WINDOW, EngineStats, StepTimings


class EngineCore:
    def __init__(self, args: EngineArgs) -> None:
        self.executor = Executor(args)
        model_config = self.executor.model_config
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=args.max_num_seqs,
                            max_num_batched_tokens=self.executor.max_num_batched_tokens,
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
            max_logprobs=args.max_logprobs, max_num_seqs=args.max_num_seqs)
        # Requests refused before they reached the scheduler, reported next step.
        self._rejected: dict[int, list[EngineCoreOutput]] = {}
        self.recent_steps: deque[StepTimings] = deque(maxlen=STEP_WINDOW)
        self.num_steps = 0

    def add_request(self, request: EngineCoreRequest, client_index: int = 0) -> None:
        """Queue a request; one the engine cannot serve finishes with FinishReason.ERROR
        in the next step's outputs instead of raising into the busy loop."""
        try:
            self.add_preprocessed(self.preprocess(request, client_index))
        except RequestRejected as e:
            self._reject(client_index, request.request_id, str(e))

    def preprocess(self, request: EngineCoreRequest, client_index: int = 0) -> Request:
        """Validate and hash the prompt's blocks (RequestRejected names what is wrong).
        Touches no scheduler state, so `EngineCoreProc` runs it in its input thread,
        off the busy loop."""
        error = self._validate(request)
        if error is not None:
            raise RequestRejected(error)
        return Request.from_engine_core_request(request, self._hash_block_size, client_index)

    def add_preprocessed(self, request: Request) -> None:
        try:
            self.scheduler.add_request(request)
        except ValueError as e:  # the id is in use (two frontends, or a foreign client)
            self._reject(request.client_index, request.request_id, str(e))

    def abort_requests(self, request_ids: list[str], client_index: int | None = None) -> None:
        """Abort requests; with a client_index, only those that client sent."""
        if client_index is not None:
            requests = self.scheduler.requests
            request_ids = [r for r in request_ids
                           if r in requests and requests[r].client_index == client_index]
        self.scheduler.finish_requests(request_ids, FinishReason.ABORT)

    def abort_client(self, client_index: int) -> None:
        """A frontend left: abort everything it left running."""
        self.scheduler.finish_requests(self.scheduler.request_ids_of(client_index),
                                       FinishReason.ABORT)

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._rejected)

    def step(self) -> dict[int, EngineCoreOutputs]:
        """Schedule, execute, update: one continuous-batching iteration. Outputs are
        grouped by client (0 for an in-process engine)."""
        outputs, self._rejected = self._rejected, {}
        # A step with nothing to run still tells the runner which requests to forget.
        if self.scheduler.has_unfinished_requests() or self.scheduler.has_finished_requests():
            t0 = time.perf_counter()
            scheduler_output = self.scheduler.schedule()
            t1 = time.perf_counter()
            try:
                runner_output = self.executor.execute_model(scheduler_output)
            except StepFailed as e:  # the step's requests fail; the engine goes on
                _merge(outputs, self.scheduler.fail_step(scheduler_output, str(e)))
                self.executor.retain_requests({r.request_id for r in self.scheduler.running})
                return _by_client(outputs)
            t2 = time.perf_counter()
            _merge(outputs, self.scheduler.update_from_output(scheduler_output, runner_output))
            t3 = time.perf_counter()
            self.recent_steps.append(StepTimings(
                schedule_s=t1 - t0, prepare_inputs_s=runner_output.prepare_inputs_s,
                forward_s=runner_output.forward_s, sample_s=runner_output.sample_s,
                update_s=t3 - t2))
            self.num_steps += 1
        return _by_client(outputs)

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

    def _reject(self, client_index: int, request_id: str, error: str) -> None:
        self._rejected.setdefault(client_index, []).append(
            EngineCoreOutput(request_id, [], FinishReason.ERROR, error=error))

    def _validate(self, request: EngineCoreRequest) -> str | None:
        """What the engine checks itself although the frontend did: a standalone engine
        core also serves clients we did not write, so every value that reaches an
        array, a tensor index or an allocation is bounded here (SamplingParams has
        checked its own ranges when it was decoded)."""
        if not request.request_id:
            return "request_id must not be empty"
        prompt = request.prompt_token_ids
        if not prompt:
            return "prompt_token_ids must not be empty"
        vocab = self.info.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            return f"prompt token ids outside the vocabulary [0, {vocab}): {bad[:5]}"
        if request.eos_token_id is not None and not 0 <= request.eos_token_id < vocab:
            return f"eos_token_id={request.eos_token_id} is outside the vocabulary [0, {vocab})"
        if not math.isfinite(request.arrival_time):
            return f"arrival_time must be a finite number, got {request.arrival_time}"
        params = request.sampling_params
        if params.n != 1:
            return f"n must be 1 in an engine-core request (the frontend sends one request " \
                   f"per completion), got {params.n}"
        words = request.bad_words_token_ids or []
        try:
            params.check_against_model(vocab, self.info.max_logprobs)
            if len(words) > 2 * MAX_STRINGS:  # the frontend makes two per bad word
                raise ValueError(f"bad_words_token_ids has {len(words)} sequences, more "
                                 f"than {2 * MAX_STRINGS}")
            for word in words:
                if not word:
                    raise ValueError("bad_words_token_ids entries must not be empty")
                check_token_ids("bad_words_token_ids entry", word, vocab)
        except ValueError as e:
            return str(e)
        max_tokens = params.max_tokens
        if max_tokens is None:
            return "sampling_params.max_tokens must be resolved before the engine core"
        if len(prompt) + max_tokens > self.info.max_model_len:
            return (f"prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) exceeds "
                    f"max_model_len ({self.info.max_model_len})")
        return None


class RequestRejected(ValueError):
    """A request the engine cannot serve; the message says why."""


def _merge(into: dict[int, list[EngineCoreOutput]], more: dict[int, list[EngineCoreOutput]]
           ) -> None:
    for client, outputs in more.items():
        into.setdefault(client, []).extend(outputs)


def _by_client(outputs: dict[int, list[EngineCoreOutput]]) -> dict[int, EngineCoreOutputs]:
    now = time.monotonic()
    return {client: EngineCoreOutputs(outs, now) for client, outs in outputs.items()}


def mean_timings(steps: deque[StepTimings]) -> StepTimings:
    n = max(len(steps), 1)
    return StepTimings(*(sum(getattr(s, f) for s in steps) / n
                         for f in StepTimings.__struct_fields__))
