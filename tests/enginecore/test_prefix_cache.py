"""Prefix caching, long-prefill caps and priority scheduling, without a model.

Factories build requests that hash their blocks (block_size set), a KV cache manager
and a scheduler; a tiny fake runner turns scheduler outputs into sampled tokens the
way the model runner does (a request samples once its computed tokens catch up).
"""

from __future__ import annotations

import pytest

from pagellm.enginecore.block_hash import extend_block_hashes, hash_block
from pagellm.enginecore.kv_cache_manager import KVCacheManager
from pagellm.enginecore.request import Request
from pagellm.enginecore.scheduler import Scheduler, SchedulerConfig
from pagellm.protocol.messages import FinishReason
from pagellm.protocol.sampling_params import SamplingParams
from pagellm.protocol.scheduling import ModelRunnerOutput, SchedulerOutput

# Our code and torch alone: the floors leg skips it (.ci/run).
pytestmark = pytest.mark.own_code

BS = 4


def make_request(rid: str, prompt: list[int], max_tokens: int = 4, priority: int = 0,
                 arrival: float = 0.0, salt: str | None = None) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), None,
                   arrival, priority, block_size=BS, cache_salt=salt)


def make_scheduler(num_blocks: int = 64, budget: int = 64, max_num_seqs: int = 16,
                   caching: bool = True, policy: str = "fcfs", threshold: int = 0
                   ) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs, budget, threshold, policy),
                     KVCacheManager(num_blocks, BS, caching))


def fake_run(sched: Scheduler, out: SchedulerOutput) -> ModelRunnerOutput:
    """Sample token 7 for every request whose computed tokens caught up."""
    ids, sampled = [], []
    for req_id, _n in out.num_scheduled_tokens.items():
        request = sched.requests[req_id]
        ids.append(req_id)
        sampled.append(7 if request.num_computed_tokens == request.num_tokens else -1)
    return ModelRunnerOutput(ids, sampled)


def step(sched: Scheduler) -> SchedulerOutput:
    out = sched.schedule()
    sched.update_from_output(out, fake_run(sched, out))
    return out


def run_all(sched: Scheduler) -> list[SchedulerOutput]:
    outs = []
    while sched.has_unfinished_requests():
        outs.append(step(sched))
    kv = sched.kv_cache_manager
    assert kv.num_free_blocks == kv.num_total_blocks  # nothing leaked
    return outs


PROMPT = list(range(100, 118))  # 18 tokens: 4 full blocks of 4, and 2 more


# --- hashes ---------------------------------------------------------------------------


def test_block_hashes_chain_their_prefix():
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    b = make_request("b", [9, 9, 9, 9, 5, 6, 7, 8])
    assert len(a.block_hashes) == 2 and len(b.block_hashes) == 2
    assert a.block_hashes[0] == hash_block(None, [1, 2, 3, 4])
    assert a.block_hashes[1] == hash_block(a.block_hashes[0], [5, 6, 7, 8])
    assert a.block_hashes[1] != b.block_hashes[1]  # same tokens, different prefix


def test_output_tokens_extend_the_hashes_as_blocks_fill():
    r = make_request("r", [1, 2, 3, 4, 5, 6])
    assert len(r.block_hashes) == 1
    r.append_output_token_id(7)
    assert len(r.block_hashes) == 1
    r.append_output_token_id(8)
    expected: list[bytes] = []
    extend_block_hashes(expected, [1, 2, 3, 4, 5, 6, 7, 8], BS, None)
    assert r.block_hashes == expected


@pytest.mark.parametrize("prompt_len", [2, 4, 6, 9])
@pytest.mark.parametrize("salt", [None, "tenant-1"])
def test_hashes_kept_while_decoding_equal_hashing_the_whole_sequence(prompt_len: int,
                                                                      salt: str | None):
    """A request hashes each block as it fills from the block's own tokens (the
    output's last, after the prompt's last while the output is shorter than a block):
    the same hashes as hashing prompt + output from scratch, salt on the first block
    included, also when the prompt is shorter than one block."""
    prompt = list(range(1, prompt_len + 1))
    r = make_request("r", prompt, salt=salt)
    tokens = list(prompt)
    for token in range(50, 64):
        r.append_output_token_id(token)
        tokens.append(token)
        expected: list[bytes] = []
        extend_block_hashes(expected, tokens, BS, salt)
        assert r.block_hashes == expected, (prompt_len, token)
    assert len(r.block_hashes) == (prompt_len + 14) // BS


def test_extending_hashes_from_tokens_that_start_too_late_is_refused():
    hashes: list[bytes] = []
    with pytest.raises(ValueError, match="position 4"):
        extend_block_hashes(hashes, [5, 6, 7, 8], BS, None, offset=4)
    assert hashes == []


def test_salt_changes_every_hash():
    plain, salted = make_request("p", PROMPT), make_request("s", PROMPT, salt="tenant-1")
    assert not set(plain.block_hashes) & set(salted.block_hashes)


