"""The batched sampler on fixed logits, against hand computations and statistics."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from pagellm.executor.worker.sampler import (
    Penalties,
    Sampler,
    SamplingMetadata,
    apply_min_p,
    apply_top_k_top_p,
    argmax_rows,
    mix_seed,
    step_peak_bytes,
)

# Our code and torch alone: the floors leg skips it (.ci/run).
pytestmark = pytest.mark.own_code

CPU = torch.device("cpu")


def _meta(batch: int, temperature: float | list[float], **kwargs: Any) -> SamplingMetadata:
    temps = temperature if isinstance(temperature, list) else [temperature] * batch
    t = torch.tensor(temps, dtype=torch.float32)
    return SamplingMetadata(temperature=t, all_greedy=bool((t == 0).all()),
                            any_greedy=bool((t == 0).any()), **kwargs)


def sample(sampler: Sampler, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    return sampler(logits, meta).sampled


def test_greedy_rows_take_the_argmax() -> None:
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.9], [5.0, 0.0, 0.0, 0.0]])
    assert sample(Sampler(CPU, 0), logits, _meta(2, 0.0)).tolist() == [1, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_is_each_rows_first_maximal_index(dtype: torch.dtype) -> None:
    """Ties (small integers), an all -inf row, NaN (which wins, as in argmax) and a
    strided view, against the first maximal index found by hand."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(-3, 4, (40, 2 * 3001), generator=gen).float()[:, ::2]
    x[0] = -math.inf
    x[1, 7] = x[1, 2000] = math.nan
    x = x.to(dtype)

    def first_max(row: list[float]) -> int:
        if any(math.isnan(v) for v in row):
            return next(i for i, v in enumerate(row) if math.isnan(v))
        return row.index(max(row))

    assert argmax_rows(x).tolist() == [first_max(r) for r in x.float().tolist()]


def test_greedy_and_random_rows_mix_in_one_batch() -> None:
    logits = torch.tensor([[0.0, 9.0, 0.0], [0.0, 0.0, 0.0]])
    out = sample(Sampler(CPU, 0), logits, _meta(2, [0.0, 1.0], top_k=torch.tensor([3, 1])))
    assert out[0].item() == 1
    assert out[1].item() in (0, 1, 2)


def test_banned_tokens_are_never_chosen() -> None:
    logits = torch.tensor([[0.0, 9.0, 8.0]])
    banned = (torch.tensor([0]), torch.tensor([1]))
    assert sample(Sampler(CPU, 0), logits, _meta(1, 0.0, banned=banned)).tolist() == [2]


def test_top_k_keeps_exactly_the_k_largest() -> None:
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0, 0.0], [1.0, 4.0, 3.0, 2.0, 0.0]])
    masked = apply_top_k_top_p(logits, torch.tensor([2, 5]), None)
    inf = -math.inf
    assert masked.tolist() == [[inf, 4.0, 3.0, inf, inf], [1.0, 4.0, 3.0, 2.0, 0.0]]


def test_top_p_keeps_the_smallest_nucleus_reaching_p() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    # 0.5 < 0.7 <= 0.5 + 0.3: the nucleus is the two most likely tokens.
    kept = apply_top_k_top_p(logits, None, torch.tensor([0.7])).isfinite()
    assert kept.tolist() == [[True, True, False, False]]
    # p just above 0.95 needs all four; a tiny p still keeps the most likely one.
    assert apply_top_k_top_p(logits, None, torch.tensor([0.96])).isfinite().all()
    tiny = apply_top_k_top_p(logits, None, torch.tensor([1e-6])).isfinite()
    assert tiny.tolist() == [[True, False, False, False]]


def test_min_p_drops_tokens_below_the_scaled_maximum() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    out = apply_min_p(probs, torch.tensor([0.2]))  # threshold 0.1
    assert torch.equal(out, torch.tensor([[0.5, 0.3, 0.15, 0.0]]))


