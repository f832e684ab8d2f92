"""Speculative decoding with n-gram proposals (enginecore/spec_decode.py proposes,
executor/worker/model_runner.py verifies) and a draft model's (executor/worker/
draft_model.py proposes): it changes how many tokens a step emits, never which. Greedy
and seeded requests give the tokens they give without it (and greedy ones transformers'
tokens), whatever else the step holds; unseeded requests are distributed as without it
(the verifier is the same for both methods: greedy proposals, q one-hot).

The model is the llama test shape with a small init (std 0.04): its greedy text falls
into short loops and out of them, so proposals are accepted in runs and rejected too,
which the tests check they were."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import PROMPTS
from token_equality import assert_same, looping_prompts, mixed_params, outputs

from pagellm import SamplingParams
from pagellm.demo.model import ModelSpec, make_model

pytestmark = pytest.mark.own_code

LOOPY = ModelSpec(arch="llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  intermediate_size=128, vocab_size=1024, init_std=0.04, seed=1)
# Proposals at every batch size (the CPU's default stops them above 8 running requests;
# these tests run more at once to mix features in).
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1, "disable_by_batch_size": 1024}
KV = 8 * 2**20


@pytest.fixture(scope="module")
def loopy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("spec") / "loopy", LOOPY)


def stats(llm: Any) -> Any:
    return llm.engine_core.core.scheduler.spec_stats


def test_greedy_tokens_are_transformers_and_proposals_run_both_ways(loopy, make_llm):
    from transformers import AutoModelForCausalLM

    llm = make_llm(loopy, speculative_config=SPEC)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    got = outputs(llm, PROMPTS, params)
    model = AutoModelForCausalLM.from_pretrained(loopy, dtype=torch.float32).eval()
    for prompt, completions in zip(PROMPTS, got, strict=True):
        ids = llm.tokenizer.encode(prompt)
        with torch.no_grad():
            reference = model.generate(torch.tensor([ids]), do_sample=False,
                                        max_new_tokens=40,
                                        attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        assert completions[0][0] == reference[0, len(ids):].tolist(), prompt
    s = stats(llm)
    # Both paths ran: runs of accepted proposals, and rejections.
    assert s.num_accepted_tokens > 40 and s.accepted_per_pos[1] > 0
    assert s.num_draft_tokens - s.num_accepted_tokens > 10
    # The counts as get_stats() and the server's metrics give them, under vLLM's names.
    from pagellm.frontend.server.metrics import ServerMetrics

    engine = llm.get_stats()
    assert (engine.spec_num_drafts, engine.spec_num_draft_tokens,
            engine.spec_num_accepted_tokens, engine.spec_accepted_per_pos) == (
        s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, s.accepted_per_pos)
    text = ServerMetrics("m", 512).render(engine).decode()
    labels = 'engine="0",model_name="m"'
    assert f"vllm:spec_decode_num_accepted_tokens_total{{{labels}}} " \
        f"{float(s.num_accepted_tokens)}" in text
    assert f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="1"}} ' \
        f"{float(s.accepted_per_pos[1])}" in text


def test_every_sampling_feature_gives_the_tokens_it_gives_without(loopy, make_llm):
    params = mixed_params()
    plain_llm = make_llm(loopy)
    prompts = looping_prompts(plain_llm, len(params) - 1)
    prompts.append(prompts[0])
    plain = outputs(plain_llm, prompts, params)
    llm = make_llm(loopy, speculative_config=SPEC)
    assert_same(outputs(llm, prompts, params), plain)
    assert stats(llm).num_accepted_tokens > 80


def test_a_stop_or_max_tokens_inside_an_accepted_run_cuts_the_output_there(loopy,
                                                                           make_llm):
    """Stop tokens taken from the plain run's own output (so they hit mid-text, where
    runs of proposals are accepted), and every max_tokens from 1 to 24."""
    plain_llm = make_llm(loopy)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    texts = outputs(plain_llm, PROMPTS[:4], greedy)
    params = []
    for completions in texts:
        tokens = completions[0][0]
        params += [SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[t])
                   for t in tokens[5:24:6]]
    params += [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
               for m in range(1, 25)]
    prompts = [PROMPTS[i % 4] for i in range(len(params))]
    plain = outputs(plain_llm, prompts, params)
    llm = make_llm(loopy, speculative_config=SPEC)
    assert_same(outputs(llm, prompts, params), plain)
    assert any(c[0][1] == "stop" for c in plain)


def test_a_stop_string_inside_an_accepted_run_ends_the_tokens_there(loopy, make_llm):
    """The frontend takes a run of tokens one at a time: a stop string completed by a
    token in the middle of a run ends the text and the token ids there, as without
    proposals (and with the stop string kept, too)."""
    plain_llm = make_llm(loopy)
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    cases = []
    for prompt, out in zip(PROMPTS[:4], plain_llm.generate(PROMPTS[:4], greedy,
                                                           use_tqdm=False), strict=True):
        text = out.outputs[0].text
        cases += [(prompt, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                          stop=[text[i:i + 3]], logprobs=1,
                                          include_stop_str_in_output=keep))
                  for i in range(5, len(text) - 3, 7) for keep in (False, True)]
    llm = make_llm(loopy, speculative_config=SPEC)

    def run(engine: Any) -> list[Any]:
        outs = engine.generate([p for p, _ in cases], [sp for _, sp in cases],
                               use_tqdm=False)
        return [(c.text, c.token_ids, c.finish_reason, c.stop_reason, len(c.logprobs))
                for c in (o.outputs[0] for o in outs)]

    plain = run(plain_llm)
    assert run(llm) == plain
    assert sum(1 for c in plain if c[2] == "stop") > len(cases) // 2
    assert stats(llm).num_accepted_tokens > 20


def test_preemption_chunking_priorities_and_aborts_with_proposals(loopy, make_llm):
    """A KV cache a few requests fill (preemptions mid-run), a token budget that cuts
    proposals short and splits prompts, priority scheduling, and requests aborted while
    others speculate: the same tokens as without proposals, and every block comes back
    (make_llm checks)."""
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    prompts = [p * 2 for p in PROMPTS]
    probe = make_llm(loopy, block_size=8).engine_core.core.executor.runner
    options = {"kv_cache_memory_bytes": 64 * probe.kv_cache_bytes_per_block(),
               "max_num_batched_tokens": 24, "max_model_len": 400, "block_size": 8}
    plain = outputs(make_llm(loopy, **options), prompts, params)
    llm = make_llm(loopy, speculative_config=SPEC, scheduling_policy="priority",
                   **options)
    assert_same(outputs(llm, prompts, params), plain)
    assert llm.engine_core.core.scheduler.num_preemptions > 0
    assert stats(llm).num_accepted_tokens > 0
    core = llm.engine_core.core
    for i, prompt in enumerate(prompts[:4]):
        core.add_request(llm.input_processor.process_inputs(
            f"abort-{i}", prompt, params).engine_requests[0])
    for _ in range(8):
        core.step()
    assert stats(llm).num_drafts > 0
    core.abort_requests(["abort-0", "abort-1"])
    while core.has_work():
        core.step()


def test_speculation_stops_above_its_batch_size_and_beyond_free_seats(loopy, make_llm):
    """disable_by_batch_size: no proposals in a step with more running requests (unset on
    the CPU: 8); and a step never samples more positions than max_num_seqs (proposals
    take the seats no request waits for)."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm = make_llm(loopy, speculative_config={**SPEC, "disable_by_batch_size": 2})
    outputs(llm, PROMPTS[:3], params)  # three at once: never speculates
    assert stats(llm).num_drafts == 0
    outputs(llm, PROMPTS[:1], params)
    assert stats(llm).num_drafts > 0
    # Unset, on the CPU: 8 (enginecore/spec_decode.py's measured default).
    default = {k: v for k, v in SPEC.items() if k != "disable_by_batch_size"}
    llm = make_llm(loopy, speculative_config=default)
    outputs(llm, PROMPTS[:9], params)
    assert stats(llm).num_drafts == 0  # all 9 finish together: never 8 or fewer
    outputs(llm, PROMPTS[:8], params)
    assert stats(llm).num_drafts > 0
    seats = make_llm(loopy, speculative_config=SPEC, max_num_seqs=4)
    scheduler = seats.engine_core.core.scheduler
    schedule = scheduler.schedule
    most = []

    def counting() -> Any:
        out = schedule()
        spec = sum(len(d) for d in out.scheduled_spec_decode_tokens.values())
        most.append(len(out.num_scheduled_tokens) + spec)
        return out

    scheduler.schedule = counting
    assert_same(outputs(seats, PROMPTS[:6], params), outputs(make_llm(loopy), PROMPTS[:6],
                                                             params))
    assert max(most) <= 4 and stats(seats).num_drafts > 0