# --- hits -----------------------------------------------------------------------------


def test_same_prompt_twice_hits_every_full_block_but_the_last_token():
    sched = make_scheduler()
    sched.add_request(make_request("a", PROMPT))
    run_all(sched)
    kv = sched.kv_cache_manager
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (18, 0)
    sched.add_request(make_request("b", PROMPT))
    out = step(sched)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 16  # 4 blocks of 4
    assert out.num_scheduled_tokens["b"] == 2
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (36, 16)
    run_all(sched)


def test_a_decoding_requests_blocks_become_findable_exactly_when_computed_full():
    sched = make_scheduler()
    request = make_request("a", PROMPT[:6], max_tokens=12)  # block 0 full, block 1 half
    sched.add_request(request)
    kv = sched.kv_cache_manager
    for k in range(1, 13):
        step(sched)
        if k == 12:
            break  # finished: its blocks are free (and stay findable)
        # Step k computed 6 + (k - 1) tokens (the prompt, then one token a step).
        full = (6 + k - 1) // BS
        assert set(kv.block_pool.cached) == set(request.block_hashes[:full]), k
        assert [kv.block_pool.cached[h].block_id for h in request.block_hashes[:full]] \
            == kv.get_block_ids("a")[:full]
    assert len(kv.block_pool.cached) == (6 + 11) // BS


def test_a_prompt_of_whole_blocks_recomputes_its_last_block():
    sched = make_scheduler()
    sched.add_request(make_request("a", PROMPT[:16]))
    run_all(sched)
    sched.add_request(make_request("b", PROMPT[:16]))
    out = step(sched)
    # 16 tokens = 4 full blocks, but the last token must be computed: 3 blocks hit.
    assert out.scheduled_new_reqs[0].num_computed_tokens == 12
    run_all(sched)


def test_a_diverging_prompt_hits_only_the_shared_blocks():
    sched = make_scheduler()
    sched.add_request(make_request("a", PROMPT))
    run_all(sched)
    sched.add_request(make_request("b", [*PROMPT[:9], 1, 2, 3, 4, 5, 6, 7]))
    out = step(sched)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 8  # blocks 0-1 match
    run_all(sched)


def test_requests_admitted_together_share_blocks_at_once():
    sched = make_scheduler()
    sched.add_request(make_request("a", PROMPT))
    sched.add_request(make_request("b", PROMPT))
    out = step(sched)
    a, b = out.scheduled_new_reqs
    assert a.num_computed_tokens == 0 and b.num_computed_tokens == 16
    assert a.block_ids[:4] == b.block_ids[:4] and a.block_ids[4] != b.block_ids[4]
    blocks = sched.kv_cache_manager.block_pool.blocks
    assert [blocks[i].ref_cnt for i in a.block_ids[:4]] == [2, 2, 2, 2]
    run_all(sched)


def test_different_salts_never_share_blocks():
    sched = make_scheduler()
    sched.add_request(make_request("a", PROMPT, salt="one"))
    sched.add_request(make_request("b", PROMPT, salt="two"))
    sched.add_request(make_request("c", PROMPT, salt="one"))
    out = step(sched)
    a, b, c = out.scheduled_new_reqs
    assert b.num_computed_tokens == 0 and not set(a.block_ids) & set(b.block_ids)
    assert c.num_computed_tokens == 16
    run_all(sched)


def test_disabled_caching_never_hits():
    sched = make_scheduler(caching=False)
    for rid in ("a", "b"):
        sched.add_request(make_request(rid, PROMPT))
        out = step(sched)
        assert out.scheduled_new_reqs[0].num_computed_tokens == 0
    run_all(sched)
    assert sched.kv_cache_manager.prefix_cache_queries == 0


def test_freed_blocks_are_evicted_least_recently_freed_first():
    # 12 blocks. a and b each cache 4 full blocks, a freed before b.
    sched = make_scheduler(num_blocks=12)
    a_prompt, b_prompt = [*list(range(16)), 99], [*list(range(50, 66)), 99]
    for rid, prompt in (("a", a_prompt), ("b", b_prompt)):
        sched.add_request(make_request(rid, prompt, max_tokens=1))
        run_all(sched)
    pool = sched.kv_cache_manager.block_pool
    assert len(pool.cached) == 8
    # Free queue now: 10, 11 (never used), then a's blocks 4, 3, 2, 1, 0 (freed tail
    # first; block 4 held token 16 and was never full), then b's 9, 8, 7, 6, 5.
    # A request needing 6 fresh blocks takes 10, 11, 4, 3, 2, 1: it evicts a's blocks
    # 3, 2 and 1, and leaves a's first block and all of b's findable.
    sched.add_request(make_request("c", list(range(200, 223)), max_tokens=1))
    step(sched)
    a_hashes = make_request("x", a_prompt).block_hashes
    b_hashes = make_request("y", b_prompt).block_hashes
    remaining = set(pool.cached)
    assert set(b_hashes) <= remaining
    assert [h in remaining for h in a_hashes] == [True, False, False, False]
    run_all(sched)


