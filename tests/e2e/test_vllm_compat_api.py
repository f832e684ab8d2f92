"""vLLM's Python API as its users call it: the engine options vLLM scripts pass, the
methods and fields they read, with vLLM's meanings (judged against transformers or a
hand count)."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import time
from pathlib import Path

import msgspec
import pytest
import torch
from conftest import PROMPTS

from pagellm import LLM, AsyncLLM, EngineDeadError, RequestOutputKind, SamplingParams
from pagellm.frontend.cli import build_parser, load_chat_template
from pagellm.protocol.engine_args import EngineArgs

KV = 8 * 2**20
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def test_vllms_import_paths_name_the_same_objects(model_dirs, make_llm):
    """Issue 39: a script ported by replacing `vllm` with `pagellm` imports the prompt
    forms from .inputs and SamplingParams from .sampling_params, and they work there."""
    import pagellm
    from pagellm.inputs import PromptType, TextPrompt, TokensPrompt
    from pagellm.sampling_params import RequestOutputKind as Kind
    from pagellm.sampling_params import SamplingParams as Params

    assert (Params, Kind) == (SamplingParams, RequestOutputKind)
    assert (TextPrompt, TokensPrompt, PromptType) == (
        pagellm.TextPrompt, pagellm.TokensPrompt, pagellm.PromptType)
    llm = make_llm(model_dirs["llama"])
    ids = llm.tokenizer.encode("Hello there")
    by_text, by_ids = llm.generate([TextPrompt(prompt="Hello there"),
                                    TokensPrompt(prompt_token_ids=ids)],
                                   Params(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert by_text.prompt_token_ids == by_ids.prompt_token_ids == ids
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids


@pytest.fixture(scope="module")
def hf_model(model_dirs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dirs["llama"],
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_tokenizer(model_dirs):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dirs["llama"])


def wait_until(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


# --- engine options ---------------------------------------------------------------------


@pytest.mark.parametrize("options", [
    {"trust_remote_code": True}, {"trust_remote_code": False},
    {"disable_log_stats": True},
    {"enable_chunked_prefill": True}, {"enable_chunked_prefill": None},
    {"distributed_executor_backend": "mp"}, {"distributed_executor_backend": None},
    {"quantization": None}, {"kv_cache_dtype": "auto"}, {"kv_cache_dtype": "fp8"},
    {"revision": None},
    {"tokenizer_revision": None}, {"tokenizer_mode": "auto"},
    {"swap_space": 0}, {"swap_space": 16.5}, {"max_seq_len_to_capture": 32768},
])
def test_vllm_option_with_a_value_we_honour_is_accepted(options):
    args = EngineArgs.from_kwargs(model="demo", **options)
    for name, value in options.items():
        assert getattr(args, name) == value


@pytest.mark.parametrize(("options", "message"), [
    ({"quantization": "bitsandbytes"}, r"quantization='bitsandbytes' is not supported: .*"
                                       r"reads gptq, awq, compressed-tensors and fp8"),
    ({"kv_cache_dtype": "fp8_e5m2"}, r"kv_cache_dtype='fp8_e5m2' is not supported.*"
                                     r"supported: 'auto', 'bfloat16', 'fp8', 'fp8_e4m3'"),
    ({"enable_chunked_prefill": False}, r"enable_chunked_prefill=False .*always chunks"),
    ({"distributed_executor_backend": dict},  # verl passes its own executor class
     r"distributed_executor_backend=<class 'dict'> .*supported: None, 'mp', 'uni', "
     r"'external_launcher', 'ray'"),
    ({"revision": "main"}, r"revision='main' .*local directory"),
    ({"tokenizer_revision": "v1"}, r"tokenizer_revision='v1' .*local directory"),
    ({"tokenizer_mode": "slow"}, r"tokenizer_mode='slow' .*supported: 'auto'"),
    ({"swap_space": -1}, r"swap_space must be >= 0"),
    ({"max_seq_len_to_capture": 0}, r"max_seq_len_to_capture must be >= 1"),
])
def test_vllm_option_with_a_value_we_cannot_honour_is_refused_naming_it(options, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs.from_kwargs(model="demo", **options)


def test_llm_refuses_an_unsupported_option_before_starting_anything(model_dirs):
    with pytest.raises(ValueError, match="quantization='bitsandbytes'"):
        LLM(str(model_dirs["llama"]), quantization="bitsandbytes")


def test_cli_takes_the_vllm_flags_and_its_help_says_what_they_do():
    parser = build_parser()
    ns = parser.parse_args(["serve", "m", "--trust-remote-code", "--disable-log-stats",
                            "--enable-chunked-prefill", "--distributed-executor-backend",
                            "mp", "--kv-cache-dtype", "auto", "--swap-space", "2",
                            "--max-seq-len-to-capture", "1024", "--disable-log-requests",
                            "--chat-template", "{{ messages }}", "--max-logprobs", "-1"])
    args = EngineArgs.from_cli_args(ns)
    assert (args.trust_remote_code, args.enable_chunked_prefill, args.swap_space,
            args.max_seq_len_to_capture, args.max_logprobs) == (True, True, 2.0, 1024, -1)
    assert ns.disable_log_requests and ns.chat_template == "{{ messages }}"
    # The flags travel to the engine-core process and come back the same.
    sub = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs.from_cli_args(sub.parse_args(args.to_cli_args())) == args
    serve = parser._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    text = " ".join(serve.format_help().split())
    assert "never runs code from a model directory" in text
    assert "never swaps" in text and "always chunks" in text


def test_cli_refuses_an_unsupported_value_with_the_reason(capsys):
    from pagellm.frontend.cli import main

    assert main(["generate", "--model", "demo", "--quantization", "bitsandbytes", "hi"]) == 2
    assert "quantization='bitsandbytes' is not supported" in capsys.readouterr().err


def test_chat_template_flag_reads_a_file_or_takes_the_template(tmp_path: Path):
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert load_chat_template(str(path)) == path.read_text()
    assert load_chat_template("{{ messages[0].content }}") == "{{ messages[0].content }}"
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        load_chat_template(str(tmp_path / "missing.jinja"))


# --- sampling params --------------------------------------------------------------------


def test_sampling_params_take_vllm_values():
    assert SamplingParams(repetition_penalty=3.0).repetition_penalty == 3.0
    assert SamplingParams(logprobs=-1, prompt_logprobs=-1).logprobs == -1
    with pytest.raises(ValueError, match="repetition_penalty must be > 0"):
        SamplingParams(repetition_penalty=0.0)
    with pytest.raises(ValueError, match="logprobs must be >= -1"):
        SamplingParams(logprobs=-2)
    with pytest.raises(TypeError, match="extra_args must be a dict"):
        SamplingParams(extra_args={1: "x"})  # type: ignore[dict-item]


def test_extra_args_are_carried_through_the_wire_and_ignored(model_dirs, make_llm):
    params = SamplingParams(temperature=0.0, max_tokens=4, extra_args={"tag": [1, "a"]})
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
    assert wire.extra_args == {"tag": [1, "a"]}
    llm = make_llm(model_dirs["llama"])
    plain = llm.generate(PROMPTS[1], params.clone(extra_args=None), use_tqdm=False)[0]
    tagged = llm.generate(PROMPTS[1], params, use_tqdm=False)[0]
    assert tagged.outputs[0].token_ids == plain.outputs[0].token_ids


def test_logprobs_minus_one_needs_max_logprobs_to_allow_it(model_dirs, make_llm):
    llm = make_llm(model_dirs["llama"])  # max_logprobs=20
    with pytest.raises(ValueError, match=r"logprobs=-1 is more than this engine's "
                                         r"max_logprobs \(20"):
        llm.generate("hi", SamplingParams(logprobs=-1), use_tqdm=False)


def test_logprobs_minus_one_give_the_whole_vocabulary_as_transformers(
        model_dirs, make_llm, hf_model):
    llm = make_llm(model_dirs["llama"], max_logprobs=-1)
    ids = llm.get_tokenizer().encode(PROMPTS[2])
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(
        temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=-1, prompt_logprobs=-1),
        use_tqdm=False)[0]
    vocab = hf_model.config.vocab_size
    tokens = out.outputs[0].token_ids
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids + tokens])).logits[0]
    reference = logits.float().log_softmax(dim=-1)  # [positions, vocab]
    positions = out.outputs[0].logprobs
    assert positions is not None and len(positions) == 3
    for i, position in enumerate(positions):
        assert len(position) == vocab
        got = torch.tensor([position[t].logprob for t in range(vocab)])
        torch.testing.assert_close(got, reference[len(ids) - 1 + i], rtol=0, atol=1e-4)
        assert position[tokens[i]].rank == 1  # greedy: the chosen token is the top one
    prompt_positions = out.prompt_logprobs
    assert prompt_positions is not None and prompt_positions[0] is None
    for j, position in enumerate(prompt_positions[1:]):
        assert position is not None and len(position) == vocab
        got = torch.tensor([position[t].logprob for t in range(vocab)])
        torch.testing.assert_close(got, reference[j], rtol=0, atol=1e-4)


def test_repetition_penalty_three_equals_a_hand_penalised_greedy_loop(
        model_dirs, make_llm, hf_model):
    llm = make_llm(model_dirs["llama"])
    ids = llm.get_tokenizer().encode(PROMPTS[5])
    got = llm.generate({"prompt_token_ids": ids}, SamplingParams(
        temperature=0.0, max_tokens=10, ignore_eos=True, repetition_penalty=3.0),
        use_tqdm=False)[0].outputs[0].token_ids
    tokens = list(ids)
    with torch.no_grad():
        for _ in range(10):
            logits = hf_model(torch.tensor([tokens])).logits[0, -1].float()
            seen = torch.tensor(sorted(set(tokens)))
            # vLLM's rule: seen tokens' positive logits divided, negative ones multiplied.
            logits[seen] = torch.where(logits[seen] > 0, logits[seen] / 3.0,
                                       logits[seen] * 3.0)
            tokens.append(int(logits.argmax()))
    assert got == tokens[len(ids):]
    plain = llm.generate({"prompt_token_ids": ids}, SamplingParams(
        temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    assert plain.outputs[0].token_ids != got  # the penalty did change something


# --- LLM methods and RequestOutput fields -----------------------------------------------


def test_get_tokenizer_encodes_as_the_models_tokenizer(model_dirs, make_llm, hf_tokenizer):
    llm = make_llm(model_dirs["llama"])
    for prompt in PROMPTS[:4]:
        assert llm.get_tokenizer().encode(prompt) == hf_tokenizer.encode(prompt)
    bare = make_llm(model_dirs["llama"], skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        bare.get_tokenizer()


def test_llm_from_engine_args_serves_like_llm(model_dirs, hf_reference):
    args = EngineArgs(model=str(model_dirs["llama"]), kv_cache_memory_bytes=KV)
    with LLM.from_engine_args(args, multiprocess=False) as llm:
        ids = llm.get_tokenizer().encode(PROMPTS[0])
        out = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_reference("llama", ids, 8)


def test_num_cached_tokens_is_the_prefix_cache_hit_in_whole_blocks(model_dirs, make_llm):
    llm = make_llm(model_dirs["llama"], block_size=16)
    ids = llm.get_tokenizer().encode(PROMPTS[6])[:50]
    assert len(ids) == 50
    first = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0]
    again = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    # 50 tokens: 3 full blocks of 16 are cached, the rest (and always the last token)
    # is computed again.
    assert again.num_cached_tokens == 48
    # A prompt of whole blocks (all cached now): its last block is computed again.
    assert llm.generate({"prompt_token_ids": ids[:48]}, GREEDY,
                        use_tqdm=False)[0].num_cached_tokens == 32
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_request_metrics_time_the_request(model_dirs, make_llm):
    llm = make_llm(model_dirs["llama"])
    before = time.time()
    out = llm.generate(PROMPTS[1], SamplingParams(n=2, temperature=1.0, seed=3,
                                                  max_tokens=5, ignore_eos=True),
                       use_tqdm=False)[0]
    after = time.time()
    m = out.metrics
    assert m is not None
    assert before <= m.arrival_time <= after
    assert m.num_generation_tokens == sum(len(c.token_ids) for c in out.outputs) == 10
    assert 0 < m.first_token_latency <= after - m.arrival_time
    assert 0 < m.first_token_ts <= m.last_token_ts <= time.monotonic()


def test_chat_continue_final_message_renders_as_transformers(model_dirs, make_llm,
                                                             hf_tokenizer):
    llm = make_llm(model_dirs["llama"])
    conversation = [{"role": "user", "content": "Name a colour."},
                    {"role": "assistant", "content": "The colour is"}]
    out = llm.chat(conversation, GREEDY, use_tqdm=False, add_generation_prompt=False,
                   continue_final_message=True)[0]
    expected = hf_tokenizer.apply_chat_template(conversation, tokenize=True,
                                                continue_final_message=True,
                                                add_generation_prompt=False,
                                                return_dict=False)
    assert out.prompt_token_ids == list(expected)
    assert hf_tokenizer.decode(out.prompt_token_ids).endswith("The colour is")
    with pytest.raises(ValueError, match="Cannot set both"):
        llm.chat(conversation, GREEDY, use_tqdm=False, continue_final_message=True)


def test_chat_with_its_own_template_renders_that_template(model_dirs, make_llm,
                                                          hf_tokenizer):
    llm = make_llm(model_dirs["llama"])
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}" \
               "{% if add_generation_prompt %}[assistant]{% endif %}"
    conversation = [{"role": "user", "content": "hi there"}]
    out = llm.chat(conversation, GREEDY, use_tqdm=False, chat_template=template)[0]
    assert out.prompt_token_ids == hf_tokenizer.encode(
        "[user] hi there\n[assistant]", add_special_tokens=False)


# --- health and aborts, in a child engine process ----------------------------------------


@pytest.mark.slow
def test_llm_check_health_raises_once_the_engine_is_killed(model_dirs):
    llm = LLM(str(model_dirs["llama"]), kv_cache_memory_bytes=KV)
    try:
        llm.check_health()
        os.kill(llm.engine_core.engine_process.pid, signal.SIGKILL)

        def dead() -> bool:
            try:
                llm.check_health()
            except EngineDeadError:
                return True
            return False

        assert wait_until(dead)
        with pytest.raises(EngineDeadError, match="SIGKILL"):
            llm.check_health()
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_async_llm_aborts_a_list_reports_health_and_stops(model_dirs, hf_tokenizer):
    args = EngineArgs(model=str(model_dirs["llama"]), kv_cache_memory_bytes=KV)
    engine = AsyncLLM.from_engine_args(args)
    long = SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True,
                          output_kind=RequestOutputKind.DELTA)

    async def run() -> None:
        assert engine.get_tokenizer().encode(PROMPTS[3]) == hf_tokenizer.encode(PROMPTS[3])
        await engine.check_health()
        assert engine.is_running and not engine.errored and not engine.is_stopped
        started: set[str] = set()
        finals: dict[str, str | None] = {}

        async def stream(request_id: str) -> None:
            async for out in engine.generate("abort me", long, request_id):
                started.add(request_id)
                if out.finished:
                    finals[request_id] = out.outputs[0].finish_reason

        tasks = [asyncio.create_task(stream(r)) for r in ("a", "b", "c")]
        deadline = time.monotonic() + 30
        while len(started) < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await engine.abort(["a", "b"])
        await engine.abort("c")
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        assert finals == {"a": "abort", "b": "abort", "c": "abort"}
        deadline = time.monotonic() + 10
        while (await engine.get_stats()).num_running_reqs and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert (await engine.get_stats()).num_running_reqs == 0

        os.kill(engine.engine_core.engine_process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not engine.errored and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert engine.errored and not engine.is_running and engine.is_stopped
        with pytest.raises(EngineDeadError, match="SIGKILL"):
            await engine.check_health()

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()
    assert engine.is_stopped and not engine.is_running
