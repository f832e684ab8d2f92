"""The token-budget scheduler (pure Python, no torch).

Every step hands out at most `max_num_batched_tokens` tokens of work. Each request
needs `num_tokens - num_computed_tokens` more tokens computed: a whole prompt, the rest
of a chunked prompt, or the one token it sampled last step. Running requests are served
first, in admission order, so decodes are never starved by arriving prompts; a prompt
larger than what is left of the budget is split across steps.

`long_prefill_token_threshold` caps one prompt's share of a step, so several long
prompts advance together instead of one after another.

A waiting request starts from its longest prefix-cache hit (the KV cache manager's
`get_computed_blocks`): those tokens count as computed and are never scheduled.

When the KV cache has no block for a running request, the running request that comes
last is preempted: its blocks are freed (their cached content stays findable until
evicted, so it usually resumes from a cache hit), its generated tokens kept, and it
goes back to the waiting queue. Under FCFS, running requests are in admission order
(the newest is preempted) and the waiting queue is in arrival order; under the
"priority" policy both follow (priority, arrival time), lower first.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass

from pagellm.enginecore.kv_cache_manager import KVCacheManager
from pagellm.enginecore.request import Request, RequestStatus
from pagellm.enginecore.request_queue import create_request_queue, sort_key
from pagellm.enginecore.spec_decode import Proposer, SpecDecodingStats
from pagellm.enginecore.structured_output.request_grammar import RequestGrammar
from pagellm.protocol.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    TokenLogprobs,
    message_for,
)
from pagellm.protocol.scheduling import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)


@dataclass(frozen=True)
class SchedulerConfig:
    """From `EngineArgs`, which checked the values; max_num_batched_tokens is settled
    by the executor (its default depends on the device)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    long_prefill_token_threshold: int = 0  # 0: a prompt may take the whole budget
    policy: str = "fcfs"
    max_loras: int = 0  # LoRA: the most distinct adapters running at once (0: none served)

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got "
                             f"{self.max_num_batched_tokens}")


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 proposer: Proposer | None = None) -> None:
        """`proposer`: speculative decoding's, which proposes tokens for each running
        request's decode step (enginecore/spec_decode.py); None: none."""
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.proposer = proposer
        self.spec_stats = SpecDecodingStats(
            proposer.k if proposer is not None else 0)
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(config.policy)
        self.running: list[Request] = []  # in policy order; preemption takes the last
        # What the model runner must forget before the next step.
        self._finished_req_ids: list[str] = []
        self._preempted_req_ids: list[str] = []
        self.num_preemptions = 0

    # -- requests in and out -------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_requests(self, request_ids: Iterable[str], reason: FinishReason,
                        keep_cached: bool = True) -> list[str]:
        """Finish (e.g. abort) requests wherever they are; returns the ids that existed.
        keep_cached=False also takes their blocks out of the prefix cache."""
        found = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.finish(reason)
            self._free(request, keep_cached)
            found.append(request_id)
        return found

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def request_ids_of(self, client_index: int) -> list[str]:
        return [r.request_id for r in self.requests.values() if r.client_index == client_index]

    def has_finished_requests(self) -> bool:
        """Finished or preempted ids the model runner has not been told about yet."""
        return bool(self._finished_req_ids or self._preempted_req_ids)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # -- one step ------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """This step's work: running requests first (`_schedule_running`), then waiting
        ones while budget and seats remain (`_schedule_waiting`)."""
        num_scheduled: dict[str, int] = {}
        cached = CachedRequestData.empty()
        new: list[NewRequestData] = []
        spec: dict[str, list[int]] = {}
        proposing = self._proposing()
        budget, preempted_now = self._schedule_running(
            self.config.max_num_batched_tokens, cached, num_scheduled, spec, proposing)
        if not preempted_now:  # admitting now would only preempt again
            budget = self._schedule_waiting(budget, new, num_scheduled)
        output = SchedulerOutput(
            scheduled_new_reqs=new,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=self.config.max_num_batched_tokens - budget,
            finished_req_ids=self._finished_req_ids,
            preempted_req_ids=self._preempted_req_ids,
            scheduled_spec_decode_tokens=spec,
            propose_drafts=proposing and self.proposer is not None
            and self.proposer.drafts_in_runner,
        )
        self._finished_req_ids = []
        self._preempted_req_ids = []
        return output

    def _proposing(self) -> bool:
        """Whether this step's decodes take proposals: speculation is on, the running
        batch is no larger than disable_by_batch_size, and there are seats to spare."""
        proposer = self.proposer
        return proposer is not None and (
            proposer.disable_by_batch_size is None
            or len(self.running) <= proposer.disable_by_batch_size) and (
            self.config.max_num_seqs > len(self.running) + len(self.waiting))

    def _schedule_running(self, budget: int, cached: CachedRequestData,
                          num_scheduled: dict[str, int], spec: dict[str, list[int]],
                          proposing: bool) -> tuple[int, bool]:
        """Schedule running requests, in order, into `cached` and `num_scheduled`,
        preempting from the tail when the KV cache is full; returns (the budget left,
        whether any request was preempted). With speculative decoding, a decode step
        also takes the request's proposed tokens (into `spec`), as far as the budget, free
        blocks and free seats allow: each proposal is one more position the runner
        samples, and a step samples at most max_num_seqs positions (what the runner's
        buffers and the sampler's memory are sized for), less one per waiting request;
        proposals never preempt anyone. A draft model also needs `lookahead` slots past
        the step (as far as free blocks allow).

        This loop runs for every running request every step, so it is kept lean:
        `_num_new_tokens` inlined, and a request's num_computed_tokens advanced as soon as
        it is scheduled (preemption only takes requests not yet scheduled this step: the
        tail, or the request itself; popping the tail ends the iteration early)."""
        threshold = self.config.long_prefill_token_threshold
        cached_ids, cached_computed, new_block_ids = (
            cached.req_ids, cached.num_computed_tokens, cached.new_block_ids)
        preempted_now = False
        running = self.running
        allocate_slots = self.kv_cache_manager.allocate_slots
        proposer = self.proposer
        propose = proposer.propose if proposer is not None and proposing else None
        lookahead = proposer.lookahead if proposer is not None else 0
        seats = self.config.max_num_seqs - len(running) - len(self.waiting)
        for request in running:
            if budget <= 0:
                break
            # Tokens still to come back (asynchronous scheduling) are inputs too: the
            # runner has them. At its max_tokens a request waits for its last one.
            placeholders = request.num_output_placeholders
            if placeholders and len(request.output_token_ids) + placeholders \
                    >= request.max_tokens:
                continue
            num_new = request.num_tokens + placeholders - request.num_computed_tokens
            drafts = None
            ahead = 0
            if propose is not None and num_new == 1 and (
                    request.grammar is None or request.grammar.takes_proposals):
                drafts = propose(request)[:seats]
                if request.grammar is not None and drafts:  # one it allows, in a row
                    drafts = request.grammar.valid_proposals(drafts)
                num_new += len(drafts)
                ahead = lookahead
            if 0 < threshold < num_new:
                num_new = threshold
            if num_new > budget:
                num_new = budget
            # Most steps a request's next tokens fit where it is (`kv_fits`, which the KV
            # cache manager keeps): no call at all, for every running request every step.
            block_ids = () if request.num_computed_tokens + num_new + ahead <= request.kv_fits \
                else allocate_slots(request, num_new, None, ahead)
            if block_ids is None and (drafts or ahead):  # no room for proposals: the token alone
                num_new, drafts = 1, None
                block_ids = () if request.num_computed_tokens + 1 <= request.kv_fits \
                    else allocate_slots(request, 1)
            while block_ids is None:
                victim = running.pop()
                self._preempt(victim)
                preempted_now = True
                if victim is request:
                    break
                block_ids = allocate_slots(request, num_new)
            if block_ids is None:
                break  # the request preempted itself; everything after it is gone too
            request_id = request.request_id
            cached_ids.append(request_id)
            cached_computed.append(request.num_computed_tokens)
            if block_ids:  # most steps add no block to most requests
                new_block_ids[request_id] = block_ids
            num_scheduled[request_id] = num_new
            if drafts and num_new > 1:  # as many as the budget left room for
                spec[request_id] = drafts = drafts[:num_new - 1]
                seats -= len(drafts)
                if seats <= 0:
                    propose = None
            request.num_computed_tokens += num_new
            if request.num_computed_tokens >= request.num_tokens + placeholders:  # samples
                request.num_output_placeholders = placeholders + 1
            budget -= num_new
        return budget, preempted_now

    def _schedule_waiting(self, budget: int, new: list[NewRequestData],
                          num_scheduled: dict[str, int]) -> int:
        """Admit waiting requests in queue order, each from its longest prefix-cache hit,
        while budget, seats (max_num_seqs) and KV blocks last; returns the budget left.
        A request whose LoRA adapter would be one more than the device's max_loras
        slots can hold in a step waits (its place in the queue kept) while those after
        it are admitted."""
        kv_cache_manager = self.kv_cache_manager
        max_loras = self.config.max_loras
        adapters = {r.lora_int_id for r in self.running if r.lora_int_id} if max_loras \
            else set()
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            lora_id = request.lora_int_id
            if lora_id and lora_id not in adapters and len(adapters) >= max_loras:
                skipped.append(self.waiting.pop())
                continue
            hits = kv_cache_manager.get_computed_blocks(request)
            num_hit_tokens = len(hits) * kv_cache_manager.block_size
            num_new = self._num_new_tokens(request, budget, num_hit_tokens)
            if kv_cache_manager.allocate_slots(request, num_new, hits) is None:
                break
            self.waiting.pop()
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens is None:  # a preempted one keeps its first count
                request.num_cached_tokens = num_hit_tokens
            if self.config.policy == "priority":
                bisect.insort(self.running, request, key=sort_key)
            else:
                self.running.append(request)
            request.status = RequestStatus.RUNNING
            new.append(NewRequestData(
                request.request_id, request.prompt_token_ids, list(request.output_token_ids),
                request.sampling_params, request.eos_token_id,
                kv_cache_manager.get_block_ids(request.request_id),
                request.num_computed_tokens, request.bad_words_token_ids,
                request.lora_int_id))
            num_scheduled[request.request_id] = num_new
            request.num_computed_tokens += num_new
            if request.num_computed_tokens >= request.num_tokens:  # the prompt's end: samples
                request.num_output_placeholders = 1
            budget -= num_new
            if lora_id:
                adapters.add(lora_id)
        for request in reversed(skipped):  # back at the head, in their order
            self.waiting.readd(request)
        return budget

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> dict[int, EngineCoreOutputs]:
        """Append sampled tokens, finish requests that stop, free their blocks. Outputs
        are grouped by the client each request came from; a plain token (not the first,
        not the last, no logprobs) goes into the message's columns.

        This runs for every request every step: what few requests use (prompt logprobs)
        is only looked at when the step has any."""
        outputs: dict[int, EngineCoreOutputs] = {}
        requests = self.requests
        check_stop = self._check_stop
        logprobs_by_request = runner_output.logprobs
        any_prompt_logprobs = bool(runner_output.prompt_logprobs)
        any_finished = False
        more = runner_output.more_token_ids
        if scheduler_output.scheduled_spec_decode_tokens:
            self._take_back_rejected(scheduler_output.scheduled_spec_decode_tokens, more)
        if self.proposer is not None and self.proposer.drafts_in_runner:
            self._keep_drafts(runner_output)
        client = -1  # the last request's client, and its message's lists:
        full: list[EngineCoreOutput] = []
        plain_ids: list[str] = []
        plain_tokens: list[int] = []
        for request_id, token_id in zip(runner_output.req_ids, runner_output.sampled_token_ids,
                                        strict=True):
            request = requests.get(request_id)
            if request is None:
                continue  # aborted meanwhile
            prompt_logprobs = (self._new_prompt_logprobs(request, runner_output)
                               if any_prompt_logprobs else None)
            if token_id < 0:  # a prompt chunk: samples nothing
                if prompt_logprobs:
                    message_for(outputs, request.client_index).outputs.append(EngineCoreOutput(
                        request_id, [], new_prompt_logprobs=prompt_logprobs))
                continue
            request.num_output_placeholders -= 1
            grammar = request.grammar
            if grammar is not None:  # structured outputs: the grammar takes the token(s)
                error = self._advance_grammar(request, grammar, token_id, more)
                if error is not None:  # this request fails, alone
                    request.finish(FinishReason.ERROR)
                    self._free(request)
                    any_finished = True
                    message_for(outputs, request.client_index).outputs.append(
                        EngineCoreOutput(request_id, [], FinishReason.ERROR, error=error))
                    continue
            if more and request_id in more:  # speculative decoding: a run of tokens
                any_finished |= self._append_run(request, [token_id, *more[request_id]],
                                                 runner_output, outputs)
                continue
            request.append_output_token_id(token_id)
            # Most tokens end nothing: one set lookup and one compare say so.
            if (token_id in request.stopping_ids
                    or len(request.output_token_ids) >= request.max_tokens
                    or (grammar is not None and grammar.terminated)):
                # Asynchronous scheduling: preempted after this step was scheduled.
                preempted = request.status == RequestStatus.PREEMPTED
                if check_stop(request):
                    any_finished = True
                    if preempted:
                        self.waiting.remove(request)
                    self._free(request)
            logprobs = logprobs_by_request.get(request_id) if logprobs_by_request else None
            if request.client_index != client:
                client = request.client_index
                message = message_for(outputs, client)
                full, plain_ids, plain_tokens = (message.outputs, message.token_req_ids,
                                                 message.token_ids)
            if (logprobs is None and prompt_logprobs is None and request.finish_reason is None
                    and len(request.output_token_ids) > 1):  # the first carries the cache hit
                plain_ids.append(request_id)
                plain_tokens.append(token_id)
                continue
            full.append(EngineCoreOutput(  # positional: the fields' order
                request_id, [token_id], request.finish_reason, request.stop_reason, None,
                [logprobs] if logprobs is not None else None, prompt_logprobs, False,
                request.num_cached_tokens or 0))
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished]
        return outputs

    def _take_back_rejected(self, spec: dict[str, list[int]], more: dict[str, list[int]]
                            ) -> None:
        """Each speculating request's rejected proposals leave `num_computed_tokens`
        (scheduled as computed, their KV is not the request's: the next step writes over
        it). The runner emitted the accepted proposals and one token more."""
        requests = self.requests
        for request_id, drafts in spec.items():
            request = requests.get(request_id)
            if request is None:
                continue  # aborted meanwhile
            accepted = len(more.get(request_id, ()))
            request.num_computed_tokens -= len(drafts) - accepted
            self.spec_stats.observe(len(drafts), accepted)

    @staticmethod
    def _advance_grammar(request: Request, grammar: RequestGrammar, token_id: int,
                         more: dict[str, list[int]]) -> str | None:
        """The grammar takes the step's token and, with speculative decoding, the rest of
        the run (accepted proposals, never completing it: `valid_proposals`, and the
        last sample); an error message if it refuses one or completes short of
        min_tokens."""
        rest = more.get(request.request_id, ()) if more else ()
        for token in (token_id, *rest):
            error = grammar.advance(token)
            if error is not None:
                return error
        emitted = len(request.output_token_ids) + 1 + len(rest)
        if grammar.terminated and emitted < request.min_tokens:
            return (f"the grammar is complete after {emitted} tokens, short of "
                    f"min_tokens={request.min_tokens}")
        return None

    def _keep_drafts(self, runner_output: ModelRunnerOutput) -> None:
        """A draft model's proposals for each request that sampled, for its next decode
        step; a request the runner drafted nothing for keeps none (older ones were made
        for an earlier position)."""
        requests, drafts = self.requests, runner_output.draft_token_ids
        for request_id, token_id in zip(runner_output.req_ids,
                                        runner_output.sampled_token_ids, strict=True):
            request = requests.get(request_id)
            if token_id >= 0 and request is not None:
                request.spec_token_ids = drafts.get(request_id, [])

    def _append_run(self, request: Request, token_ids: list[int],
                    runner_output: ModelRunnerOutput,
                    outputs: dict[int, EngineCoreOutputs]) -> bool:
        """Append a speculating request's tokens one by one, as that many steps would
        have: a stop token or max_tokens inside the run ends the request there and the
        rest is dropped. Returns whether it finished. (A grammar has taken the whole run
        already: `_advance_grammar`; only its last token can complete it.)"""
        request_id = request.request_id
        kept = 0
        complete = request.grammar is not None and request.grammar.terminated
        for token_id in token_ids:
            request.append_output_token_id(token_id)
            kept += 1
            if ((token_id in request.stopping_ids
                 or len(request.output_token_ids) >= request.max_tokens
                 or (complete and kept == len(token_ids)))
                    and self._check_stop(request)):
                self._free(request)
                break
        logprobs = None
        first = runner_output.logprobs.get(request_id) if runner_output.logprobs else None
        if first is not None:
            logprobs = [first, *runner_output.more_logprobs.get(request_id, ())][:kept]
        message_for(outputs, request.client_index).outputs.append(EngineCoreOutput(
            request_id, token_ids[:kept], request.finish_reason, request.stop_reason, None,
            logprobs, None, False, request.num_cached_tokens or 0))
        return request.finish_reason is not None

    def fail_step(self, scheduler_output: SchedulerOutput, error: str
                  ) -> dict[int, EngineCoreOutputs]:
        """The executor could not run this step: finish every request in it with
        FinishReason.ERROR. Their blocks leave the prefix cache too: a block registered
        for tokens this step was to compute may hold anything."""
        failed = [self.requests[r] for r in scheduler_output.num_scheduled_tokens
                  if r in self.requests]
        self.finish_requests([r.request_id for r in failed], FinishReason.ERROR,
                             keep_cached=False)
        outputs: dict[int, EngineCoreOutputs] = {}
        for request in failed:
            message_for(outputs, request.client_index).outputs.append(EngineCoreOutput(
                request.request_id, [], FinishReason.ERROR, error=error))
        return outputs

    # -- helpers -------------------------------------------------------------------

    @staticmethod
    def _new_prompt_logprobs(request: Request, runner_output: ModelRunnerOutput
                             ) -> list[TokenLogprobs] | None:
        """This step's prompt logprobs, minus positions already sent (a request that
        is recomputed after a preemption computes them again)."""
        chunk = runner_output.prompt_logprobs.get(request.request_id)
        if chunk is None:
            return None
        skip = max(0, request.num_prompt_logprobs_sent - chunk.start)
        new = chunk.logprobs[skip:]
        request.num_prompt_logprobs_sent = max(request.num_prompt_logprobs_sent,
                                               chunk.start + len(chunk.logprobs))
        return new or None

    def _num_new_tokens(self, request: Request, budget: int, num_hit_tokens: int = 0) -> int:
        num_new = request.num_tokens - request.num_computed_tokens - num_hit_tokens
        threshold = self.config.long_prefill_token_threshold
        if 0 < threshold < num_new:
            num_new = threshold
        return min(num_new, budget)

    def _check_stop(self, request: Request) -> bool:
        """vLLM's stop rules; EOS and stop tokens count only from min_tokens on. A
        request whose grammar is complete (it accepted a stop token) stops too."""
        params = request.sampling_params
        outputs = request.output_token_ids
        num_outputs = len(outputs)
        if num_outputs >= request.min_tokens:
            last = outputs[-1]
            if last == request.eos_token_id and not params.ignore_eos:
                request.finish(FinishReason.STOP)
                return True
            if request.stop_token_ids and last in request.stop_token_ids:
                request.finish(FinishReason.STOP, stop_reason=last)
                return True
        if request.grammar is not None and request.grammar.terminated:  # complete
            last = outputs[-1]
            request.finish(FinishReason.STOP,
                           stop_reason=last if last in request.stop_token_ids else None)
            return True
        # prompt + max_tokens <= max_model_len was checked when the request arrived.
        if num_outputs >= request.max_tokens:
            request.finish(FinishReason.LENGTH)
            return True
        return False

    def preempt_all(self) -> None:
        """Send every running request back to waiting, keeping its tokens (sleep with
        mode "keep": the KV cache is about to be freed, so they recompute on waking)."""
        while self.running:
            self._preempt(self.running.pop())

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self.num_preemptions += 1
        self.waiting.readd(request)
        self._preempted_req_ids.append(request.request_id)

    def _free(self, request: Request, keep_cached: bool = True) -> None:
        self.kv_cache_manager.free(request, keep_cached)
        del self.requests[request.request_id]
        self._finished_req_ids.append(request.request_id)

