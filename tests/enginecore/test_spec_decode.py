"""Speculative decoding's engine-core half (enginecore/spec_decode.py and the
scheduler's part): n-gram proposals, their budget, and taking rejected ones back; a
draft model's proposals kept between steps and the slots they need."""

from __future__ import annotations

import dataclasses
import random

import pytest

from pagellm.enginecore.kv_cache_manager import KVCacheManager
from pagellm.enginecore.request import Request
from pagellm.enginecore.scheduler import Scheduler, SchedulerConfig
from pagellm.enginecore.spec_decode import (
    DraftModelProposer,
    NgramProposer,
    Proposer,
    propose_ngram,
)
from pagellm.protocol.sampling_params import SamplingParams
from pagellm.protocol.scheduling import ModelRunnerOutput
from pagellm.protocol.speculative import parse_speculative_config

pytestmark = pytest.mark.own_code


def brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The definition, one comparison at a time: for the largest n, the latest start
    i < len - n with tokens[i:i + n] equal to the last n tokens."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for i in range(len(tokens) - n - 1, -1, -1):
            if tokens[i:i + n] == suffix:
                return tokens[i + n:i + n + k]
    return []


def test_ngram_lookup_is_the_definition_on_random_sequences():
    """Small alphabets (many matches, many straddled byte patterns with ids past 255)."""
    rng = random.Random(0)
    for case in range(3000):
        alphabet = rng.choice([[1, 2], [0, 1, 2, 3], [255, 256, 65535, 65536, 2**31 - 1]])
        tokens = [rng.choice(alphabet) for _ in range(rng.randint(1, 40))]
        split = rng.randint(0, len(tokens))
        low = rng.randint(1, 4)
        high = rng.randint(low, 6)
        k = rng.randint(1, 5)
        assert propose_ngram(tokens[:split], tokens[split:], low, high, k) == \
            brute_force(tokens, low, high, k), (case, tokens, low, high, k)


def test_the_proposer_keeps_a_requests_tokens_as_bytes_between_steps():
    """The proposer extends its bytes by the tokens since the last proposal (runs of
    several at a time, too): every proposal is the one made from scratch."""
    rng = random.Random(1)
    proposer = _proposer(num_speculative_tokens=3, prompt_lookup_min=1,
                         prompt_lookup_max=3)
    request = _request([rng.choice([1, 2, 3]) for _ in range(20)], max_tokens=400)
    for _ in range(60):
        assert proposer.propose(request) == propose_ngram(
            request.prompt_token_ids, request.output_token_ids, 1, 3, 3)
        for _ in range(rng.randint(1, 4)):
            request.append_output_token_id(rng.choice([1, 2, 3, 4]))
    assert request.token_bytes is not None and len(request.token_bytes) < 4 * request.num_tokens


def _request(prompt: list[int], max_tokens: int, name: str = "r") -> Request:
    return Request(name, prompt, SamplingParams(max_tokens=max_tokens), eos_token_id=None)


def _proposer(**config: object) -> NgramProposer:
    parsed = parse_speculative_config({"method": "ngram", **config})
    assert parsed is not None
    return NgramProposer(parsed)


def test_proposals_leave_room_for_the_token_after_them():
    proposer = _proposer(num_speculative_tokens=4, prompt_lookup_min=1)
    request = _request([1, 2, 3, 4, 5, 6, 1], max_tokens=3)
    assert proposer.propose(request) == [2, 3]  # 3 tokens left: 2 proposals + 1
    request.append_output_token_id(2)
    request.append_output_token_id(3)
    assert proposer.propose(request) == []  # the last token: nothing to verify


def _scheduler(proposer: Proposer, budget: int = 64, max_num_seqs: int = 8
               ) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs,
                                     max_num_batched_tokens=budget),
                     KVCacheManager(64, 4), proposer)


def _decode_ready(scheduler: Scheduler, *requests: tuple[Request, int]) -> None:
    """Admit the requests and run their prompts, each sampling the token given."""
    for request, _ in requests:
        scheduler.add_request(request)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {r.request_id: r.num_tokens for r, _ in requests}
    scheduler.update_from_output(out, ModelRunnerOutput([r.request_id for r, _ in requests],
                                                        [t for _, t in requests]))


def test_the_scheduler_budgets_proposals_and_takes_rejected_ones_back():
    proposer = _proposer(num_speculative_tokens=3, prompt_lookup_min=1)
    scheduler = _scheduler(proposer)
    request = _request([7, 1, 2, 3, 4, 7], max_tokens=10)
    _decode_ready(scheduler, (request, 1))  # ... 7 1: proposes 2 3 4
    out = scheduler.schedule()
    assert out.scheduled_spec_decode_tokens == {"r": [2, 3, 4]}
    assert out.num_scheduled_tokens == {"r": 4} and request.num_computed_tokens == 10
    # The runner accepted 2, rejected 3 (its sample there was 9).
    scheduler.update_from_output(out, ModelRunnerOutput(["r"], [2], more_token_ids={"r": [9]}))
    assert request.output_token_ids == [1, 2, 9]
    assert request.num_computed_tokens == 8  # 7 1 2's and the prompt's: 9 not yet
    assert request.num_tokens == 9
    stats = scheduler.spec_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens,
            stats.accepted_per_pos) == (1, 3, 1, [1, 0, 0])


