"""The `LLM` interface: prompt forms, per-prompt parameters, stop rules, text, chat,
validation, lifecycle. References are transformers (via conftest), the tokenizer's own
decode, or an earlier greedy run of the same engine."""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap

import psutil
import pytest

from pagellm import LLM, SamplingParams
from pagellm.frontend.detokenizer import IncrementalDetokenizer
from pagellm.frontend.output_processor import find_stop_string

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


@pytest.fixture
def llama(model_dirs, make_llm):
    return make_llm(model_dirs["llama"])


def test_prompt_forms_and_input_order(llama, hf_reference):
    texts = ["first prompt", "second, longer prompt with more tokens", "3"]
    ids = [llama.tokenizer.encode(t) for t in texts]
    outputs = llama.generate([texts[0], {"prompt_token_ids": ids[1]}, {"prompt": texts[2]}],
                             GREEDY, use_tqdm=False)
    assert [o.prompt for o in outputs] == [texts[0], None, texts[2]]
    assert [o.prompt_token_ids for o in outputs] == ids
    assert len({o.request_id for o in outputs}) == 3
    for o, prompt_ids in zip(outputs, ids, strict=True):
        assert o.finished and o.outputs[0].index == 0
        assert o.outputs[0].token_ids == hf_reference("llama", prompt_ids, 24)
    single = llama.generate("first prompt", GREEDY, use_tqdm=False)
    assert single[0].outputs[0].token_ids == outputs[0].outputs[0].token_ids


def test_one_sampling_params_per_prompt(llama):
    outputs = llama.generate(["a", "b", "c"], [SamplingParams(temperature=0, max_tokens=n)
                                               for n in (1, 5, 9)], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [1, 5, 9]
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    with pytest.raises(ValueError, match="sampling_params"):
        llama.generate(["a", "b"], [GREEDY], use_tqdm=False)


def test_text_is_the_tokenizers_decode_of_the_tokens(llama):
    outputs = llama.generate(["日本語", "héllo", "code:"], SamplingParams(temperature=0.8,
                                                                         seed=1, max_tokens=40),
                             use_tqdm=False)
    for o in outputs:
        c = o.outputs[0]
        assert c.text == llama.tokenizer.decode(c.token_ids, skip_special_tokens=True)


def test_incremental_detokenizer_never_splits_a_character(llama):
    tokenizer = llama.tokenizer
    text = " 日本語のテキスト ✓ 😀 naïve café"
    ids = tokenizer.encode(text)
    assert len(ids) > len(text.split())  # some characters span several tokens
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("prefix"), True)
    deltas = [detok.update([t]) for t in ids]
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas  # at least one token completed no character on its own


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_byte_level_streams_decode_exactly_as_the_tokenizer(llama, skip_special_tokens):
    """A byte-level tokenizer's streams decode from each token's bytes (BytePieces)
    instead of tokenizers' DecodeStream: on random ids (special ones, ids past the
    vocabulary, characters split over tokens, invalid byte sequences), in chunks of
    one to three tokens, the streamed text plus the final flush is the tokenizer's own
    decode."""
    from pagellm.frontend.detokenizer import byte_pieces

    tokenizer = llama.tokenizer
    pieces = byte_pieces(tokenizer._tokenizer)
    assert pieces is not None and pieces.special  # the test tokenizer is byte-level
    rng = random.Random(7)
    vocab = len(pieces.pieces)
    multibyte = [i for i, b in enumerate(pieces.pieces) if any(x >= 0x80 for x in b)]
    for _ in range(200):
        ids = [rng.choice(multibyte) if rng.random() < 0.5 else rng.randrange(vocab + 3)
               for _ in range(rng.randrange(1, 30))]
        detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("prefix"),
                                       skip_special_tokens)
        assert detok._pieces is not None
        text, i = "", 0
        while i < len(ids):
            n = rng.randrange(1, 4)
            text += detok.update(ids[i:i + n])
            i += n
        text += detok.flush()
        expected = tokenizer._tokenizer.decode([t for t in ids if t < vocab],
                                               skip_special_tokens=skip_special_tokens)
        assert text == expected == detok.text, ids


