"""`EngineCore`: the step loop and the utility calls' handlers. No sockets here, so
tests and `InprocClient` drive it directly; `EngineCoreProc` (the process wrapper) adds
the I/O threads. Whether it serves (pause, sleep, missing weights) is `ServingState`'s."""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from pagellm.enginecore.kv_cache_manager import KVCacheManager
from pagellm.enginecore.lora_registry import LoRARegistry
from pagellm.enginecore.request import Request, RequestStatus
from pagellm.enginecore.scheduler import Scheduler, SchedulerConfig
from pagellm.enginecore.serving_state import ServingState
from pagellm.enginecore.spec_decode import make_proposer
from pagellm.enginecore.structured_output.manager import StructuredOutputManager
from pagellm.executor.executor import StepFailed
from pagellm.executor.factory import create_executor
from pagellm.protocol.engine_args import EngineArgs
from pagellm.protocol.lora import LoRARequest
from pagellm.protocol.messages import (
    MAX_CACHE_SALT_CHARS,
    MAX_REQUEST_ID_CHARS,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineInfo,
    FinishReason,
    UtilityMethod,
    message_for,
)
from pagellm.protocol.reasoning import effective_reasoning_parser
from pagellm.protocol.sampling_params import ALL_LOGPROBS, MAX_STRINGS, check_token_ids
from pagellm.protocol.scheduling import ModelRunnerOutput, SchedulerOutput
from pagellm.protocol.stats import STEP_WINDOW, EngineStats, StepTimings
from pagellm.protocol.utility import (
    SIGNATURES,
    PauseMode,
    WeightsEffect,
    WeightUpdate,
    convert_args,
)

logger = logging.getLogger("pagellm")