def test_masked_tokens_are_never_sampled() -> None:
    torch.manual_seed(0)
    logits = torch.randn(256, 50)
    top3 = logits.topk(3, dim=-1).indices
    out = sample(Sampler(CPU, 0), logits, _meta(256, 1.5, top_k=torch.full((256,), 3)))
    assert (out[:, None] == top3).any(dim=-1).all()


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_frequencies_match_softmax_at_temperature(temperature: float) -> None:
    """Chi-square goodness of fit over 40,000 draws from fixed logits (fixed seed)."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, 1.5])
    draws, batch = 40_000, 2_000
    sampler = Sampler(CPU, seed=1234)
    counts = torch.zeros(len(logits))
    for _ in range(draws // batch):
        out = sample(sampler, logits.expand(batch, -1).clone(), _meta(batch, temperature))
        counts += torch.bincount(out, minlength=len(logits)).float()
    expected = torch.softmax(logits / temperature, dim=-1) * draws
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 24.32  # chi-square critical value, 7 degrees of freedom, p = 0.001


def test_seeded_row_is_independent_of_its_batch() -> None:
    torch.manual_seed(1)
    logits = torch.randn(65, 100)
    seed = mix_seed(42, 7)
    alone = sample(Sampler(CPU, 0), logits[:1].clone(), _meta(1, 1.0, seeds={0: seed}))
    batch = sample(Sampler(CPU, 99), logits.clone(), _meta(65, 1.0, seeds={0: seed}))
    assert alone[0] == batch[0]
    draws = {int(sample(Sampler(CPU, 0), logits[:1].clone(),
                        _meta(1, 1.0, seeds={0: mix_seed(42, p)}))[0]) for p in range(40)}
    assert len(draws) > 5  # different positions draw different noise


def test_mix_seed_separates_nearby_inputs() -> None:
    values = {mix_seed(s, p) for s in range(50) for p in range(50)}
    assert len(values) == 2500 and all(0 <= v < 2**63 for v in values)


def test_top_p_never_samples_outside_the_nucleus() -> None:
    torch.manual_seed(2)
    logits = torch.randn(256, 50) * 2
    probs = logits.softmax(dim=-1)
    out = sample(Sampler(CPU, 3), logits.clone(),
                 _meta(256, 1.0, top_p=torch.full((256,), 0.6)))
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass above each token
    for row in range(256):
        nucleus = set(order[row][before[row] < 0.6].tolist())
        assert int(out[row]) in nucleus


def _peak_cpu_bytes(fn: Callable[[], None]) -> int:
    """The most bytes `fn` held at once on the CPU: a running sum of torch's allocation
    and free events, as its profiler records them."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]"), key=lambda e: e.start_ns())
    held = peak = 0
    for event in events:
        held += event.nbytes()
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("every_stage", [False, True])
def test_step_peak_bytes_bounds_what_one_step_of_sampling_holds(every_stage: bool) -> None:
    """On the CPU the engine sizes memory for the logits with `step_peak_bytes` (nothing
    profiles a step there): it must cover the LM head's bf16 output, the penalties'
    tensors and every stage's working copies, measured by torch's profiler, and not
    overstate them by much (it would refuse configurations that fit)."""
    rows, vocab, hidden = 32, 20_000, 16
    states = torch.randn(rows, hidden, dtype=torch.bfloat16)
    head = torch.randn(vocab, hidden, dtype=torch.bfloat16)
    ids = torch.arange(rows)

    def step() -> None:
        logits = states @ head.T  # [rows, vocab] bf16, as the LM head returns it
        extra = {}
        if every_stage:
            penalties = Penalties(ids, torch.ones(rows), torch.ones(rows),
                                  torch.full((rows,), 1.1),
                                  torch.zeros(rows, vocab, dtype=torch.bool),
                                  torch.zeros(rows, vocab))
            extra = dict(min_p=torch.full((rows,), 0.05), banned=(ids, ids),
                         allowed=(ids.repeat(3), torch.arange(3 * rows)),
                         logit_bias=(ids, ids, torch.ones(rows)), penalties=penalties,
                         logprob_rows=ids, num_logprobs=5, seeds={0: 1})
        meta = _meta(rows, 0.9, top_k=torch.full((rows,), 50),
                     top_p=torch.full((rows,), 0.9), **extra)
        Sampler(CPU, 0)(logits, meta)

    peak = _peak_cpu_bytes(step)
    assert peak <= step_peak_bytes(rows, vocab)
    if every_stage:
        assert peak >= 0.8 * step_peak_bytes(rows, vocab)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [[0, 1, 2, 3, 4, 5, 6, 7, 8, 9], [9, 2, 5], [3]])
def test_the_cpu_grammar_mask_equals_xgrammars_kernel(dtype: torch.dtype,
                                                      rows: list[int]) -> None:
    """Structured outputs' CPU apply (grammar_mask.apply_bitmask_cpu) against xgrammar's
    own apply kernel on random bitmasks: rows given and not, a vocabulary that is not a
    multiple of 32, bit 31 (the sign) included."""
    import xgrammar as xgr

    from pagellm.executor.worker.grammar_mask import apply_bitmask_cpu

    generator = torch.Generator().manual_seed(len(rows))
    vocab = 1000
    logits = torch.randn(10, vocab, generator=generator).to(dtype)
    bitmask = torch.randint(-2**31, 2**31 - 1, (len(rows), -(-vocab // 32)),
                            dtype=torch.int32, generator=generator)
    ours = logits.clone()
    apply_bitmask_cpu(ours, bitmask, rows)
    full = torch.full((10, bitmask.shape[1]), -1, dtype=torch.int32)
    full[rows] = bitmask
    reference = logits.clone()
    xgr.apply_token_bitmask_inplace(reference, full, indices=rows, vocab_size=vocab)
    assert torch.equal(ours, reference)
    assert bool(torch.isinf(ours[rows]).any()) and not bool(torch.isinf(
        ours[[r for r in range(10) if r not in rows]]).any())


@pytest.mark.parametrize("processed", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logprobs_of_peaked_rows_over_a_large_vocabulary_are_unbiased(processed: bool,
                                                                      temperature: float
                                                                      ) -> None:
    """A trained model's rows (a few dominant tokens over a 49k vocabulary, SmolLM2's):
    the logprobs the sampler returns equal the fp64 log-softmax of the same logits
    without bias. torch's CPU `log_softmax` summed the exponentials lane by lane in fp32
    and lost the tail, so every logprob came out high by the same amount (+1.9e-5 on
    average here): a trainer normalizing accurately (TRL) saw its importance ratio
    exp(sum(logp_trainer - logp_engine)) below 1 in every sample."""
    rows, vocab = 64, 49_152
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=generator) * 3
    logits[:, 7] += 18  # the likely token, and a runner-up somewhere else
    logits[torch.arange(rows), torch.randint(0, vocab, (rows,), generator=generator)] += 16
    exact = logits.double().log_softmax(dim=-1)
    meta = _meta(rows, temperature, logprob_rows=torch.arange(rows), num_logprobs=3,
                 processed_logprobs=processed)
    out = Sampler(CPU, 0)(logits.clone(), meta)
    assert out.logprobs is not None
    error = out.logprobs.logprobs.double() - exact.gather(1, out.logprobs.token_ids)
    # Was +1.9e-5 on average (at most 4e-5); now ~1e-8, and at most the fp32 rounding
    # of a logprob down to -16 (half an ulp: 1e-6).
    assert abs(float(error.mean())) < 1e-7, float(error.mean())
    assert float(error.abs().max()) < 2e-6, float(error.abs().max())