def chi2_critical_p001(df: int) -> float:
    """The chi-square distribution's 0.999 quantile (Wilson-Hilferty: within 1% from 3
    degrees of freedom; 24.5 for 7, where the tables say 24.32)."""
    z = 3.0902  # the standard normal's 0.999 quantile
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def _chi2_homogeneity(a: np.ndarray, b: np.ndarray) -> tuple[float, int]:
    """Two histograms over the same bins -> (chi-square, degrees of freedom), bins
    pooled until each expects at least 5."""
    order = np.argsort(-(a + b))
    a, b = a[order], b[order]
    pooled_a, pooled_b = [], []
    acc_a = acc_b = 0
    for x, y in zip(a.tolist(), b.tolist(), strict=True):
        acc_a += x
        acc_b += y
        if acc_a + acc_b >= 20:
            pooled_a.append(acc_a)
            pooled_b.append(acc_b)
            acc_a = acc_b = 0
    if acc_a + acc_b and pooled_a:
        pooled_a[-1] += acc_a
        pooled_b[-1] += acc_b
    table = np.array([pooled_a, pooled_b], dtype=float)
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    return float(((table - expected) ** 2 / expected).sum()), table.shape[1] - 1


def _histogram(llm: Any, prompt_ids: list[int], runs: int) -> np.ndarray:
    """Counts of the third token of `runs` unseeded samples (top-k 8) after the prompt."""
    params = SamplingParams(temperature=1.0, top_k=8, max_tokens=4, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": prompt_ids}] * runs, params, use_tqdm=False)
    counts = np.zeros(LOOPY.vocab_size, dtype=np.int64)
    for out in outs:
        counts[out.outputs[0].token_ids[2]] += 1
    return counts


def test_unseeded_samples_are_distributed_as_without_proposals(loopy, make_llm,
                                                                monkeypatch):
    """Chi-square homogeneity (p = 0.001) of the third token's distribution, with and
    without proposals, over 600 samples each; then the same check catches a verifier
    whose residual is wrong (one that keeps a rejected proposal instead of the sample
    that rejected it)."""
    from pagellm.executor.worker import model_runner

    seats = {"max_num_seqs": 1024}  # all 600 at once, with seats to spare for proposals
    plain_llm = make_llm(loopy, **seats)
    # A prompt that ends in the model's own greedy loop: proposals come often.
    greedy = plain_llm.generate(["hello world"], SamplingParams(
        temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)[0]
    prompt_ids = greedy.prompt_token_ids + greedy.outputs[0].token_ids
    plain = _histogram(plain_llm, prompt_ids, 600)
    llm = make_llm(loopy, speculative_config=SPEC, **seats)
    chi2, df = _chi2_homogeneity(plain, _histogram(llm, prompt_ids, 600))
    assert stats(llm).num_accepted_tokens > 20 and stats(llm).num_draft_tokens > \
        stats(llm).num_accepted_tokens
    assert df >= 3 and chi2 < chi2_critical_p001(df), (chi2, df)

    def keeps_the_proposal(samples: np.ndarray, proposals: np.ndarray) -> np.ndarray:
        k = len(proposals)
        accepted = int((samples[:k] == proposals).cumprod().sum()) if k else 0
        if accepted < k:  # wrong: the residual becomes the proposal itself
            return np.concatenate([samples[:accepted], proposals[accepted:accepted + 1]])
        return samples[:accepted + 1]

    monkeypatch.setattr(model_runner, "verify_proposals", keeps_the_proposal)
    chi2, df = _chi2_homogeneity(plain, _histogram(llm, prompt_ids, 600))
    assert chi2 > chi2_critical_p001(df), (chi2, df)


# -- a draft model's proposals -----------------------------------------------------------


def perturbed(model: Path, out: Path, scale: float) -> Path:
    """The model with every weight multiplied by 1 + N(0, scale) noise: a draft that
    agrees with it often, not always, as a real draft model does."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model, out)
    [weights] = out.glob("*.safetensors")
    generator = torch.Generator().manual_seed(0)
    save_file({name: t * (1 + scale * torch.randn(t.shape, generator=generator))
               for name, t in load_file(weights).items()}, weights)
    return out


@pytest.fixture(scope="module")
def drafts(loopy: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """speculative_configs: the model as its own draft (every greedy proposal right), and
    a perturbed copy of it."""
    noisy = perturbed(loopy, tmp_path_factory.mktemp("draft") / "noisy", 0.1)
    return {name: {"method": "draft_model", "model": str(path), "num_speculative_tokens": 3,
                   "disable_by_batch_size": 1024}
            for name, path in (("self", loopy), ("noisy", noisy))}


def test_a_draft_model_gives_transformers_greedy_tokens(loopy, drafts, make_llm):
    """Whatever the draft proposes: the target's tokens. The target as its own draft
    proposes the target's next tokens, so every proposal is accepted: which also says
    the draft's own KV cache (same block ids, other layers) holds what it should."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(loopy, dtype=torch.float32).eval()
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    references = []
    for name, config in drafts.items():
        llm = make_llm(loopy, speculative_config=config)
        if not references:
            for prompt in PROMPTS:
                ids = llm.tokenizer.encode(prompt)
                with torch.no_grad():
                    reference = model.generate(
                        torch.tensor([ids]), do_sample=False, max_new_tokens=40,
                        attention_mask=torch.ones(1, len(ids), dtype=torch.long))
                references.append(reference[0, len(ids):].tolist())
        got = outputs(llm, PROMPTS, params)
        assert [c[0][0] for c in got] == references, name
        s = stats(llm)
        if name == "self":  # (a near tie could round apart in a step of another shape)
            assert s.num_accepted_tokens >= 0.97 * s.num_draft_tokens > 200, vars(s)
        else:  # both ways: runs of accepted proposals, and rejections
            assert s.accepted_per_pos[1] > 0, vars(s)
            assert s.num_draft_tokens - s.num_accepted_tokens > 20, vars(s)


def test_a_draft_model_with_sampling_features_preemption_and_prefix_hits(
        loopy, drafts, make_llm):
    """The sampling features seeded (the tokens they give without proposals), then a
    KV cache a few requests fill (preemptions), a token budget that splits prompts,
    prefix-cache hits and aborts: the same tokens, every block back (make_llm checks),
    and the target as its own draft still has every proposal accepted: the draft's keys
    in prefix-cached blocks and in recomputed ones are right."""
    params = mixed_params()
    plain_llm = make_llm(loopy)
    prompts = looping_prompts(plain_llm, len(params) - 1)
    prompts.append(prompts[0])
    llm = make_llm(loopy, speculative_config=drafts["noisy"])
    assert_same(outputs(llm, prompts, params), outputs(plain_llm, prompts, params))
    assert stats(llm).num_accepted_tokens > 40

    greedy = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    shared = PROMPTS[2] * 3  # prefix-cache hits: the same long start
    long_prompts = [p * 2 for p in PROMPTS] + [shared + p for p in PROMPTS[:4]]
    per_block = make_llm(loopy, block_size=8, speculative_config=drafts["self"]
                         ).engine_core.core.executor.runner.kv_cache_bytes_per_block()
    # A block holds both models' keys and values (the draft is the target here).
    assert per_block == 2 * make_llm(loopy, block_size=8).engine_core.core.executor.runner \
        .kv_cache_bytes_per_block()
    options = {"kv_cache_memory_bytes": 52 * per_block,
               "max_num_batched_tokens": 24, "max_model_len": 400, "block_size": 8,
               "enable_prefix_caching": True}
    plain = outputs(make_llm(loopy, **options), long_prompts, greedy)
    llm = make_llm(loopy, speculative_config=drafts["self"], **options)
    assert_same(outputs(llm, long_prompts, greedy), plain)
    core = llm.engine_core.core
    assert core.scheduler.num_preemptions > 0
    assert core.scheduler.kv_cache_manager.prefix_cache_hits > 0
    s = stats(llm)
    assert s.num_accepted_tokens >= 0.97 * s.num_draft_tokens > 100, vars(s)
    for i, prompt in enumerate(long_prompts[:4]):
        core.add_request(llm.input_processor.process_inputs(
            f"abort-{i}", prompt, greedy).engine_requests[0])
    for _ in range(8):
        core.step()
    core.abort_requests(["abort-0", "abort-1"])
    while core.has_work():
        core.step()


def test_a_draft_model_idle_above_its_batch_size_catches_up_after(loopy, drafts, make_llm):
    """Above disable_by_batch_size the draft computes nothing; when proposals resume, it
    first computes what it missed (more than a step's token budget: in pieces), so the
    target as its own draft still has nearly every proposal accepted."""
    config = {**drafts["self"], "disable_by_batch_size": 2}
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
              for m in (6, 10, 60, 60)]
    prompts = [p * 2 for p in PROMPTS[:4]]
    options = {"max_num_batched_tokens": 32, "max_num_seqs": 8, "max_model_len": 400}
    plain = outputs(make_llm(loopy, **options), prompts, params)
    llm = make_llm(loopy, speculative_config=config, **options)
    drafter = llm.engine_core.core.executor.runner.drafter
    asked, computed = [], []
    catch_up, forward = drafter._forward, drafter.model.forward

    def asking(*args: Any, **kwargs: Any) -> Any:
        asked.append(int((args[3] - args[2]).sum()))  # positions to compute
        return catch_up(*args, **kwargs)

    def computing(input_ids: torch.Tensor, *args: Any) -> Any:
        computed.append(len(input_ids))
        return forward(input_ids, *args)

    drafter._forward, drafter.model.forward = asking, computing
    assert_same(outputs(llm, prompts, params), plain)
    s = stats(llm)
    assert s.num_accepted_tokens >= 0.97 * s.num_draft_tokens > 60, vars(s)
    assert max(asked) > 32 >= max(computed)  # a catch-up past the budget, in pieces


def test_a_draft_model_computes_again_only_what_the_target_rejected(loopy, drafts,
                                                                    make_llm):
    """The draft wrote its proposals' keys when it made them: after a verification, the
    accepted ones are kept, so each step's first pass computes at most the last proposal
    (all accepted: the draft never saw it as an input) and the new token."""
    llm = make_llm(loopy, speculative_config=drafts["self"])
    drafter = llm.engine_core.core.executor.runner.drafter
    first_passes = []
    forward = drafter._forward

    def recording(batch: Any, rows: Any, starts: Any, stops: Any, *rest: Any) -> Any:
        if len(rest) == 2:  # pass 1 (the others carry their input ids)
            first_passes.append((stops - starts).tolist())
        return forward(batch, rows, starts, stops, *rest)

    drafter._forward = recording
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outputs(llm, PROMPTS[2:3], params)
    assert first_passes[0][0] > 10  # the prompt
    assert len(first_passes) > 8 and all(n <= 2 for [n] in first_passes[1:]), first_passes


def test_two_ranks_draft_and_verify_as_one(loopy, drafts):
    """Tensor parallelism: the draft model is split over both workers as the target is,
    the proposals go to both in the scheduler's output (as n-gram ones do), each rank
    verifies alike, and rank 0's tokens are those of one rank without proposals."""
    from pagellm import LLM

    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    with LLM(str(loopy), kv_cache_memory_bytes=KV, tensor_parallel_size=2,
             speculative_config=drafts["noisy"]) as llm:
        got = outputs(llm, PROMPTS[:4], params)
        assert llm.get_stats().spec_num_accepted_tokens > 10
    with LLM(str(loopy), kv_cache_memory_bytes=KV, multiprocess=False) as llm:
        assert_same(got, outputs(llm, PROMPTS[:4], params))


def test_a_draft_model_of_another_vocabulary_is_refused_by_name(loopy, tmp_path):
    from pagellm import LLM

    other = make_model(tmp_path / "other", ModelSpec(vocab_size=512))
    with pytest.raises(ValueError, match="vocab_size 512 differs from the model's 1024"):
        LLM(str(loopy), multiprocess=False, kv_cache_memory_bytes=KV,
            speculative_config={"model": str(other), "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match=r"speculative_config\.model=.*not found"):
        LLM(str(loopy), multiprocess=False, kv_cache_memory_bytes=KV,
            speculative_config={"model": str(tmp_path / "nowhere"),
                                "num_speculative_tokens": 2})


# -- structured outputs ------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_constrained_requests_take_proposals_and_keep_their_tokens(loopy, drafts, make_llm,
                                                                   backend):
    """A constrained request is proposed only tokens its grammar allows (never one that
    completes it), and gets one bitmask row per position it samples (the grammar
    advanced through the proposals before it): the same tokens as without proposals,
    greedy and seeded, with min_tokens, for both methods; and n-gram proposals are
    accepted (the draft model drafts without the grammar's mask: its proposals are cut
    where the grammar refuses one)."""
    from pagellm import StructuredOutputsParams

    items = {"type": "array", "items": {"type": "string", "enum": ["alpha", "beta"]},
             "minItems": 6, "maxItems": 12}
    constraints = [StructuredOutputsParams(json=items),
                   StructuredOutputsParams(regex="(the cat |a dog ){4,10}"),
                   StructuredOutputsParams(choice=["yes", "no"]),
                   StructuredOutputsParams(json_object=True)]
    params = [SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=c)
              for c in constraints]
    params += [SamplingParams(temperature=0.02, seed=3 + i, max_tokens=60, logprobs=1,
                              min_tokens=8 if i == 1 else 0, structured_outputs=c)
               for i, c in enumerate(constraints)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    options = {"structured_outputs_config": {"backend": backend}}
    plain = outputs(make_llm(loopy, **options), prompts, params)
    assert any(c[0][1] == "stop" for c in plain)  # grammars completed, too
    for config in (SPEC, drafts["noisy"]):
        llm = make_llm(loopy, speculative_config=config, **options)
        assert_same(outputs(llm, prompts, params), plain)
        if config is SPEC:
            assert stats(llm).num_accepted_tokens > 40