class EngineCore:
    def __init__(self, args: EngineArgs, on_failure: Callable[[str], None] | None = None
                 ) -> None:
        """`on_failure` hears (from another thread) when a worker process dies between
        steps; the owner of the busy loop must then stop it."""
        self.executor = create_executor(args, on_failure)
        model_config = self.executor.model_config
        # A layer's state per request (LFM2's convolutions, Qwen3.5's linear attention)
        # is in no KV block: a cached prefix cannot restore it, so such models compute
        # every prompt whole.
        prefix_caching = args.enable_prefix_caching and not model_config.spec.has_state
        if args.enable_prefix_caching and not prefix_caching:
            logger.info("prefix caching is off: %s keeps a state per request that no KV "
                        "block holds", model_config.spec.architecture)
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=args.max_num_seqs,
                            max_num_batched_tokens=self.executor.max_num_batched_tokens,
                            long_prefill_token_threshold=args.long_prefill_token_threshold,
                            policy=args.scheduling_policy,
                            max_loras=args.max_loras if args.enable_lora else 0),
            KVCacheManager(self.executor.num_kv_blocks, args.block_size, prefix_caching,
                           sliding_window=getattr(model_config.spec, "kv_window", None)),
            None if args.speculative is None else make_proposer(
                args.speculative, self.executor.device.type))
        # Requests hash their blocks only when the prefix cache can use the hashes.
        self._hash_block_size = args.block_size if prefix_caching else None
        reasoning_parser = effective_reasoning_parser(
            args.structured_outputs("reasoning_parser", None),
            getattr(model_config.hf_config, "model_type", None),
            None if args.skip_tokenizer_init else (args.tokenizer or args.model))
        self.info = EngineInfo(
            model=args.model, max_model_len=model_config.max_model_len,
            vocab_size=model_config.vocab_size, block_size=args.block_size,
            num_kv_blocks=self.executor.num_kv_blocks,
            max_num_batched_tokens=self.executor.max_num_batched_tokens,
            device=str(self.executor.device), dtype=str(model_config.dtype).removeprefix("torch."),
            max_logprobs=args.max_logprobs, max_num_seqs=args.max_num_seqs,
            world_size=args.tensor_parallel_size, scheduling_policy=args.scheduling_policy,
            reasoning_parser=reasoning_parser)
        self.structured = StructuredOutputManager(
            None if args.skip_tokenizer_init else (args.tokenizer or args.model),
            model_config.vocab_size, args.structured_outputs("backend", "auto"),
            not args.structured_outputs("disable_any_whitespace", False), reasoning_parser,
            args.structured_outputs("enable_in_reasoning", False))
        # Outputs made outside a step (refused or aborted requests), sent with the next.
        self._outbox: dict[int, EngineCoreOutputs] = {}
        self.state = ServingState()
        self.loras = LoRARegistry(args.enable_lora, self._drained(self.executor.add_lora),
                                  self._drained(self.executor.remove_lora))
        # Scheduled steps whose outputs have not been taken yet, oldest first: (the
        # step, when scheduling began and ended, its result). With async_scheduling
        # one runs on the executor's step thread while the next is scheduled.
        self.async_scheduling = args.async_scheduling
        self._in_flight: deque[tuple[SchedulerOutput, float, float,
                                     Future[ModelRunnerOutput]]] = deque()
        self._handlers = self._utility_handlers()
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
        return Request.from_engine_core_request(request, self._hash_block_size, client_index,
                                                self.loras.key(request.lora_request))

    def add_preprocessed(self, request: Request) -> None:
        if self.state.unloaded_weights[0]:  # counted again: an in-process engine's model
            # may have loaded them by its own load_weights, which no utility call saw
            self.state.count_unloaded(self.executor.unloaded_weights())
        if self.state.refuses_requests():
            self._reject(request.client_index, request.request_id,
                         self.state.refusal(self.executor.sleeping), unavailable=True)
            return
        if request.request_id in self.scheduler.requests or \
                self.structured.pending(request.request_id) is not None:
            self._reject(request.client_index, request.request_id,  # two frontends, or
                         f"request id {request.request_id!r} is already in use")  # a foreign
            return  # client
        if request.lora_request is not None:  # its adapter, added to the workers now
            try:
                key = self.loras.ensure(request.lora_request)
            except ValueError as e:
                self._reject(request.client_index, request.request_id,
                             f"LoRA adapter {request.lora_request.lora_name!r}: {e}")
                return
            if key != request.lora_key:  # replaced since it was hashed
                request.rehash(key)
        if request.status == RequestStatus.WAITING_FOR_FSM:  # its grammar compiles first
            try:
                self.structured.submit(request)
            except ValueError as e:
                self._reject(request.client_index, request.request_id, str(e))
            return
        self.scheduler.add_request(request)

    def _admit_compiled(self) -> None:
        """Constrained requests whose grammar is ready join the scheduler's queue; those
        whose grammar failed (or timed out) finish with its error."""
        for request, error in self.structured.take_ready():
            if error is not None:
                self._reject(request.client_index, request.request_id, error)
            else:
                request.status = RequestStatus.WAITING
                self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str], client_index: int | None = None) -> None:
        """Abort requests; with a client_index, only those that client sent."""
        if client_index is not None:
            requests = self.scheduler.requests
            owned = [requests.get(r) or self.structured.pending(r) for r in request_ids]
            request_ids = [r.request_id for r in owned
                           if r is not None and r.client_index == client_index]
        self.structured.cancel(request_ids)
        self.scheduler.finish_requests(request_ids, FinishReason.ABORT)

    def abort_client(self, client_index: int) -> None:
        """A frontend left: abort everything it left running."""
        self.structured.cancel([r.request_id for r in self.structured.pending_requests()
                                if r.client_index == client_index])
        self.scheduler.finish_requests(self.scheduler.request_ids_of(client_index),
                                       FinishReason.ABORT)

    def has_work(self) -> bool:
        return bool(self._outbox) or self.structured.has_ready() or bool(self._in_flight) \
            or self._schedules()

    def _schedules(self) -> bool:
        """Whether a step would be scheduled now: serving, with requests to run or
        finished ones the runner must forget."""
        scheduler = self.scheduler
        return self.state.schedules() and (scheduler.has_unfinished_requests()
                                           or scheduler.has_finished_requests())

    @property
    def num_waiting(self) -> int:
        """Requests not running yet: queued, or waiting for their grammar."""
        return self.scheduler.num_waiting + self.structured.num_pending

    def wait_for_grammars(self, timeout: float) -> None:
        """With nothing else to do but grammars compiling: wait for one (an in-process
        engine's caller would otherwise spin)."""
        if self.structured.num_pending and not self.has_work():
            self.structured.wait(timeout)

    def step(self) -> dict[int, EngineCoreOutputs]:
        """Schedule, execute, update: one continuous-batching iteration. Outputs are
        grouped by client (0 for an in-process engine).

        With async_scheduling the step scheduled here runs on the executor's thread
        while this returns and the next call schedules the one after (its sampled
        tokens feed that one in the worker: `Request.num_output_placeholders`); a step's
        outputs come back with the call after the one that scheduled it. A step whose
        scheduling needs the tokens of the one in flight (proposals, grammars) waits
        for them first."""
        if self.structured.has_ready():
            self._admit_compiled()
        outputs, self._outbox = self._outbox, {}
        if self._in_flight and not self._overlaps():
            self._finish(outputs)
        overlapped = False
        # A step with nothing to run still tells the runner which requests to forget.
        if self._schedules():
            t0 = time.perf_counter()
            scheduler_output = self.scheduler.schedule()
            if self.structured.active:  # the constrained requests that sample now
                scheduler_output.grammar = self.structured.bitmask(
                    self._sampling(scheduler_output),
                    scheduler_output.scheduled_spec_decode_tokens)
            self._in_flight.append((scheduler_output, t0, time.perf_counter(),
                                    self._submit(scheduler_output)))
            overlapped = self.async_scheduling and not scheduler_output.is_empty
        while len(self._in_flight) > overlapped:
            self._finish(outputs)
        return _stamped(outputs)

    def _overlaps(self) -> bool:
        """Whether the next step may be scheduled before the one in flight returns: not
        while its tokens decide the next step's proposals or grammar masks."""
        return self.scheduler.proposer is None and not self.structured.active

    def _submit(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        if self.async_scheduling:
            return self.executor.execute_model_async(scheduler_output)
        done: Future[ModelRunnerOutput] = Future()
        try:
            done.set_result(self.executor.execute_model(scheduler_output))
        except StepFailed as e:
            done.set_exception(e)
        return done

    def _finish(self, outputs: dict[int, EngineCoreOutputs]) -> None:
        """Take the oldest step's result into `outputs`. A step that failed fails its
        requests (the engine goes on); once nothing is in flight the runner forgets
        them."""
        scheduler_output, t0, t1, future = self._in_flight.popleft()
        try:
            runner_output = future.result()
        except StepFailed as e:
            _merge(outputs, self.scheduler.fail_step(scheduler_output, str(e)))
            self._drain(outputs)
            self.executor.retain_requests({r.request_id for r in self.scheduler.running})
            return
        t2 = time.perf_counter()
        _merge(outputs, self.scheduler.update_from_output(scheduler_output, runner_output))
        t3 = time.perf_counter()
        self.recent_steps.append(StepTimings(
            schedule_s=t1 - t0, prepare_inputs_s=runner_output.prepare_inputs_s,
            forward_s=runner_output.forward_s, sample_s=runner_output.sample_s,
            update_s=t3 - t2, collective_s=runner_output.collective_s,
            dispatch_s=runner_output.dispatch_s,
            attention_plan_s=runner_output.attention_plan_s))
        self.num_steps += 1

    def _drain(self, outputs: dict[int, EngineCoreOutputs] | None = None) -> None:
        """Wait for every step in flight, their outputs into `outputs` (by default the
        outbox, sent with the next step's): before any other call reaches the executor,
        which runs one thing at a time."""
        while self._in_flight:
            self._finish(self._outbox if outputs is None else outputs)

    def _drained(self, call: Callable[..., Any]) -> Callable[..., Any]:
        """`call`, made to wait for the steps in flight first (it reaches the
        executor from outside a step: LoRA adapters, a deferred utility call's end)."""
        def after_drain(*args: Any) -> Any:
            self._drain()
            return call(*args)
        return after_drain

    def _sampling(self, scheduler_output: SchedulerOutput) -> list[Request]:
        """The step's constrained requests that sample a token in it (not a prompt
        chunk short of the end)."""
        requests = self.scheduler.requests
        return [r for r in map(requests.__getitem__, scheduler_output.num_scheduled_tokens)
                if r.grammar is not None and r.num_computed_tokens >= r.num_tokens]

    def get_stats(self) -> EngineStats:
        kv = self.scheduler.kv_cache_manager
        spec = self.scheduler.spec_stats
        return EngineStats(
            num_running_reqs=self.scheduler.num_running,
            num_waiting_reqs=self.num_waiting,
            num_free_blocks=kv.num_free_blocks, num_total_blocks=kv.num_total_blocks,
            kv_cache_usage=kv.usage(), prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions, num_steps=self.num_steps,
            step_timings=mean_timings(self.recent_steps), spec_num_drafts=spec.num_drafts,
            spec_num_draft_tokens=spec.num_draft_tokens,
            spec_num_accepted_tokens=spec.num_accepted_tokens,
            spec_accepted_per_pos=list(spec.accepted_per_pos))

    # -- utility calls: one handler per row of protocol/utility.py's SIGNATURES -------

    def call_utility(self, method: UtilityMethod, args: list[Any]) -> Any:
        """Run one utility call (arguments converted and checked against the method's
        signature; what else applies, its row says). A call that completes later (a
        sleep or pause in mode "wait", an init_weight_transfer_engine joining the
        trainer) returns a `Deferred`: the caller keeps stepping the engine until its
        `ready()`, then calls its `finish()` for the result."""
        a = convert_args(method, args)
        row = SIGNATURES[method]
        self._drain()
        if row.refused_asleep and self.executor.sleeping:
            raise RuntimeError(f"cannot {method.name.lower()}: "
                               f"{self.state.describe(self.executor.sleeping)}; "
                               f"call wake_up() first")
        handler = self._handlers[method]
        if row.weights is WeightsEffect.MAY_EMPTY or (
                row.weights is WeightsEffect.MAY_LOAD and self.state.unloaded_weights[0]):
            try:
                return handler(*a)
            finally:
                self.state.count_unloaded(self.executor.unloaded_weights())
        return handler(*a)

    def _utility_handlers(self) -> dict[UtilityMethod, Callable[..., Any]]:
        """Each call's handler, called with its converted arguments. Built once; the
        closed `UtilityMethod` set is what a client can name."""
        m = UtilityMethod
        return {
            m.GET_STATS: self.get_stats, m.RESET_PREFIX_CACHE: self.reset_prefix_cache,
            m.SLEEP: self.sleep, m.WAKE_UP: self.wake_up, m.IS_SLEEPING: self.is_sleeping,
            m.PAUSE: self.pause, m.RESUME: self.resume, m.IS_PAUSED: self.state.is_paused,
            m.COLLECTIVE_RPC: self.executor.collective_rpc,
            m.UPDATE_WEIGHTS: self.update_weights,
            m.INIT_WEIGHT_TRANSFER_ENGINE: self.init_weight_transfer_engine,
            m.START_WEIGHT_UPDATE: self.state.start_weight_update,
            m.FINISH_WEIGHT_UPDATE: self.finish_weight_update,
            m.ADD_LORA: self.add_lora, m.REMOVE_LORA: self.remove_lora,
            m.LIST_LORAS: self.loras.ids,
        }

    # LoRA adapters (vLLM's add_lora / remove_lora / list_loras).

    def add_lora(self, lora: LoRARequest, peft_config: dict[str, Any] | None = None,
                 tensors: WeightUpdate | None = None) -> bool:
        """Add (or with load_inplace replace) an adapter before any request names it:
        from its directory, or from `tensors` with its `peft_config`; raises ValueError
        naming what is wrong with it."""
        if tensors is None:
            self.loras.ensure(lora)
        else:
            self.loras.add_tensors(lora, peft_config, tensors)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter; False if unknown. Requests using it must have finished
        (a running one would name an adapter its workers no longer hold)."""
        users = [r.request_id for r in self.scheduler.requests.values()
                 if r.lora_int_id == lora_int_id]
        if users:
            raise ValueError(f"LoRA adapter {lora_int_id} is in use by {len(users)} "
                             f"request(s), e.g. {users[0]!r}")
        return self.loras.remove(lora_int_id)

    # Pause and sleep: vLLM's semantics (the RL rollout loop).

    def pause(self, mode: PauseMode, clear_cache: bool = False) -> Deferred:
        """Stop scheduling. "abort": in-flight requests finish now with reason abort;
        "wait": they run to the end first (answered once `pause_settled()`); "keep":
        they stay where they are until `resume()`. New requests fail, except in "keep"
        mode, where they wait for the resume. `clear_cache` (vLLM's): once settled, the
        prefix cache is reset as `reset_prefix_cache(reset_running_requests=True)` does,
        so a weight update that follows finds no KV of the old weights to reuse."""
        if mode == "abort":
            pending = self.structured.cancel([r.request_id
                                              for r in self.structured.pending_requests()])
            for request in [*self.scheduler.requests.values(), *pending]:
                message_for(self._outbox, request.client_index).outputs.append(
                    EngineCoreOutput(request.request_id, [], FinishReason.ABORT))
            self.scheduler.finish_requests(list(self.scheduler.requests), FinishReason.ABORT)
        self.state.pause(mode)
        return Deferred(self._drained(lambda: self._settle_pause(clear_cache)),
                        self.pause_settled)

    def _settle_pause(self, clear_cache: bool) -> None:
        self.state.check_still_paused()
        if clear_cache:
            self.reset_prefix_cache(reset_running_requests=True)

    def pause_settled(self) -> bool:
        """True once nothing runs that a pause in mode "wait" waits for."""
        return self.state.paused != "wait" or not (
            self.scheduler.has_unfinished_requests() or self.structured.num_pending)

    def resume(self) -> None:
        """Schedule again (`call_utility` refuses it while memory sleeps: its row)."""
        self.state.resume()

    def sleep(self, level: int, mode: PauseMode) -> Deferred:
        """Pause in `mode`, then (level >= 1, once the pause has settled) free memory
        and the prefix cache."""
        if level > 0 and not self.executor.enable_sleep_mode:
            raise RuntimeError("sleep levels 1 and 2 need the engine started with "
                               "enable_sleep_mode=True")
        self.pause(mode)
        self.state.sleep_level = max(self.state.sleep_level, level)
        return Deferred(self._drained(lambda: self._finish_sleep(level)), self.pause_settled)

    def _finish_sleep(self, level: int) -> None:
        """The memory half of `sleep`, once `pause_settled()`."""
        self.state.check_still_paused()
        if level == 0:
            return
        self.scheduler.preempt_all()  # mode "keep": they recompute after waking
        self.scheduler.kv_cache_manager.forget_cached()
        self.executor.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Allocate the named memory again (None: everything, and scheduling); the
        scheduler resumes once nothing is asleep. True when fully awake."""
        memory_tags = ["weights", "kv_cache"] if tags is None else \
            [t for t in tags if t != "scheduling"]
        self.executor.wake_up(memory_tags)
        if self.state.paused is not None and not self.executor.sleeping and (
                tags is None or "scheduling" in tags or self.state.sleep_level > 0):
            self.resume()
        return self.state.paused is None

    def is_sleeping(self) -> bool:
        """vLLM's meaning: paused (any level, level 0 included) or memory asleep."""
        return self.state.paused is not None or bool(self.executor.sleeping)

    # Weights and the prefix cache.

    def update_weights(self, update: WeightUpdate) -> int:
        """Load new weights (all checked before the first copy); cached prefixes are
        forgotten (their KV came from the old weights). Returns the tensors loaded."""
        loaded = self.executor.update_weights(update)
        self.scheduler.kv_cache_manager.forget_cached()
        return loaded

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> Deferred:
        """The join waits for the trainer off the loop: steps go on meanwhile."""
        self.executor.init_weight_transfer_engine(init_info)
        return Deferred(lambda: None, self._drained(self.executor.weight_transfer_joined))

    def finish_weight_update(self, weight_version: str | None) -> None:
        self.state.finish_weight_update(weight_version)
        self.scheduler.kv_cache_manager.forget_cached()

    def reset_prefix_cache(self, reset_running_requests: bool = False,
                           reset_connector: bool = False) -> bool:
        """Forget every cached prefix (e.g. after new weights); vLLM's semantics. False,
        changing nothing, while any request holds blocks, unless
        `reset_running_requests` first preempts every running request (it keeps its
        tokens and recomputes its KV when next scheduled). pagellm has no KV connector:
        `reset_connector=True` resets the local cache all the same and answers False
        with a warning, as vLLM does without one."""
        if reset_running_requests:
            self.scheduler.preempt_all()
        reset = self.scheduler.kv_cache_manager.reset_prefix_cache()
        if reset_running_requests and not reset:  # nothing else holds blocks: a bug
            raise RuntimeError("the prefix cache could not be reset although every "
                               "running request was preempted")
        if reset_connector:
            logger.warning("reset_prefix_cache(reset_connector=True): no KV connector is "
                           "configured; answering False")
            return False
        return reset

    def shutdown(self) -> None:
        self.structured.shutdown()
        for *_, future in self._in_flight:  # let it end; its outputs go nowhere now
            future.exception()
        self._in_flight.clear()
        self.executor.shutdown()

    def _reject(self, client_index: int, request_id: str, error: str,
                unavailable: bool = False) -> None:
        message_for(self._outbox, client_index).outputs.append(EngineCoreOutput(
            request_id, [], FinishReason.ERROR, error=error, unavailable=unavailable))

    def _validate(self, request: EngineCoreRequest) -> str | None:
        """What the engine checks itself although the frontend did: a standalone engine
        core also serves clients we did not write, so every value that reaches an
        array, a tensor index or an allocation is bounded here (SamplingParams has
        checked its own ranges when it was decoded)."""
        if not request.request_id:
            return "request_id must not be empty"
        if len(request.request_id) > MAX_REQUEST_ID_CHARS:
            return f"request_id is longer than {MAX_REQUEST_ID_CHARS} characters"
        if request.cache_salt is not None and len(request.cache_salt) > MAX_CACHE_SALT_CHARS:
            return f"cache_salt is longer than {MAX_CACHE_SALT_CHARS} characters"
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
        if ALL_LOGPROBS in (params.logprobs, params.prompt_logprobs):
            return ("sampling_params logprobs / prompt_logprobs -1 must be resolved to the "
                    "vocabulary size before the engine core")
        if len(prompt) + max_tokens > self.info.max_model_len:
            return (f"prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) exceeds "
                    f"max_model_len ({self.info.max_model_len})")
        return None


class Deferred:
    """A utility call's result that comes later. `ready()` (cheap, polled by the loop's
    owner between steps; it may raise the call's failure) says when; `finish()` then
    gives the result."""

    def __init__(self, finish: Callable[[], Any], ready: Callable[[], bool]) -> None:
        self.finish = finish
        self.ready = ready


class RequestRejected(ValueError):
    """A request the engine cannot serve; the message says why."""


def _merge(into: dict[int, EngineCoreOutputs], more: dict[int, EngineCoreOutputs]) -> None:
    for client, message in more.items():
        mine = into.get(client)
        if mine is None:
            into[client] = message
        else:
            mine.outputs += message.outputs
            mine.token_req_ids += message.token_req_ids
            mine.token_ids += message.token_ids


def _stamped(outputs: dict[int, EngineCoreOutputs]) -> dict[int, EngineCoreOutputs]:
    now = time.monotonic()
    for message in outputs.values():
        message.timestamp = now
    return outputs


def mean_timings(steps: deque[StepTimings]) -> StepTimings:
    n = max(len(steps), 1)
    return StepTimings(*(sum(getattr(s, f) for s in steps) / n
                         for f in StepTimings.__struct_fields__))