def test_token_texts_are_the_tokenizers_decode_of_each_id_alone(llama):
    """A logprob's decoded_token comes from TokenTexts, which remembers each id's
    text: every id of the vocabulary (special and added ones too), asked twice in a
    shuffled order, must give `tokenizer.decode([id])`."""
    from pagellm.frontend.detokenizer import TokenTexts

    tokenizer = llama.tokenizer
    texts = TokenTexts(tokenizer)
    ids = list(range(len(tokenizer))) * 2
    random.Random(3).shuffle(ids)
    assert all(texts(i) == tokenizer.decode([i]) for i in ids)
    assert any("\ufffd" in texts(i) for i in range(len(tokenizer)))  # half characters too


def test_stop_token_id_stops_at_its_first_occurrence(llama):
    base = llama.generate("The quick brown fox", GREEDY, use_tqdm=False)[0].outputs[0]
    stop_id = base.token_ids[5]
    first = base.token_ids.index(stop_id)
    out = llama.generate("The quick brown fox",
                         SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_id]),
                         use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base.token_ids[:first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)


@pytest.mark.parametrize("include", [False, True])
def test_the_stop_token_is_no_text_unless_included(llama, include):
    """vLLM's rule: the EOS or stop token that ended a request is in its token_ids, not
    in its text, whatever skip_special_tokens says (Harmony's parsers keep special
    tokens: gpt-oss's <|return|> and <|call|> must not reach the content), unless
    include_stop_str_in_output. EOS here is the special <|endoftext|>, pushed up by a
    logit bias so that sampling meets it."""
    tokenizer = llama.tokenizer
    eos = tokenizer.eos_token_id
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=40, logit_bias={eos: 4.0},
                            skip_special_tokens=False, include_stop_str_in_output=include)
    outs = llama.generate(["Hello"] * 6, params, use_tqdm=False)
    ended = [o.outputs[0] for o in outs if o.outputs[0].finish_reason == "stop"]
    assert ended
    for out in ended:
        assert out.token_ids[-1] == eos and out.stop_reason is None
        shown = out.token_ids if include else out.token_ids[:-1]
        assert out.text == tokenizer.decode(shown, skip_special_tokens=False)
        assert out.text.endswith("<|endoftext|>") is include
    stop_id = llama.generate("The quick brown fox", GREEDY, use_tqdm=False)[0].outputs[
        0].token_ids[5]  # an ordinary token, as a stop token
    out = llama.generate("The quick brown fox", SamplingParams(
        temperature=0, max_tokens=24, stop_token_ids=[stop_id],
        include_stop_str_in_output=include), use_tqdm=False)[0].outputs[0]
    assert out.token_ids[-1] == stop_id
    shown = out.token_ids if include else out.token_ids[:-1]
    assert out.text == tokenizer.decode(shown)