def test_reset_forgets_everything_but_not_while_blocks_are_held():
    sched = make_scheduler()
    sched.add_request(make_request("a", PROMPT, max_tokens=8))
    step(sched)
    assert not sched.kv_cache_manager.reset_prefix_cache()  # "a" holds blocks
    run_all(sched)
    assert sched.kv_cache_manager.reset_prefix_cache()
    assert not sched.kv_cache_manager.block_pool.cached
    sched.add_request(make_request("b", PROMPT))
    assert step(sched).scheduled_new_reqs[0].num_computed_tokens == 0
    run_all(sched)


def test_usage_counts_only_blocks_held_by_requests():
    sched = make_scheduler(num_blocks=10)
    sched.add_request(make_request("a", PROMPT, max_tokens=2))
    step(sched)
    assert sched.kv_cache_manager.usage() == pytest.approx(5 / 10)
    run_all(sched)
    assert sched.kv_cache_manager.usage() == 0.0
    assert len(sched.kv_cache_manager.block_pool.cached) == 4  # cached, yet free


def test_a_preempted_request_resumes_from_its_cached_blocks():
    # a and b (16-token prompts, 12 outputs) fill the 10 blocks at 20 tokens each; b is
    # preempted and frees its 5 blocks (tail first). a grows to 7 blocks, taking b's
    # last two (an output block and prompt block 3); b resumes with its first 3 blocks
    # (12 tokens) from the cache.
    sched = make_scheduler(num_blocks=10, budget=64)
    sched.add_request(make_request("a", list(range(16)), max_tokens=12))
    sched.add_request(make_request("b", list(range(30, 46)), max_tokens=12))
    resumed_from = None
    while sched.has_unfinished_requests():
        out = step(sched)
        for new in out.scheduled_new_reqs:
            if new.output_token_ids:  # a resumed request
                resumed_from = new.num_computed_tokens
    assert sched.num_preemptions > 0
    assert resumed_from == 12


# --- chunking caps --------------------------------------------------------------------


def test_long_prefill_threshold_lets_prompts_advance_together():
    sched = make_scheduler(budget=64, threshold=8)
    sched.add_request(make_request("a", list(range(30))))
    sched.add_request(make_request("b", list(range(100, 130))))
    first = step(sched)
    assert first.num_scheduled_tokens == {"a": 8, "b": 8}
    second = step(sched)
    assert second.num_scheduled_tokens == {"a": 8, "b": 8}
    run_all(sched)


# --- priority ---------------------------------------------------------------------------


def test_priority_admits_lowest_value_first_then_by_arrival():
    sched = make_scheduler(max_num_seqs=1, policy="priority")
    for rid, prio, arrival in (("late-low", 5, 1.0), ("urgent", 0, 3.0),
                               ("early-low", 5, 0.5), ("mid", 2, 2.0)):
        sched.add_request(make_request(rid, [1, 2, 3], max_tokens=1, priority=prio,
                                       arrival=arrival))
    order = [step(sched).scheduled_new_reqs[0].req_id for _ in range(4)]
    assert order == ["urgent", "mid", "early-low", "late-low"]
    run_all(sched)


def test_fcfs_ignores_priority():
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("first", [1, 2], max_tokens=1, priority=9))
    sched.add_request(make_request("second", [1, 2], max_tokens=1, priority=0))
    assert step(sched).scheduled_new_reqs[0].req_id == "first"
    run_all(sched)


def test_priority_preempts_the_least_important_running_request():
    # Admitted in priority order: "vip" (0), "normal" (5), "bulk" (9). When blocks run
    # out, "bulk" goes first whatever the admission order.
    sched = make_scheduler(num_blocks=9, policy="priority")
    sched.add_request(make_request("bulk", list(range(8)), max_tokens=16, priority=9))
    step(sched)
    sched.add_request(make_request("vip", list(range(20, 28)), max_tokens=16, priority=0))
    sched.add_request(make_request("normal", list(range(40, 48)), max_tokens=16,
                                   priority=5))
    preempted = []
    while sched.has_unfinished_requests():
        out = step(sched)
        preempted += out.preempted_req_ids
    assert preempted and preempted[0] == "bulk"
    assert "vip" not in preempted


def test_aborting_a_waiting_request_under_priority():
    sched = make_scheduler(max_num_seqs=1, policy="priority")
    for rid, prio in (("a", 1), ("b", 0), ("c", 2)):
        sched.add_request(make_request(rid, [1, 2], max_tokens=2, priority=prio))
    step(sched)
    assert sched.finish_requests(["c"], FinishReason.ABORT) == ["c"]
    assert len(sched.waiting) == 1
    assert [o.scheduled_new_reqs[0].req_id for o in run_all(sched)
            if o.scheduled_new_reqs] == ["a"]
