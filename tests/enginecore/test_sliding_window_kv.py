"""Sliding-window KV blocks (`KVCacheManager(sliding_window=W)`), driven without a model.

A query at position p sees the keys p - W < j <= p, so once a request's step computes
from position s, its blocks ending at or before s - W can never be read by it again: they
go back to the pool (findable by their hashes until evicted) and `null_block` keeps their
place in the request's block list.

`KVRunner` stands in for the model runner and checks the protocol end to end: it builds
each request's block table from the `SchedulerOutput`s alone (as `InputBatch` does, stale
ids of released blocks and all), writes each computed position's KV (a fingerprint of
the tokens up to it) into its slot, then lets every query read back every key its window
shows. A block released while still visible, or handed to two requests at once, reads
back the wrong fingerprint. Every expected number below is computed by hand, for
block_size 4 and a window of 8 tokens (two blocks) unless a test says otherwise.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from pagellm.enginecore.block_pool import KVCacheBlock
from pagellm.enginecore.kv_cache_manager import KVCacheManager
from pagellm.enginecore.request import Request
from pagellm.enginecore.scheduler import Scheduler, SchedulerConfig
from pagellm.protocol.messages import FinishReason
from pagellm.protocol.sampling_params import SamplingParams
from pagellm.protocol.scheduling import ModelRunnerOutput, SchedulerOutput

# Our code and torch alone: the floors leg skips it (.ci/run).
pytestmark = pytest.mark.own_code

BS = 4
W = 8


def next_token(last: int) -> int:
    return (last * 31 + 7) % 1000


def expected_outputs(prompt: list[int], num_tokens: int) -> list[int]:
    tokens = [next_token(prompt[-1])]
    while len(tokens) < num_tokens:
        tokens.append(next_token(tokens[-1]))
    return tokens


# -- factories ---------------------------------------------------------------------------


def make_prompt(n: int, seed: int = 0) -> list[int]:
    """Distinct prompts for distinct seeds; the same seed gives a shared prefix."""
    return [(97 * seed + 13 * j + 1) % 1000 for j in range(n)]


def make_request(rid: str, prompt: list[int], max_tokens: int = 4) -> Request:
    """A request that hashes its blocks (prefix caching) and runs to max_tokens."""
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), None,
                   block_size=BS)


def make_manager(num_blocks: int = 64, window: int | None = W) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, sliding_window=window)


def make_scheduler(num_blocks: int = 64, budget: int = 64, window: int | None = W,
                   caching: bool = True, max_num_seqs: int = 16) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs, budget),
                     KVCacheManager(num_blocks, BS, caching, sliding_window=window))


@dataclass
class _RunnerState:
    token_ids: list[int]
    fingerprints: list[int]  # per position: what its KV slot must hold
    block_ids: list[int]
    num_computed_tokens: int

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            previous = self.fingerprints[-1] if self.fingerprints else 0
            self.token_ids.append(token)
            self.fingerprints.append(hash((previous, token)))


@dataclass
class KVRunner:
    """The model runner's bookkeeping plus a fake KV cache (see the module docstring)."""

    num_blocks: int
    window: int | None
    states: dict[str, _RunnerState] = field(default_factory=dict)
    kv: dict[int, int] = field(default_factory=dict)  # slot -> fingerprint written there

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in [*so.finished_req_ids, *so.preempted_req_ids]:
            self.states.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            state = _RunnerState([], [], list(new.block_ids), new.num_computed_tokens)
            state.extend(new.prompt_token_ids + new.output_token_ids)
            self.states[new.req_id] = state
        cached = so.scheduled_cached_reqs
        for req_id, num_computed in zip(cached.req_ids, cached.num_computed_tokens,
                                        strict=True):
            self.states[req_id].block_ids.extend(cached.new_block_ids.get(req_id, []))
            self.states[req_id].num_computed_tokens = num_computed
        req_ids = [*cached.req_ids, *(new.req_id for new in so.scheduled_new_reqs)]
        spans = {}
        for req_id in req_ids:  # every layer writes the step's K/V before it attends
            state = self.states[req_id]
            assert all(0 <= b < self.num_blocks for b in state.block_ids), state.block_ids
            start = state.num_computed_tokens
            spans[req_id] = end = start + so.num_scheduled_tokens[req_id]
            assert end <= len(state.block_ids) * BS, "no KV slot for a token"
            for p in range(start, end):
                self.kv[self._slot(state, p)] = state.fingerprints[p]
        sampled = []
        for req_id in req_ids:
            state = self.states[req_id]
            end = spans[req_id]
            for p in range(state.num_computed_tokens, end):
                first = 0 if self.window is None else max(0, p - self.window + 1)
                for j in range(first, p + 1):
                    assert self.kv.get(self._slot(state, j)) == state.fingerprints[j], \
                        f"{req_id}: the query at {p} reads a key at {j} it did not write"
            state.num_computed_tokens = end
            if end == len(state.token_ids):  # caught up: sample the next token
                token = next_token(state.token_ids[-1])
                state.extend([token])
                sampled.append(token)
            else:
                sampled.append(-1)
        return ModelRunnerOutput(req_ids, sampled)

    @staticmethod
    def _slot(state: _RunnerState, position: int) -> int:
        return state.block_ids[position // BS] * BS + position % BS


def make_runner(scheduler: Scheduler) -> KVRunner:
    kv = scheduler.kv_cache_manager
    return KVRunner(kv.num_total_blocks, kv.sliding_window)


def step(scheduler: Scheduler, runner: KVRunner) -> SchedulerOutput:
    so = scheduler.schedule()
    scheduler.update_from_output(so, runner.execute_model(so))
    return so


def run_to_completion(scheduler: Scheduler, runner: KVRunner,
                      observe: Callable[[SchedulerOutput], None] | None = None,
                      max_steps: int = 2000) -> list[SchedulerOutput]:
    """Step until every request finished, calling `observe` right after each schedule
    (the block tables as the step runs them); then no block may still be held."""
    outputs: list[SchedulerOutput] = []
    while scheduler.has_unfinished_requests():
        assert len(outputs) < max_steps, "no progress"
        so = scheduler.schedule()
        if observe is not None:
            observe(so)
        scheduler.update_from_output(so, runner.execute_model(so))
        outputs.append(so)
    assert_everything_free(scheduler.kv_cache_manager)
    return outputs


def assert_everything_free(kv: KVCacheManager) -> None:
    assert kv.num_free_blocks == kv.num_total_blocks
    assert kv.req_to_blocks == {} and kv.num_skipped_blocks == {}
    assert all(block.ref_cnt == 0 for block in kv.block_pool.blocks)
    assert kv.null_block.ref_cnt == 0 and kv.null_block.block_hash is None


def live_block_ids(kv: KVCacheManager, request_id: str) -> list[int]:
    """The blocks the request still holds; what precedes them must be placeholders."""
    blocks = kv.req_to_blocks.get(request_id, [])
    skipped = kv.num_skipped_blocks.get(request_id, 0)
    assert all(block is kv.null_block for block in blocks[:skipped])
    assert all(block is not kv.null_block for block in blocks[skipped:])
    return [block.block_id for block in blocks[skipped:]]


def compute(kv: KVCacheManager, request: Request, num_tokens: int,
            hits: list[KVCacheBlock] | None = None) -> list[int] | None:
    """One step of the manager alone: allocate, then count the tokens computed."""
    block_ids = kv.allocate_slots(request, num_tokens, hits)
    if block_ids is not None:
        request.num_computed_tokens += len(hits or []) * BS + num_tokens
    return block_ids


def prefill_in_blocks(kv: KVCacheManager, request: Request) -> None:
    """Compute the request's prompt one block (4 tokens) a step."""
    while request.num_computed_tokens < request.num_tokens:
        assert compute(kv, request, min(BS, request.num_tokens - request.num_computed_tokens)) \
            is not None


# -- a long request holds a bounded number of blocks -------------------------------------


def test_a_decoding_request_holds_at_most_three_blocks_and_releases_the_rest() -> None:
    sched = make_scheduler()
    request = make_request("a", make_prompt(8), max_tokens=40)
    sched.add_request(request)
    runner = make_runner(sched)
    kv = sched.kv_cache_manager
    live: list[int] = []

    def observe(_: SchedulerOutput) -> None:
        live.append(len(live_block_ids(kv, "a")))
        assert kv.num_free_blocks == 64 - live[-1]  # released blocks are back in the pool

    run_to_completion(sched, runner, observe)
    # Step 1 computes the prompt (positions 0-7): 2 blocks. Step k >= 2 computes position
    # p = k + 6, whose window 7-p .. p spans 3 blocks (2 when p ends a block: p = 11
    # sees 4..11, blocks 1-2; the manager releases the oldest in that step, which fills
    # a block, and adds the next in the following one). Without a window: 12 at the end.
    assert live == [2] + [3, 3, 3, 2] * 9 + [3, 3, 3]
    assert request.output_token_ids == expected_outputs(request.prompt_token_ids, 40)


def test_without_prefix_caching_a_decoding_request_holds_three_blocks_every_step() -> None:
    sched = make_scheduler(caching=False)
    sched.add_request(make_request("a", make_prompt(8), max_tokens=40))
    runner = make_runner(sched)
    kv = sched.kv_cache_manager
    live: list[int] = []
    run_to_completion(sched, runner, lambda _: live.append(len(live_block_ids(kv, "a"))))
    # The manager is called only when a block is added (p = 8, 12, ...): each call from
    # p = 12 on releases one block as it adds one.
    assert live == [2] + [3] * 39


def test_released_positions_are_null_placeholders_and_new_ids_are_appended() -> None:
    kv = make_manager()
    request = make_request("a", make_prompt(24))
    assert compute(kv, request, 12) == [0, 1, 2]  # positions 0-11
    # The next step computes from 12 (keys from 5 on): block 0 (0-3) is released.
    assert compute(kv, request, 4) == [3]
    assert kv.req_to_blocks["a"][0] is kv.null_block
    assert kv.get_block_ids("a") == [0, 1, 2, 3]  # null_block's id: 0, a valid index
    assert live_block_ids(kv, "a") == [1, 2, 3]
    assert kv.block_pool.blocks[0].ref_cnt == 0 and kv.num_free_blocks == 61
    # From 16 (keys from 9 on) block 1 goes too; the fresh block is appended, as the
    # worker appends new ids, from the queue's head (block 4: released ones join the tail).
    assert compute(kv, request, 4) == [4]
    assert kv.get_block_ids("a") == [0, 0, 2, 3, 4]
    assert live_block_ids(kv, "a") == [2, 3, 4]
    kv.free(request)
    assert_everything_free(kv)



def test_a_block_is_released_exactly_when_its_last_key_leaves_the_window() -> None:
    kv = make_manager()
    request = make_request("a", make_prompt(16))
    compute(kv, request, 10)  # positions 0-9
    # A query at 10 sees keys 3..10: block 0 (0-3) is still read.
    compute(kv, request, 1)
    assert live_block_ids(kv, "a") == [0, 1, 2]
    # A query at 11 sees keys 4..11: block 0 never again.
    compute(kv, request, 1)
    assert live_block_ids(kv, "a") == [1, 2]
    kv.free(request)
    assert_everything_free(kv)


def test_blocks_released_together_join_the_queue_last_first() -> None:
    kv = make_manager(num_blocks=8)
    request = make_request("a", make_prompt(24))
    compute(kv, request, 16)  # blocks 0-3; queue 4..7
    # From 16 (keys from 9 on) blocks 0 and 1 go at once: block 0, the first of a hit
    # chain, joins the tail last so it is evicted last.
    assert compute(kv, request, 8) == [4, 5]
    assert [block.block_id for block in kv.block_pool.free_queue] == [6, 7, 1, 0]
    kv.free(request)
    assert_everything_free(kv)

def test_blocks_released_by_one_request_are_reused_by_another() -> None:
    sched = make_scheduler(num_blocks=6)
    a = make_request("a", make_prompt(8), max_tokens=24)  # 32 tokens: 8 blocks > 6
    sched.add_request(a)
    runner = make_runner(sched)
    for _ in range(14):  # the prompt, then positions 8-20
        step(sched, runner)
    kv = sched.kv_cache_manager
    # a took blocks 0-5 in order and released 0, 1, 2 as its window moved past them
    # (at positions 11, 15, 19): the free queue holds exactly those.
    assert live_block_ids(kv, "a") == [3, 4, 5]
    assert [block.block_id for block in kv.block_pool.free_queue] == [0, 1, 2]
    b = make_request("b", make_prompt(8, seed=1), max_tokens=4)
    sched.add_request(b)
    so = step(sched, runner)
    assert so.scheduled_new_reqs[0].block_ids == [0, 1]
    run_to_completion(sched, runner)
    assert a.output_token_ids == expected_outputs(a.prompt_token_ids, 24)
    assert b.output_token_ids == expected_outputs(b.prompt_token_ids, 4)


def test_a_prompt_longer_than_the_cache_completes_in_chunks() -> None:
    # 40 prompt tokens and 8 outputs would need 12 blocks; the cache has 3. A 4-token
    # chunk from 4k needs the 7 keys before it and itself: blocks k-2 .. k. Each step's
    # new block k is the one the window releases (k-3) in the same call.
    sched = make_scheduler(num_blocks=3, budget=4)
    request = make_request("a", make_prompt(40), max_tokens=8)
    sched.add_request(request)
    runner = make_runner(sched)
    kv = sched.kv_cache_manager
    live: list[int] = []
    run_to_completion(sched, runner, lambda _: live.append(len(live_block_ids(kv, "a"))))
    assert sched.num_preemptions == 0 and max(live) == 3
    assert request.output_token_ids == expected_outputs(request.prompt_token_ids, 8)


# -- nothing leaks ---------------------------------------------------------------------------


def test_every_block_is_free_after_requests_finish_or_are_aborted() -> None:
    sched = make_scheduler(num_blocks=16)
    requests = [make_request(f"r{i}", make_prompt(6 + 5 * i, seed=i), max_tokens=20)
                for i in range(3)]
    for request in requests:
        sched.add_request(request)
    runner = make_runner(sched)
    for _ in range(12):
        step(sched, runner)
    kv = sched.kv_cache_manager
    assert kv.num_skipped_blocks["r1"] > 0  # released blocks, then aborted:
    sched.finish_requests(["r1"], FinishReason.ABORT)
    assert "r1" not in kv.num_skipped_blocks
    live = live_block_ids(kv, "r0") + live_block_ids(kv, "r2")
    assert kv.num_free_blocks == 16 - len(live)
    run_to_completion(sched, runner)


def test_a_failed_step_forgets_only_the_blocks_the_request_still_holds() -> None:
    kv = make_manager(num_blocks=8)
    request = make_request("a", make_prompt(24))
    prefill_in_blocks(kv, request)  # blocks 0-5; 0, 1, 2 released as it went
    assert live_block_ids(kv, "a") == [3, 4, 5]
    hashes = request.block_hashes
    kv.free(request, keep_cached=False)
    assert_everything_free(kv)
    # Released blocks were computed by earlier, successful steps: still findable.
    assert [kv.block_pool.get_cached_block(h) for h in hashes[:3]] == kv.block_pool.blocks[:3]
    assert all(kv.block_pool.get_cached_block(h) is None for h in hashes[3:])


# -- prefix caching ------------------------------------------------------------------------


def test_a_shared_prefix_still_hits_and_hits_outside_the_window_are_released_at_once() -> None:
    sched = make_scheduler()
    prompt = make_prompt(18)
    sched.add_request(make_request("a", prompt))
    runner = make_runner(sched)
    run_to_completion(sched, runner)
    sched.add_request(make_request("b", prompt))
    so = step(sched, runner)
    new = so.scheduled_new_reqs[0]
    kv = sched.kv_cache_manager
    # 4 blocks hit; b computes from 16, whose keys start at 9: hits 0-1 are released at
    # admission (null placeholders, id 0), hits 2-3 held.
    assert new.num_computed_tokens == 16
    assert new.block_ids[:2] == [0, 0] and kv.num_skipped_blocks["b"] == 2
    cached = kv.block_pool.cached  # a's blocks, found by b's hashes
    a_blocks = [cached[h] for h in sched.requests["b"].block_hashes[:4]]
    assert new.block_ids[2:4] == [block.block_id for block in a_blocks[2:]]
    assert [block.ref_cnt for block in a_blocks] == [0, 0, 1, 1]  # 0-1 free, still cached
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (36, 16)
    run_to_completion(sched, runner)


def _prefill_a_then_free(kv: KVCacheManager, prompt: list[int]) -> None:
    """Request a's 24-token prompt a block a step, then free it. In an 8-block cache
    (queue 0..7) it takes blocks 0-5 and releases 0, 1, 2 on the way (at positions 12,
    16, 20); its end frees 5, 4, 3: the queue is then 6 7 0 1 2 5 4 3."""
    a = make_request("a", prompt)
    prefill_in_blocks(kv, a)
    kv.free(a)
    assert [block.block_id for block in kv.block_pool.free_queue] == [6, 7, 0, 1, 2, 5, 4, 3]


def test_hits_outside_the_window_are_placeholders_and_go_to_the_queues_tail() -> None:
    kv = make_manager(num_blocks=8)
    prompt = make_prompt(24)
    _prefill_a_then_free(kv, prompt)
    b = make_request("b", [*prompt, 900, 901, 902, 903])
    hits = kv.get_computed_blocks(b)
    assert [block.block_id for block in hits] == [0, 1, 2, 3, 4, 5]
    # b computes from 24 (keys from 17): hits 0-3 are released at once, to the queue's
    # tail in reverse (the chain's first block evicted last), before the new block is
    # taken from the head.
    assert compute(kv, b, 4, hits) == [6]
    assert kv.get_block_ids("b") == [0, 0, 0, 0, 4, 5, 6]
    assert live_block_ids(kv, "b") == [4, 5, 6]
    assert [block.block_id for block in kv.block_pool.free_queue] == [7, 3, 2, 1, 0]
    assert all(kv.block_pool.get_cached_block(h) is not None for h in b.block_hashes[:4])
    kv.free(b)
    assert_everything_free(kv)


def test_a_hit_chain_starts_at_block_0_and_stops_at_an_evicted_block() -> None:
    kv = make_manager(num_blocks=8)
    prompt = make_prompt(24)
    _prefill_a_then_free(kv, prompt)
    # s shares a's first two blocks and holds them (from 8 its window reaches block 0);
    # its 2 fresh blocks are 6 and 7, so e's one block evicts a's block 2, the next in
    # the queue (a released blocks in the order its window passed them).
    s = make_request("s", [*prompt[:8], 900, 901, 902, 903, 904])
    assert compute(kv, s, 5, kv.get_computed_blocks(s)) == [6, 7]
    e = make_request("e", make_prompt(4, seed=5))
    assert compute(kv, e, 4) == [2]
    b = make_request("b", [*prompt, 900, 901, 902, 903])
    assert [block.block_id for block in kv.get_computed_blocks(b)] == [0, 1]
    assert kv.block_pool.get_cached_block(b.block_hashes[3]) is kv.block_pool.blocks[3]
    kv.free(s)
    kv.free(e)
    assert_everything_free(kv)


def test_a_long_cached_prefix_is_admitted_only_because_of_the_window() -> None:
    prompt = make_prompt(24)
    for window, fits in ((W, True), (None, False)):
        kv = make_manager(num_blocks=6, window=window)
        a = make_request("a", prompt)
        prefill_in_blocks(kv, a)  # 6 blocks: fits a 6-block cache either way
        kv.free(a)
        b = make_request("b", [*prompt, 900, 901, 902, 903])
        hits = kv.get_computed_blocks(b)
        assert len(hits) == 6
        # Taking 6 free hits and 1 fresh block needs 7 > 6 blocks; with the window b
        # holds hits 4-5 and its fresh block only (hits 0-3 sit before position 17).
        assert (compute(kv, b, 4, hits) is not None) is fits, window
        kv.free(b)
        assert_everything_free(kv)


# -- preemption ----------------------------------------------------------------------------


def test_a_preempted_request_resumes_recomputing_and_releases_blocks_again() -> None:
    sched = make_scheduler(num_blocks=5, budget=8)
    a = make_request("a", make_prompt(8), max_tokens=20)
    b = make_request("b", make_prompt(8, seed=1), max_tokens=20)
    sched.add_request(a)
    sched.add_request(b)
    runner = make_runner(sched)
    kv = sched.kv_cache_manager
    admissions: list[list[int]] = []  # b's outputs, each time it is (re)admitted
    released_after_resume = [0]

    def observe(so: SchedulerOutput) -> None:
        admissions.extend(new.output_token_ids for new in so.scheduled_new_reqs
                          if new.req_id == "b")
        if len(admissions) > 1:
            released_after_resume[0] = max(released_after_resume[0],
                                           kv.num_skipped_blocks.get("b", 0))

    run_to_completion(sched, runner, observe)
    assert sched.num_preemptions >= 1 and len(admissions) >= 2
    assert any(admissions[1:])  # resumed with its outputs, recomputing them
    assert released_after_resume[0] > 0  # and releasing blocks again as it goes
    assert a.output_token_ids == expected_outputs(a.prompt_token_ids, 20)
    assert b.output_token_ids == expected_outputs(b.prompt_token_ids, 20)


# -- no window: today's behaviour ----------------------------------------------------------


def test_without_a_window_a_request_keeps_every_block() -> None:
    kv = KVCacheManager(64, BS)
    assert kv.sliding_window is None
    request = make_request("a", make_prompt(48))
    prefill_in_blocks(kv, request)
    assert kv.get_block_ids("a") == list(range(12)) and kv.num_skipped_blocks == {}
    assert kv.num_free_blocks == 52
    kv.free(request)
    assert_everything_free(kv)


@pytest.mark.parametrize("window", [0, -4])
def test_a_window_below_one_token_is_refused(window: int) -> None:
    with pytest.raises(ValueError, match="sliding_window"):
        KVCacheManager(8, BS, sliding_window=window)


# -- random load -----------------------------------------------------------------------------


def random_run(window: int, seed: int, num_blocks: int, num_requests: int = 30
               ) -> tuple[Scheduler, int]:
    """Random prompts (some sharing a 12-token prefix), max_tokens and arrivals with an
    8-token budget and 4 seats, in a cache sized so that preemption, chunking and prefix
    hits are routine and requests run longer than the cache. Returns the scheduler and
    how many blocks were released, summed over steps."""
    rng = random.Random(seed)
    shared = make_prompt(12, seed=99)
    requests = []
    for i in range(num_requests):
        prompt = shared[:rng.choice([0, 8, 12])] + make_prompt(rng.randint(1, 40), seed=i)
        requests.append(make_request(f"r{i}", prompt, max_tokens=rng.randint(1, 30)))
    sched = make_scheduler(num_blocks=num_blocks, budget=8, window=window, max_num_seqs=4)
    runner = make_runner(sched)
    kv = sched.kv_cache_manager
    pending = list(requests)
    steps = released = 0
    while pending or sched.has_unfinished_requests():
        assert steps < 5000, "no progress"
        for _ in range(rng.choice([0, 0, 1, 2])):
            if pending:
                sched.add_request(pending.pop(0))
        so = sched.schedule()
        steps += 1
        held = {b for rid in kv.req_to_blocks for b in live_block_ids(kv, rid)}
        assert len(held) + kv.num_free_blocks == num_blocks
        released += sum(kv.num_skipped_blocks.values())
        sched.update_from_output(so, runner.execute_model(so))
    for request in requests:
        assert request.output_token_ids == \
            expected_outputs(request.prompt_token_ids, request.max_tokens)
    assert_everything_free(kv)
    return sched, released


# A lone request's 8-token chunk and the window before it span up to 3 blocks (W = 1),
# 4 (W = 5) or 5 (W = 8): the caches leave room for one and a little more.
@pytest.mark.parametrize(("window", "num_blocks"), [(1, 4), (5, 8), (W, 8)])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_load_reads_every_visible_key_back_and_leaks_nothing(window: int, num_blocks: int,
                                                                    seed: int) -> None:
    sched, released = random_run(window, seed, num_blocks)
    kv = sched.kv_cache_manager
    # So that the run means something: blocks were released, requests were preempted,
    # the prefix cache hit.
    assert released > 0 and sched.num_preemptions > 0 and kv.prefix_cache_hits > 0