def test_a_stop_inside_a_run_ends_the_request_there():
    proposer = _proposer(num_speculative_tokens=3, prompt_lookup_min=1)
    scheduler = _scheduler(proposer)
    request = Request("r", [7, 1, 2, 3, 4, 7], SamplingParams(max_tokens=10,
                                                             stop_token_ids=[3]), None)
    _decode_ready(scheduler, (request, 1))
    out = scheduler.schedule()
    outputs = scheduler.update_from_output(out, ModelRunnerOutput(
        ["r"], [2], more_token_ids={"r": [3, 4, 5]}))
    [message] = outputs[0].outputs
    assert message.new_token_ids == [2, 3] and message.finish_reason is not None
    assert request.output_token_ids == [1, 2, 3]
    assert scheduler.kv_cache_manager.num_free_blocks == 64


def test_proposals_take_only_spare_budget_and_seats():
    proposer = _proposer(num_speculative_tokens=3, prompt_lookup_min=1)
    scheduler = _scheduler(proposer)
    a, b = _request([7, 1, 2, 3, 4, 7], 10, "a"), _request([8, 5, 6, 8], 10, "b")
    _decode_ready(scheduler, (a, 1), (b, 5))
    # Budget: two decode tokens and one proposal.
    scheduler.config = dataclasses.replace(scheduler.config, max_num_batched_tokens=3)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 3} and out.scheduled_spec_decode_tokens == {
        "a": [2, 3]}  # a takes the budget first; b waits for the next step
    # Seats: max_num_seqs positions sampled a step, less one per waiting request.
    for waiting, proposed in ((False, 1), (True, 0)):
        scheduler = _scheduler(proposer, max_num_seqs=3)
        a, b = _request([7, 1, 2, 3, 4, 7], 10, "a"), _request([8, 5, 6, 8], 10, "b")
        _decode_ready(scheduler, (a, 1), (b, 5))
        if waiting:  # its seat is kept for it (it is admitted after the running ones)
            scheduler.add_request(_request([9, 9], 10, "c"))
        out = scheduler.schedule()
        assert sum(len(d) for d in out.scheduled_spec_decode_tokens.values()) == proposed


def test_a_draft_models_proposals_are_kept_for_the_next_step_with_slots_for_its_own():
    """The runner drafts after a step that asks (`propose_drafts`); the scheduler keeps
    the proposals on the request, schedules them in its next decode with k slots more
    (the draft writes its k proposals' keys past the step: never hashed), and forgets
    them when the runner drafted nothing after a later token."""
    config = parse_speculative_config({"model": "d", "num_speculative_tokens": 3})
    assert config is not None
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
                          KVCacheManager(64, 4, enable_prefix_caching=True),
                          DraftModelProposer(config))
    request = Request("r", [5, 6, 7, 8, 9, 10, 11], SamplingParams(max_tokens=10), None,
                      block_size=4)
    scheduler.add_request(request)
    out = scheduler.schedule()
    assert out.propose_drafts and out.num_scheduled_tokens == {"r": 7}
    scheduler.update_from_output(out, ModelRunnerOutput(
        ["r"], [1], draft_token_ids={"r": [2, 3, 4]}))
    assert request.spec_token_ids == [2, 3, 4]
    out = scheduler.schedule()
    assert out.scheduled_spec_decode_tokens == {"r": [2, 3, 4]}
    # Positions 7..10 computed, 11..13 the draft's: 14 slots, 4 blocks of 4.
    manager = scheduler.kv_cache_manager
    assert len(manager.req_to_blocks["r"]) == 4
    assert manager.num_cached_blocks["r"] == 2  # tokens 0..7 only: 8..13 not computed
    scheduler.update_from_output(out, ModelRunnerOutput(
        ["r"], [2], more_token_ids={"r": [3, 9]}, draft_token_ids={"r": [9, 9, 9]}))
    assert request.output_token_ids == [1, 2, 3, 9] and request.spec_token_ids == [9, 9, 9]
    out = scheduler.schedule()
    scheduler.update_from_output(out, ModelRunnerOutput(["r"], [4]))  # drafted nothing
    assert request.spec_token_ids == []
    assert scheduler.schedule().scheduled_spec_decode_tokens == {}


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_a_grammar_takes_the_proposals_it_allows_short_of_completing_it(model_dirs,
                                                                       backend):
    """valid_proposals: the proposals up to the first the grammar refuses, and short of
    the one that completes it (a stop token after a complete match); the matcher is
    left where it was (it takes the same tokens again)."""
    from transformers import AutoTokenizer

    from pagellm.enginecore.structured_output.backends import Backends
    from pagellm.enginecore.structured_output.request_grammar import RequestGrammar
    from pagellm.enginecore.structured_output.spec import choose_backend
    from pagellm.protocol.sampling_params import StructuredOutputsParams

    path = str(model_dirs["llama"])
    tokenizer = AutoTokenizer.from_pretrained(path)
    a, b, c = tokenizer.convert_tokens_to_ids(["a", "b", "c"])
    eos = tokenizer.eos_token_id
    name, spec = choose_backend(StructuredOutputsParams(regex="(ab)+c(ab)*"), backend,
                                True)
    grammars = Backends(path, len(tokenizer), 1).get(name)
    grammar = RequestGrammar(grammars.matcher(grammars.compile(spec), [eos]))
    assert grammar.takes_proposals
    assert grammar.valid_proposals([a, b, a, c]) == [a, b, a]  # c after a: refused
    assert grammar.valid_proposals([a, b, c, eos, a]) == [a, b, c]  # eos completes it
    assert grammar.valid_proposals([b]) == []
    for token in (a, b, c):  # the matcher is where it started
        assert grammar.advance(token) is None
    assert grammar.valid_proposals([eos]) == [] and not grammar.terminated
    assert grammar.advance(eos) is None and grammar.terminated
    assert not grammar.takes_proposals
