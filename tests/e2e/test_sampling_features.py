"""vLLM's sampling and output features: logprobs and prompt logprobs against
transformers' logits, penalties against transformers' logits processors, masks and
text handling end to end, and a matrix of bad inputs."""

from __future__ import annotations

import math

import pytest
import torch

from pagellm import SamplingParams
from pagellm.executor.worker.sampler import Penalties, apply_penalties

PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def hf_models(model_dirs):
    from transformers import AutoModelForCausalLM

    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = AutoModelForCausalLM.from_pretrained(
                model_dirs[name], dtype=torch.float32).eval()
        return cache[name]

    return get


def hf_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at every position: [len, vocab]."""
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float().log_softmax(dim=-1)


def rank_of(row: torch.Tensor, token: int) -> int:
    return int((row > row[token]).sum()) + 1


# --- logprobs ---------------------------------------------------------------------------


def test_greedy_logprobs_equal_transformers_log_softmax(model_dirs, hf_models, make_llm):
    llm = make_llm(model_dirs["llama"])
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=12, logprobs=5),
                       use_tqdm=False)[0]
    completion = out.outputs[0]
    reference = hf_logprobs(hf_models("llama"), out.prompt_token_ids + completion.token_ids)
    start = len(out.prompt_token_ids) - 1
    assert len(completion.logprobs) == len(completion.token_ids)
    total = 0.0
    for j, (token, position) in enumerate(zip(completion.token_ids, completion.logprobs,
                                              strict=True)):
        row = reference[start + j]
        assert position[token].rank == 1  # greedy picks the most likely token
        assert abs(position[token].logprob - float(row[token])) < 1e-4
        top_lp, top_ids = row.topk(5)
        assert set(position) == set(top_ids.tolist()) | {token}
        for lp, tid in zip(top_lp.tolist(), top_ids.tolist(), strict=True):
            assert abs(position[tid].logprob - lp) < 1e-4
        assert position[token].decoded_token == llm.tokenizer.decode([token])
        total += float(row[token])
    assert abs(completion.cumulative_logprob - total) < 1e-3


@pytest.mark.parametrize("budget", [2048, 8])  # whole prompt, or chunks of 8 tokens
def test_prompt_logprobs_equal_transformers(model_dirs, hf_models, make_llm, budget):
    llm = make_llm(model_dirs["qwen3"], max_num_batched_tokens=budget)
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=2,
                                              prompt_logprobs=3), use_tqdm=False)[0]
    ids = out.prompt_token_ids
    reference = hf_logprobs(hf_models("qwen3"), ids)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for i in range(1, len(ids)):
        position, row = out.prompt_logprobs[i], reference[i - 1]
        assert abs(position[ids[i]].logprob - float(row[ids[i]])) < 1e-4
        assert position[ids[i]].rank == rank_of(row, ids[i])
        assert set(row.topk(3).indices.tolist()) <= set(position)


def test_prompt_logprobs_are_not_sent_twice_after_a_cache_hit(model_dirs, make_llm):
    llm = make_llm(model_dirs["llama"])
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1)
    first, second = (llm.generate(PROMPT * 3, params, use_tqdm=False)[0] for _ in range(2))
    # A request that wants prompt logprobs skips the prefix cache and recomputes them.
    assert len(second.prompt_logprobs) == len(first.prompt_logprobs)
    assert [p and sorted(p) for p in first.prompt_logprobs] == \
        [p and sorted(p) for p in second.prompt_logprobs]


def test_processed_logprobs_follow_temperature_and_top_k(model_dirs, hf_models, make_llm):
    llm = make_llm(model_dirs["qwen2"], logprobs_mode="processed_logprobs")
    params = SamplingParams(temperature=0.7, top_k=5, seed=3, max_tokens=6, logprobs=2)
    out = llm.generate(PROMPT, params, use_tqdm=False)[0]
    completion = out.outputs[0]
    reference_logits = hf_models("qwen2")(
        torch.tensor([out.prompt_token_ids + completion.token_ids])).logits[0].detach()
    start = len(out.prompt_token_ids) - 1
    for j, token in enumerate(completion.token_ids):
        scaled = reference_logits[start + j] / 0.7
        kth = scaled.topk(5).values[-1]
        processed = scaled.masked_fill(scaled < kth, float("-inf")).log_softmax(dim=-1)
        assert abs(completion.logprobs[j][token].logprob - float(processed[token])) < 1e-4
        assert completion.logprobs[j][token].rank <= 5


def test_logprobs_above_max_logprobs_are_refused(model_dirs, make_llm):
    llm = make_llm(model_dirs["llama"], max_logprobs=3)
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=f"{field}=4 .*max_logprobs"):
            llm.generate(PROMPT, SamplingParams(**{field: 4}), use_tqdm=False)


# --- penalties on fixed logits ------------------------------------------------------------


def _penalties(prompt: list[list[int]], output: list[list[int]], vocab: int, presence=0.0,
               frequency=0.0, repetition=1.0) -> Penalties:
    rows = len(prompt)
    prompt_mask = torch.zeros(rows, vocab, dtype=torch.bool)
    counts = torch.zeros(rows, vocab)
    for r in range(rows):
        prompt_mask[r, prompt[r]] = True
        for t in output[r]:
            counts[r, t] += 1
    return Penalties(torch.arange(rows), torch.full((rows,), presence),
                     torch.full((rows,), frequency), torch.full((rows,), repetition),
                     prompt_mask, counts)


def test_repetition_penalty_equals_transformers_processor():
    from transformers import RepetitionPenaltyLogitsProcessor

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 50, generator=gen) * 3
    prompt, output = [[1, 2, 3, 40], [7, 7, 8]], [[3, 5, 5], [9, 10, 7]]
    ours = apply_penalties(logits.clone(), _penalties(prompt, output, 50, repetition=1.3))
    hf = torch.stack([RepetitionPenaltyLogitsProcessor(1.3)(
        torch.tensor([p + o]), logits[r:r + 1].clone())[0]
        for r, (p, o) in enumerate(zip(prompt, output, strict=True))])
    torch.testing.assert_close(ours, hf, rtol=0, atol=0)


def test_presence_and_frequency_penalties_count_only_the_output():
    logits = torch.zeros(1, 6)
    # Output: token 2 three times, token 4 once; token 1 only in the prompt.
    ours = apply_penalties(logits.clone(), _penalties([[1]], [[2, 2, 4, 2]], 6,
                                                      presence=0.5, frequency=0.25))
    expected = torch.tensor([[0.0, 0.0, -(0.5 + 3 * 0.25), 0.0, -(0.5 + 0.25), 0.0]])
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)


def test_negative_penalties_encourage_repetition():
    ours = apply_penalties(torch.zeros(1, 3), _penalties([[0]], [[1, 1]], 3, presence=-1.0,
                                                         frequency=-0.5))
    assert ours[0].tolist() == [0.0, 2.0, 0.0]


def test_penalties_change_greedy_output_end_to_end(model_dirs, hf_models, make_llm):
    from transformers import RepetitionPenaltyLogitsProcessor

    llm = make_llm(model_dirs["llama"])
    ids = llm.tokenizer.encode(PROMPT)
    params = SamplingParams(temperature=0.0, max_tokens=16, repetition_penalty=1.5)
    got = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    model = hf_models("llama")
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=16,
                             logits_processor=[RepetitionPenaltyLogitsProcessor(1.5)],
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    assert got.outputs[0].token_ids == out[0, len(ids):].tolist()


# --- masks and biases, end to end ----------------------------------------------------------


def test_allowed_token_ids_confine_the_output(model_dirs, make_llm):
    llm = make_llm(model_dirs["qwen2"])
    allowed = [100, 200, 300, 400]
    for temperature in (0.0, 1.0):
        out = llm.generate(PROMPT, SamplingParams(temperature=temperature, seed=1,
                                                  max_tokens=12, allowed_token_ids=allowed),
                           use_tqdm=False)[0].outputs[0]
        assert out.token_ids and set(out.token_ids) <= set(allowed)


def test_logit_bias_moves_greedy_choices(model_dirs, make_llm):
    llm = make_llm(model_dirs["qwen2"])
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=6,
                                              logit_bias={321: 100.0}),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [321] * 6
    base = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=6),
                        use_tqdm=False)[0].outputs[0]
    banned = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=6,
                                                 logit_bias={base.token_ids[0]: -100.0}),
                          use_tqdm=False)[0].outputs[0]
    assert banned.token_ids[0] != base.token_ids[0]


def test_bad_words_are_never_completed(model_dirs, make_llm):
    llm = make_llm(model_dirs["llama"])
    tok = llm.tokenizer
    base = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=24),
                        use_tqdm=False)[0].outputs[0]
    # A one-token word: the token itself is banned.
    single = next(t for t in base.token_ids if tok.encode(tok.decode([t])) == [t]
                  and tok.decode([t]).strip())
    word = tok.decode([single]).strip()
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=24,
                                              bad_words=[word]), use_tqdm=False)[0].outputs[0]
    banned = {ids[-1] for ids in (tok.encode(word), tok.encode(" " + word)) if len(ids) == 1}
    assert single in banned and not banned & set(out.token_ids)


def test_multi_token_bad_words_are_never_completed(model_dirs, make_llm):
    """A word of several tokens: its last token is banned wherever the others end the
    output. The greedy output held the word; with it banned, neither spelling the
    engine bans (alone, after a space) occurs anywhere in the output."""
    llm = make_llm(model_dirs["llama"])
    tok = llm.tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=24)
    base = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids
    word = next(tok.decode(base[k:k + 3]) for k in range(len(base) - 2)
                if tok.encode(tok.decode(base[k:k + 3]), add_special_tokens=False)
                == base[k:k + 3])
    bad = params.clone(bad_words=[word])
    banned = llm.input_processor.process_inputs("x", PROMPT, bad).engine_requests[0] \
        .bad_words_token_ids
    assert any(len(ids) == 3 for ids in banned)
    out = llm.generate(PROMPT, bad, use_tqdm=False)[0].outputs[0].token_ids
    assert out != base
    for ids in banned:
        assert not any(out[i:i + len(ids)] == ids for i in range(len(out))), (ids, out)


def test_min_tokens_holds_back_eos_and_stop_tokens(model_dirs, make_llm):
    llm = make_llm(model_dirs["qwen2"])
    base = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=20),
                        use_tqdm=False)[0].outputs[0]
    stop = base.token_ids[2]
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=20, min_tokens=8,
                                              stop_token_ids=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert stop not in out.token_ids[:8] and len(out.token_ids) >= 8


def test_truncate_prompt_tokens_keeps_the_tail(model_dirs, hf_reference, make_llm):
    llm = make_llm(model_dirs["llama"])
    ids = llm.tokenizer.encode(PROMPT)
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8,
                                              truncate_prompt_tokens=4), use_tqdm=False)[0]
    assert out.prompt_token_ids == ids[-4:]
    assert out.outputs[0].token_ids == hf_reference("llama", ids[-4:], 8)


# --- text ------------------------------------------------------------------------------------


def test_detokenize_false_gives_token_ids_only(model_dirs, make_llm):
    llm = make_llm(model_dirs["llama"])
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1)
    with_text = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    ids_only = llm.generate(PROMPT, params.clone(detokenize=False),
                            use_tqdm=False)[0].outputs[0]
    assert ids_only.token_ids == with_text.token_ids and ids_only.text == ""
    assert all(lp.decoded_token is None for p in ids_only.logprobs for lp in p.values())
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(detokenize=False, stop=["x"])


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens_both_ways(model_dirs, make_llm, skip):
    llm = make_llm(model_dirs["llama"])
    # Force <|im_start|> (id 1, special, not a stop token) four times.
    params = SamplingParams(temperature=0.0, max_tokens=4, logit_bias={1: 100.0},
                            skip_special_tokens=skip, spaces_between_special_tokens=False)
    out = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [1, 1, 1, 1]
    assert out.text == ("" if skip else "<|im_start|>" * 4)
    assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=skip)


def test_stop_string_spanning_two_tokens(model_dirs, make_llm):
    llm = make_llm(model_dirs["llama"])
    tok = llm.tokenizer
    base = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=30),
                        use_tqdm=False)[0].outputs[0]
    pieces = [tok.decode([t]) for t in base.token_ids]
    j = next(i for i in range(3, len(pieces) - 1) if pieces[i].strip() and
             pieces[i + 1].strip() and "\ufffd" not in pieces[i] + pieces[i + 1])
    stop = pieces[j][-2:] + pieces[j + 1][:2]  # ends one token, starts the next
    cut = base.text.find(stop)
    for include in (False, True):
        out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=30,
                                                  stop=[stop],
                                                  include_stop_str_in_output=include),
                           use_tqdm=False)[0].outputs[0]
        assert out.text == base.text[:cut + (len(stop) if include else 0)]
        assert out.stop_reason == stop


# --- the bad-input matrix -----------------------------------------------------------------

NAN, INF = math.nan, math.inf
BAD_SAMPLING = [  # (SamplingParams kwargs, error, text the message must contain)
    ({"n": 0}, ValueError, "n must be >= 1"),
    ({"n": "2"}, TypeError, "n must be an integer"),
    ({"temperature": -1.0}, ValueError, "temperature"),
    ({"temperature": NAN}, ValueError, "temperature must be a finite"),
    ({"temperature": INF}, ValueError, "temperature must be a finite"),
    ({"temperature": [1.0]}, TypeError, "temperature must be a number"),
    ({"top_p": 0.0}, ValueError, "top_p must be > 0"),
    ({"top_p": 1.01}, ValueError, "top_p must be <= 1"),
    ({"top_p": NAN}, ValueError, "top_p"),
    ({"top_k": -5}, ValueError, "top_k must be >= -1"),
    ({"top_k": 1.5}, TypeError, "top_k must be an integer"),
    ({"min_p": -0.1}, ValueError, "min_p"),
    ({"min_p": INF}, ValueError, "min_p"),
    ({"seed": 1.5}, TypeError, "seed must be an integer"),
    ({"presence_penalty": 2.5}, ValueError, "presence_penalty must be <= 2"),
    ({"presence_penalty": NAN}, ValueError, "presence_penalty"),
    ({"frequency_penalty": -3.0}, ValueError, "frequency_penalty must be >= -2"),
    ({"frequency_penalty": "high"}, TypeError, "frequency_penalty must be a number"),
    ({"repetition_penalty": 0.0}, ValueError, "repetition_penalty must be > 0"),
    ({"repetition_penalty": INF}, ValueError, "repetition_penalty"),
    ({"logit_bias": {5: 101.0}}, ValueError, "logit_bias"),
    ({"logit_bias": {5: NAN}}, ValueError, "logit_bias"),
    ({"logit_bias": {"5": 1.0}}, TypeError, "logit_bias token id"),
    ({"logit_bias": [5, 1.0]}, TypeError, "logit_bias must be a dict"),
    ({"allowed_token_ids": []}, ValueError, "allowed_token_ids must not be empty"),
    ({"allowed_token_ids": [1, -1]}, ValueError, "allowed_token_ids"),
    ({"allowed_token_ids": 5}, TypeError, "allowed_token_ids must be a list"),
    ({"bad_words": [""]}, ValueError, "bad_words entries must be non-empty"),
    ({"bad_words": [3]}, TypeError, "bad_words entries must be strings"),
    ({"stop": ["ok", ""]}, ValueError, "stop entries must be non-empty"),
    ({"stop": [None]}, TypeError, "stop entries must be strings"),
    ({"stop": 7}, TypeError, "stop must be a string or a list"),
    ({"stop_token_ids": [1.0]}, TypeError, "stop_token_ids entry must be an integer"),
    ({"ignore_eos": "yes"}, TypeError, "ignore_eos must be a bool"),
    ({"max_tokens": 0}, ValueError, "max_tokens must be >= 1"),
    ({"max_tokens": 2.5}, TypeError, "max_tokens must be an integer"),
    ({"min_tokens": -1}, ValueError, "min_tokens must be >= 0"),
    ({"min_tokens": 9, "max_tokens": 3}, ValueError, r"min_tokens \(9\) must be <= max"),
    ({"logprobs": -2}, ValueError, "logprobs must be >= -1"),
    ({"logprobs": True}, TypeError, "logprobs must be an integer"),
    ({"prompt_logprobs": 1.0}, TypeError, "prompt_logprobs must be an integer"),
    ({"detokenize": 0}, TypeError, "detokenize must be a bool"),
    ({"skip_special_tokens": None}, TypeError, "skip_special_tokens must be a bool"),
    ({"spaces_between_special_tokens": 1}, TypeError, "spaces_between_special_tokens"),
    ({"include_stop_str_in_output": "no"}, TypeError, "include_stop_str_in_output"),
    ({"truncate_prompt_tokens": 0}, ValueError, "truncate_prompt_tokens must be >= 1"),
    ({"truncate_prompt_tokens": -2}, ValueError, "truncate_prompt_tokens"),
    ({"output_kind": "delta"}, TypeError, "output_kind must be a RequestOutputKind"),
    ({"temprature": 0.5}, TypeError, "temprature"),  # unknown field
]

BAD_REQUESTS = [  # (prompt, SamplingParams kwargs, error, message text) past validation
    ("", {}, ValueError, "prompt must not be empty"),
    ({"prompt_token_ids": []}, {}, ValueError, "prompt_token_ids must not be empty"),
    ({"prompt_token_ids": [3, 1024]}, {}, ValueError, "outside the vocabulary"),
    ({"prompt_token_ids": [3, "4"]}, {}, TypeError, "prompt_token_ids\\[1\\] must be an "),
    ("\ud83d lone surrogate", {}, ValueError, "prompt is not valid text"),
    ({"prompt_token_ids": [5] * 2048}, {}, ValueError, "max_model_len is 2048"),
    ("short", {"max_tokens": 4000}, ValueError, "plus max_tokens \\(4000\\) exceeds"),
    ("short", {"logprobs": 21}, ValueError, "logprobs=21 .*max_logprobs \\(20\\)"),
    ("short", {"prompt_logprobs": 99}, ValueError, "prompt_logprobs=99"),
    ("short", {"allowed_token_ids": [5000]}, ValueError, "allowed_token_ids: token ids"),
    ("short", {"logit_bias": {9999: 1.0}}, ValueError, "logit_bias: token ids"),
    ("short", {"stop_token_ids": [70000]}, ValueError, "stop_token_ids: token ids"),
]


def test_the_bad_input_matrix_names_every_problem(model_dirs, make_llm):
    llm = make_llm(model_dirs["llama"])
    good = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1)
    before = llm.generate(PROMPT, good, use_tqdm=False)[0].outputs[0]
    assert len(BAD_SAMPLING) + len(BAD_REQUESTS) >= 40
    cases = [(PROMPT, kwargs, error, message) for kwargs, error, message in BAD_SAMPLING]
    for prompt, kwargs, error, message in cases + BAD_REQUESTS:
        with pytest.raises(error, match=message):
            llm.generate([PROMPT, prompt], SamplingParams(**kwargs), use_tqdm=False)
        after = llm.generate(PROMPT, good, use_tqdm=False)[0].outputs[0]
        assert after.token_ids == before.token_ids and after.text == before.text
        assert after.cumulative_logprob == pytest.approx(before.cumulative_logprob)
