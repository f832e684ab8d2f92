"""Token-for-token comparisons of two engines on the same prompts: what a feature that
changes how steps run (speculative decoding, asynchronous scheduling) must leave
unchanged."""

from __future__ import annotations

from typing import Any

from conftest import PROMPTS

from pagellm import SamplingParams


def outputs(llm: Any, prompts: list[Any], params: Any) -> list[list[tuple[Any, ...]]]:
    """Per prompt, per completion: (token ids, finish reason, stop reason, logprobs)."""
    result = []
    for request in llm.generate(prompts, params, use_tqdm=False):
        result.append([(c.token_ids, c.finish_reason, c.stop_reason,
                        None if c.logprobs is None else
                        [{t: lp.logprob for t, lp in d.items()} for d in c.logprobs])
                       for c in request.outputs])
    return result


def assert_same(got: list[list[tuple[Any, ...]]], expected: list[list[tuple[Any, ...]]]
                ) -> None:
    """Equal tokens, finish and stop reasons; logprobs of the same tokens within 1e-4
    (a position's logits computed in a step of another shape round differently)."""
    assert len(got) == len(expected)
    for i, (completions, wanted) in enumerate(zip(got, expected, strict=True)):
        assert [c[:3] for c in completions] == [w[:3] for w in wanted], i
        for c, w in zip(completions, wanted, strict=True):
            assert (c[3] is None) == (w[3] is None), i
            for position, (a, b) in enumerate(zip(c[3] or [], w[3] or [], strict=True)):
                assert a.keys() == b.keys() and all(
                    abs(a[t] - b[t]) < 1e-4 for t in a), (i, position, a, b)


def mixed_params() -> list[SamplingParams]:
    """One of each feature whose sampling depends on the position (seeds, penalties over
    the output so far, min_tokens' bans, bad words after their prefix) or not
    (top-k/top-p/min-p, logit bias, allowed ids, logprobs), seeded so that tokens, not
    only distributions, must agree. Temperatures are low (the test model's logits are
    small: at 0.3 it samples nearly uniformly and no proposal is ever accepted), so that
    positions after accepted proposals, where the offsets count, are sampled often."""
    base = {"max_tokens": 32, "ignore_eos": True}
    return [
        SamplingParams(temperature=0.0, logprobs=3, **base),
        SamplingParams(temperature=0.02, top_k=20, top_p=0.9, seed=11, logprobs=2, **base),
        SamplingParams(temperature=0.03, min_p=0.05, seed=12, **base),
        SamplingParams(temperature=0.02, seed=13, repetition_penalty=1.02,
                       frequency_penalty=0.002, presence_penalty=0.001, **base),
        SamplingParams(temperature=0.0, repetition_penalty=1.2, **base),
        SamplingParams(temperature=0.02, seed=17, min_tokens=12,
                       stop_token_ids=[955, 875, 299, 631, 532], max_tokens=32),
        SamplingParams(temperature=0.02, seed=14, logit_bias={875: 0.01, 364: 0.005},
                       **base),
        SamplingParams(temperature=0.02, seed=15, allowed_token_ids=list(range(200, 700)),
                       **base),
        SamplingParams(temperature=0.0, bad_words=["hello world"], **base),
        SamplingParams(temperature=0.02, seed=16, n=2, **base),
        SamplingParams(temperature=0.8, seed=18, top_k=50, **base),
    ]


def looping_prompts(llm: Any, count: int) -> list[dict[str, list[int]]]:
    """Prompts that end in the model's own greedy text: it goes on looping, so
    proposals are accepted often, also for random requests at a low temperature (the
    positions after an accepted proposal are where the features' offsets count)."""
    greedy = llm.generate(PROMPTS[:count], SamplingParams(temperature=0.0, max_tokens=16,
                                                          ignore_eos=True), use_tqdm=False)
    return [{"prompt_token_ids": g.prompt_token_ids + g.outputs[0].token_ids} for g in greedy]