def test_eos_stops_unless_ignored_and_not_before_min_tokens(llama):
    base = llama.generate("Hello", GREEDY, use_tqdm=False)[0].outputs[0]
    eos = base.token_ids[3]
    first = base.token_ids.index(eos)
    llama.input_processor.eos_token_id = eos  # pretend the model's EOS is a token it emits
    try:
        out = llama.generate("Hello", GREEDY, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == base.token_ids[:first + 1]
        assert (out.finish_reason, out.stop_reason) == ("stop", None)
        ignored = llama.generate("Hello", SamplingParams(temperature=0, max_tokens=24,
                                                         ignore_eos=True),
                                 use_tqdm=False)[0].outputs[0]
        assert ignored.token_ids == base.token_ids and ignored.finish_reason == "length"
        # Before min_tokens, EOS is masked out of the logits: it can neither be sampled
        # nor stop the request, and the continuation differs from the base from there.
        late = llama.generate("Hello", SamplingParams(temperature=0, max_tokens=24,
                                                      min_tokens=first + 2),
                              use_tqdm=False)[0].outputs[0]
        assert eos not in late.token_ids[:first + 2]
        assert late.token_ids[:first] == base.token_ids[:first]
    finally:
        llama.input_processor.eos_token_id = llama.tokenizer.eos_token_id


def test_generation_config_eos_ids_become_stop_tokens(llama):
    # The test models' generation_config lists <|endoftext|> (0) and <|im_end|> (2).
    request = llama.input_processor.process_inputs("x", "hi", SamplingParams()).engine_requests[0]
    assert request.eos_token_id == 0 and request.sampling_params.stop_token_ids == [2]
    request = llama.input_processor.process_inputs(
        "y", "hi", SamplingParams(ignore_eos=True)).engine_requests[0]
    assert request.sampling_params.stop_token_ids is None


def test_stop_strings_and_bad_words_stay_in_the_frontend(llama):
    """Stop strings are matched by the output processor and bad words travel as token
    ids: the engine's copies of the params carry neither (a long stop list would
    otherwise be copied into each of n child requests)."""
    processed = llama.input_processor.process_inputs(
        "x", "hi", SamplingParams(n=3, stop=["zz"], bad_words=["ab"]))
    assert processed.params.stop == ["zz"] and processed.params.bad_words == ["ab"]
    assert len(processed.engine_requests) == 3
    for request in processed.engine_requests:
        assert request.sampling_params.stop is None
        assert request.sampling_params.bad_words is None
        assert request.bad_words_token_ids == [
            llama.tokenizer.encode(w, add_special_tokens=False) for w in ("ab", " ab")]


def test_stop_token_ids_reach_the_engine_once_each(llama):
    """The client's ids and generation_config's extra EOS id (2), each once: a client's
    list as long as the vocabulary stays within it after the EOS id joins."""
    process = llama.input_processor.process_inputs
    vocab = llama.info.vocab_size
    params = process("x", "hi", SamplingParams(stop_token_ids=[5, 5, 9])).engine_requests[0]
    assert params.sampling_params.stop_token_ids == [5, 9, 2]
    everything = list(range(vocab - 1, -1, -1))
    params = process("y", "hi", SamplingParams(stop_token_ids=everything)).engine_requests[0]
    assert params.sampling_params.stop_token_ids == everything


def test_what_the_engine_would_refuse_is_refused_before_it(llama):
    """min_tokens against the max_tokens a None resolves to, and bad words longer than
    the vocabulary: named by the input processor, not by the engine afterwards."""
    process = llama.input_processor.process_inputs
    max_len = llama.info.max_model_len
    with pytest.raises(ValueError, match=r"min_tokens \(100\) must be <= max_tokens \(48"):
        process("x", {"prompt_token_ids": [1] * (max_len - 48)},
                SamplingParams(max_tokens=None, min_tokens=100))
    with pytest.raises(ValueError, match="bad_words entry has"):
        process("y", "hi", SamplingParams(bad_words=["ab " * llama.info.vocab_size]))


def test_a_request_that_fails_to_send_leaves_nothing_behind(llama, monkeypatch):
    """A send that fails midway (the second of two prompts) fails the call; the first
    prompt's request is aborted in the engine and forgotten here, so the next call
    returns (it waited forever for the orphan) and no block is held (make_llm)."""
    engine_core = llama.engine_core
    real, sent = engine_core.add_request, []

    def flaky(request):
        if sent:
            raise ConnectionError("injected: the send failed")
        sent.append(request.request_id)
        real(request)

    monkeypatch.setattr(engine_core, "add_request", flaky)
    with pytest.raises(ConnectionError, match="injected"):
        llama.generate(["first", "second"], GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert len(sent) == 1 and not llama.output_processor.has_unfinished_requests()
    assert llama.generate("first", GREEDY, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cuts_text_and_frees_the_request(llama, include):
    base = llama.generate("def f(x):", SamplingParams(temperature=0, max_tokens=30),
                          use_tqdm=False)[0].outputs[0]
    text = base.text
    start = len(text) // 2
    stop = text[start:start + 3]
    assert stop.strip()
    cut = text.find(stop)
    out = llama.generate("def f(x):", SamplingParams(temperature=0, max_tokens=30,
                                                     stop=[stop],
                                                     include_stop_str_in_output=include),
                         use_tqdm=False)[0].outputs[0]
    assert out.text == (text[:cut + len(stop)] if include else text[:cut])
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert len(out.token_ids) < len(base.token_ids)
    assert out.token_ids == base.token_ids[:len(out.token_ids)]


def test_find_stop_string_picks_the_earliest_hit_in_the_new_text():
    assert find_stop_string("abcXYdefZ", 4, ["Z", "XYd"], False) == ("XYd", 3)
    assert find_stop_string("abcXYdefZ", 1, ["XYd"], False) is None  # already searched
    assert find_stop_string("abcXY", 1, ["XY"], True) == ("XY", None)  # nothing to cut


def test_max_tokens_none_runs_to_max_model_len(model_dirs, make_llm):
    llm = make_llm(model_dirs["llama"], max_model_len=40)
    out = llm.generate({"prompt_token_ids": [5] * 10},
                       SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 30 and out.finish_reason == "length"


def test_seeded_sampling_is_independent_of_batch_and_preemption(model_dirs, make_llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=32)
    llm = make_llm(model_dirs["qwen2"])
    alone = llm.generate("seeded prompt", seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [f"other prompt {i} " * (i % 5 + 1) for i in range(64)]
    batch = llm.generate(["seeded prompt", *others],
                         [seeded] + [SamplingParams(temperature=1.0, max_tokens=32)] * 64,
                         use_tqdm=False)
    assert batch[0].outputs[0].token_ids == alone
    probe = llm.engine_core.core.executor.runner.kv_cache_bytes_per_block()
    small = make_llm(model_dirs["qwen2"], kv_cache_memory_bytes=12 * probe, max_model_len=160)
    batch = small.generate(["seeded prompt", *others[:16]],
                           [seeded] + [SamplingParams(temperature=1.0, max_tokens=32)] * 16,
                           use_tqdm=False)
    assert small.get_stats().num_preemptions > 0
    assert batch[0].outputs[0].token_ids == alone
    unseeded = llm.generate("seeded prompt", SamplingParams(temperature=1.0, max_tokens=32),
                            use_tqdm=False)[0].outputs[0].token_ids
    assert unseeded != alone


def test_chat_applies_the_template_with_a_generation_prompt(llama):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi there"}]
    out = llama.chat(messages, GREEDY, use_tqdm=False)[0]
    template = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
    expected_ids = llama.tokenizer.encode(template + "<|im_start|>assistant\n")
    assert out.prompt_token_ids == expected_ids
    assert out.prompt_token_ids == llama.tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=False, add_generation_prompt=True)
    assert out.prompt == template + "<|im_start|>assistant\n"  # issue 39: was None
    direct = llama.generate({"prompt_token_ids": expected_ids}, GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == direct.outputs[0].token_ids
    two = llama.chat([messages, messages[1:]], GREEDY, use_tqdm=False)
    assert len(two) == 2 and two[0].outputs[0].token_ids == direct.outputs[0].token_ids
    with pytest.raises(TypeError, match="messages"):
        llama.chat([["not a message"]], GREEDY, use_tqdm=False)


# --- validation: every bad input is rejected by name, and the engine is unaffected -------

BAD_INPUTS = [
    ("", GREEDY, ValueError, "empty"),
    ({"prompt_token_ids": []}, GREEDY, ValueError, "empty"),
    ({"prompt_token_ids": [1, 5000]}, GREEDY, ValueError, "vocabulary"),
    ({"prompt_token_ids": [1, -3]}, GREEDY, ValueError, "vocabulary"),
    ({"prompt_token_ids": [1, "2"]}, GREEDY, TypeError, "prompt_token_ids"),
    ({"prompt_token_ids": [1, 2.0]}, GREEDY, TypeError, "prompt_token_ids"),
    ({"prompt_token_ids": "1 2 3"}, GREEDY, TypeError, "prompt_token_ids"),
    ({"prompt_token_ids": [1, 2], "prompt": 5}, GREEDY, ValueError, "'prompt' must be its"),
    ({"prompt_ids": [1]}, GREEDY, ValueError, "prompt_token_ids"),
    (42, GREEDY, TypeError, "prompt"),
    ("bad \ud800 surrogate", GREEDY, ValueError, "prompt"),
    ("x" * 3000, GREEDY, ValueError, "max_model_len"),
    ({"prompt_token_ids": [1] * 2040}, SamplingParams(max_tokens=20), ValueError,
     "max_model_len"),
    ("ok", {"temperature": 0}, TypeError, "sampling_params"),
    ("ok", SamplingParams(stop_token_ids=[99999]), ValueError, "stop_token_ids"),
    ({"prompt": "x", "cache_salt": ""}, GREEDY, ValueError, "cache_salt"),
    # Copied into each of n engine requests: bounded (15 MB with n=256 took 2.8 GB).
    ({"prompt": "x", "cache_salt": "s" * 1025}, GREEDY, ValueError,
     "cache_salt must be a non-empty string of at most 1024"),
]


def test_bad_inputs_raise_named_errors_and_leave_the_engine_serving(llama):
    good = "a good prompt"
    before = llama.generate(good, GREEDY, use_tqdm=False)[0].outputs[0]
    for prompt, params, error, message in BAD_INPUTS:
        with pytest.raises(error, match=message):
            llama.generate([good, prompt], params, use_tqdm=False)
        after = llama.generate(good, GREEDY, use_tqdm=False)[0].outputs[0]
        assert after.token_ids == before.token_ids and after.text == before.text


def test_mutated_sampling_params_are_revalidated(llama):
    params = SamplingParams(temperature=0.5)
    params.temperature = -1.0  # msgspec Structs are mutable: check again on the way in
    with pytest.raises(ValueError, match="temperature"):
        llama.generate("x", params, use_tqdm=False)


def test_unknown_engine_option_is_a_type_error(model_dirs):
    with pytest.raises(TypeError, match="max_num_sequences"):
        LLM(str(model_dirs["llama"]), max_num_sequences=4)


def test_start_up_errors_name_the_cause(model_dirs, tmp_path):
    with pytest.raises(FileNotFoundError, match="not-there"):
        LLM(str(tmp_path / "not-there"))
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        LLM(str(model_dirs["llama"]), kv_cache_memory_bytes=4096)


def test_context_manager_shuts_down(model_dirs):
    with LLM(str(model_dirs["llama"]), kv_cache_memory_bytes=2**20) as llm:
        assert llm.generate("x", GREEDY, use_tqdm=False)[0].finished
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate("x", GREEDY, use_tqdm=False)


def test_an_in_process_llm_left_open_exits_cleanly(model_dirs):
    """A script that never calls shutdown: the engine stops at exit, before the
    interpreter tears its modules down (it printed a traceback from torch.distributed)."""
    script = textwrap.dedent(f"""
        from pagellm import LLM, SamplingParams
        llm = LLM({str(model_dirs["llama"])!r}, kv_cache_memory_bytes=2**20,
                  multiprocess=False)
        llm.generate("x", SamplingParams(max_tokens=2), use_tqdm=False)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, \
        done.stderr


def test_progress_bar_reports_tokens_per_second(llama, capsys):
    llama.generate(["a", "b"], GREEDY, use_tqdm=True)
    err = capsys.readouterr().err
    assert "2/2" in err and "tok/s" in err


def test_skip_tokenizer_init_takes_token_ids_and_returns_no_text(model_dirs, make_llm, llama):
    ids = llama.tokenizer.encode("some prompt")
    with_text = llama.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0]
    llm = make_llm(model_dirs["llama"], skip_tokenizer_init=True)
    assert llm.tokenizer is None
    out = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == with_text.outputs[0].token_ids and out.text == ""
    # EOS comes from generation_config.json alone: <|endoftext|> (0), then <|im_end|> (2).
    request = llm.input_processor.process_inputs("x", {"prompt_token_ids": ids},
                                           GREEDY).engine_requests[0]
    assert request.eos_token_id == 0 and request.sampling_params.stop_token_ids == [2]
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        llm.generate("text prompt", GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="stop strings"):
        llm.generate({"prompt_token_ids": ids}, SamplingParams(stop=["x"]), use_tqdm=False)
    with pytest.raises(ValueError, match="chat"):
        llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)


def test_llm_signature_lists_every_engine_option():
    import dataclasses
    import inspect

    from pagellm.protocol.engine_args import EngineArgs

    params = inspect.signature(LLM).parameters
    for f in dataclasses.fields(EngineArgs):
        assert f.name in params
        if f.name != "model":
            assert params[f.name].default == f.default
    assert params["max_num_seqs"].default == 256 and params["block_size"].default == 16


@pytest.mark.parametrize("timeout", [0, -1.0, float("nan")])
def test_collective_rpc_timeout_must_be_positive(llama, timeout):
    """A timeout that has passed before the call starts is a mistake, not a wait."""
    with pytest.raises(ValueError, match="timeout"):
        llama.collective_rpc("describe", timeout=timeout)


def test_logits_that_cannot_fit_beside_the_kv_cache_are_refused_at_start_up(model_dirs,
                                                                            monkeypatch):
    """On the CPU nothing profiles a step: max_num_seqs x vocab_size logits (the
    sampler's copies included) that the RAM left beside the KV cache cannot hold are
    refused by name, not OOM-killed at the first full batch. 256 x 1024 logits need
    11.5 MB (sampler.STEP_BYTES_PER_LOGIT = 44); 70% of 12 MB is 8.4 MB."""
    available = 12 * 10**6
    real = psutil.virtual_memory

    def reports_12_mb():  # the real record, with less available
        return real()._replace(available=available)

    monkeypatch.setattr(psutil, "virtual_memory", reports_12_mb)
    with pytest.raises(ValueError, match=r"one step's logits need 11534336 bytes .*"
                                         r"max_num_seqs=256 rows x vocab_size=1024.* more "
                                         r"than the 8400000 bytes .* beside the KV cache's "
                                         r"share; lower max_num_seqs"):
        LLM(str(model_dirs["llama"]), multiprocess=False)
    with pytest.raises(ValueError, match="next to kv_cache_memory_bytes; lower max_num_seqs"):
        LLM(str(model_dirs["llama"]), kv_cache_memory_bytes=10**6, multiprocess=False)
    with LLM(str(model_dirs["llama"]), max_num_seqs=16, max_model_len=128,
             multiprocess=False) as llm:  # 16 rows: 0.7 MB
        assert len(llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2))[0]
                   .outputs[0].token_ids) == 2


def test_a_kv_cache_larger_than_available_memory_is_refused_at_start_up(model_dirs):
    """An explicit kv_cache_memory_bytes beyond what the device has: a clear refusal,
    not an allocator traceback (or, below overcommit's limit, an OOM kill later)."""
    with pytest.raises(ValueError, match="kv_cache_memory_bytes=1000000000000000 is more "
                                         "than cpu has available"):
        LLM(str(model_dirs["llama"]), kv_cache_memory_bytes=10**15, multiprocess=False)
