"""protocol/: validation that names the field, lossless msgpack round trips of every
message, and EngineArgs as the single source of engine options."""

from __future__ import annotations

import argparse
import dataclasses
import math

import msgspec
import pytest

from pagellm.protocol import (
    CachedRequestData,
    EngineArgs,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineStats,
    FinishReason,
    ModelRunnerOutput,
    MsgpackDecoder,
    MsgpackEncoder,
    NewRequestData,
    RequestOutputKind,
    SamplingParams,
    SchedulerOutput,
    StepTimings,
)
from pagellm.protocol.messages import (
    EngineInfo,
    HandshakeReply,
    HandshakeRequest,
    StartupFailure,
    TokenLogprobs,
    UtilityMethod,
    UtilityOutput,
    UtilityRequest,
)
from pagellm.protocol.scheduling import PromptLogprobsChunk

# --- SamplingParams -----------------------------------------------------------------

BAD_SAMPLING = [
    ({"n": 0}, ValueError, "n"),
    ({"n": 1.5}, TypeError, "n"),
    ({"temperature": -0.1}, ValueError, "temperature"),
    ({"temperature": math.nan}, ValueError, "temperature"),
    ({"temperature": math.inf}, ValueError, "temperature"),
    ({"temperature": "hot"}, TypeError, "temperature"),
    ({"top_p": 0.0}, ValueError, "top_p"),
    ({"top_p": 1.5}, ValueError, "top_p"),
    ({"top_k": -2}, ValueError, "top_k"),
    ({"top_k": 2.0}, TypeError, "top_k"),
    ({"min_p": 1.5}, ValueError, "min_p"),
    ({"seed": "42"}, TypeError, "seed"),
    ({"max_tokens": 0}, ValueError, "max_tokens"),
    ({"max_tokens": True}, TypeError, "max_tokens"),
    ({"min_tokens": -1}, ValueError, "min_tokens"),
    ({"min_tokens": 5, "max_tokens": 4}, ValueError, "min_tokens"),
    ({"ignore_eos": 1}, TypeError, "ignore_eos"),
    ({"stop": [""]}, ValueError, "stop"),
    ({"stop": [3]}, TypeError, "stop"),
    ({"stop_token_ids": [-1]}, ValueError, "stop_token_ids"),
    ({"stop_token_ids": ["a"]}, TypeError, "stop_token_ids"),
    ({"stop_token_ids": 5}, TypeError, "stop_token_ids"),
    ({"output_kind": 7}, TypeError, "output_kind"),
    # Sizes a client could inflate: the characters of all stop strings (bad words).
    ({"stop": ["x" * 2**16, "y"]}, ValueError, "stop hold 65537 characters"),
    ({"bad_words": ["x" * (2**16 + 1)]}, ValueError, "bad_words hold"),
    # extra_args crosses to the engine: what msgpack cannot carry is refused here.
    ({"extra_args": {"a": object()}}, TypeError, "extra_args"),
    ({"extra_args": {"a": 2**70}}, TypeError, "extra_args"),
]


@pytest.mark.parametrize(("kwargs", "error", "field"), BAD_SAMPLING)
def test_bad_sampling_params_raise_naming_the_field(kwargs, error, field):
    with pytest.raises(error, match=field):
        SamplingParams(**kwargs)


def test_unknown_sampling_field_is_a_type_error():
    with pytest.raises(TypeError, match="temprature"):
        SamplingParams(temprature=0.5)


def test_sampling_defaults_follow_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens, p.min_tokens) == (
        1, 1.0, 1.0, 0, 16, 0)
    assert SamplingParams(temperature=0).greedy and SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=0.01).greedy
    assert SamplingParams(stop="###").stop == ["###"]


def test_clone_revalidates():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams().clone(max_tokens=0)


# --- round trips --------------------------------------------------------------------

PARAMS = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=3, max_tokens=9,
                        min_tokens=2, stop_token_ids=[4, 5], stop=["\n\n"], ignore_eos=True,
                        output_kind=RequestOutputKind.DELTA, presence_penalty=0.5,
                        frequency_penalty=-0.5, repetition_penalty=1.2,
                        logit_bias={7: -2.5}, allowed_token_ids=[1, 7], bad_words=["no"],
                        logprobs=3, prompt_logprobs=0, detokenize=True,
                        truncate_prompt_tokens=8)

MESSAGES = [
    PARAMS,
    EngineCoreRequest("r1", [1, 2, 3], PARAMS, 0, 123.5, priority=2,
                      bad_words_token_ids=[[3, 4], [9]]),
    EngineCoreOutput("r1", [7], FinishReason.STOP, stop_reason=5),
    EngineCoreOutput("r2", [], FinishReason.ERROR, error="bad request"),
    EngineCoreOutputs([EngineCoreOutput("r1", [7, 8]), EngineCoreOutput("r2", [9])], 4.25),
    EngineCoreOutputs([EngineCoreOutput("r1", [7])], 4.5, token_req_ids=["r2", "r3"],
                      token_ids=[11, 12]),
    SchedulerOutput([NewRequestData("r1", [1, 2], [3], PARAMS, 0, [4, 5], 0)],
                    CachedRequestData(["r2", "r3"], [17, 5], {"r2": [6]}),
                    {"r1": 3, "r2": 1, "r3": 1}, 5, ["r0"], ["r9"]),
    ModelRunnerOutput(["r1", "r2"], [5, -1],
                      logprobs={"r1": TokenLogprobs([5, 1], [-0.5, -0.25], [2, 1])},
                      prompt_logprobs={"r2": PromptLogprobsChunk(3, [
                          TokenLogprobs([9], [-1.5], [4])])},
                      prepare_inputs_s=0.1, forward_s=0.2, sample_s=0.3),
    EngineCoreOutput("r3", [4], new_logprobs=[TokenLogprobs([4, 4, 2], [-0.1, -0.1, -3.0],
                                                            [1, 1, 2])],
                     new_prompt_logprobs=[TokenLogprobs([1], [-2.0], [7])]),
    EngineStats(1, 2, 3, 4, 0.25, 10, 5, 1, 7,
                StepTimings(1e-3, 2e-3, 3e-3, 4e-3, 5e-3, 6e-3)),
    EngineInfo("m", 2048, 1024, 16, 100, 2048, "cpu", "float32"),
    UtilityRequest(3, UtilityMethod.RESET_PREFIX_CACHE),
    UtilityRequest(4, UtilityMethod.GET_STATS, [1, 2.5, "x", True, None]),
    UtilityOutput(3, result=b"\xc3"),
    UtilityOutput(4, failure="nope"),
    EngineCoreOutputs([], 1.0, utility_output=UtilityOutput(5, b"\xc2"), engine_dead="gone"),
    HandshakeRequest(2),
    HandshakeReply(EngineInfo("m", 64, 32, 16, 8, 64, "cpu", "float32", 5, 4), 0, "ipc://b"),
    HandshakeReply(error="protocol version 9 is not supported"),
    StartupFailure("model directory not found: /x", "FileNotFoundError"),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(message):
    data = MsgpackEncoder().encode(message)
    decoded = MsgpackDecoder(type(message)).decode(data)
    assert decoded == message
    buffer = bytearray()
    MsgpackEncoder().encode_into(message, buffer)
    assert MsgpackDecoder(type(message)).decode(buffer) == message


def test_finish_reason_prints_openai_names():
    assert [str(r) for r in FinishReason] == ["stop", "length", "abort", "error"]


def test_decoding_validates_sampling_params():
    bad = msgspec.msgpack.encode({"temperature": -1.0})
    with pytest.raises(msgspec.ValidationError, match="temperature"):
        MsgpackDecoder(SamplingParams).decode(bad)


def test_decoding_rejects_malformed_requests():
    with pytest.raises(msgspec.ValidationError):
        MsgpackDecoder(EngineCoreRequest).decode(msgspec.msgpack.encode(["r1", "not ids"]))


def test_engine_args_travel_over_msgpack():
    args = EngineArgs(model="/m", max_model_len=128, dtype="bf16")
    assert MsgpackDecoder(EngineArgs).decode(MsgpackEncoder().encode(args)) == args


# --- EngineArgs ---------------------------------------------------------------------


def test_unknown_engine_options_are_named():
    with pytest.raises(TypeError) as info:
        EngineArgs.from_kwargs(model="m", tensor_paralel_size=2, max_model_length=4)
    assert "max_model_length" in str(info.value) and "tensor_paralel_size" in str(info.value)


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"max_model_len": 0}, "max_model_len"),
    ({"block_size": 12}, "block_size"),
    ({"dtype": "int8"}, "dtype"),
    ({"device": "tpu"}, "device"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ({"gpu_memory_utilization": 0}, "gpu_memory_utilization"),
    ({"kv_cache_memory_bytes": -1}, "kv_cache_memory_bytes"),
    ({"load_format": "pt"}, "load_format"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"max_num_batched_tokens": "many"}, "max_num_batched_tokens"),
    ({"seed": None}, "seed"),
])
def test_bad_engine_args_raise_naming_the_field(kwargs, field):
    with pytest.raises((ValueError, TypeError), match=field):
        EngineArgs(model="m", **kwargs)


def test_dtype_aliases_are_normalised():
    assert EngineArgs(model="m", dtype="bf16").dtype == "bfloat16"
    assert EngineArgs(model="m", dtype="half").dtype == "float16"


def test_every_engine_option_has_a_cli_flag():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    flags = {opt for action in parser._actions for opt in action.option_strings}
    for f in dataclasses.fields(EngineArgs):
        assert "--" + f.name.replace("_", "-") in flags, f.name


def test_cli_flags_parse_to_the_same_engine_args_as_keywords():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    ns = parser.parse_args(["--model", "/m", "--max-model-len", "128", "--dtype", "bf16",
                            "--kv-cache-memory-bytes", "4MiB", "--max-num-batched-tokens",
                            "none", "--device", "cpu", "--block-size", "32"])
    assert EngineArgs.from_cli_args(ns) == EngineArgs.from_kwargs(
        model="/m", max_model_len=128, dtype="bfloat16", kv_cache_memory_bytes=4 * 2**20,
        device="cpu", block_size=32)


def test_cli_rejects_bad_sizes_and_choices():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    for argv in (["--model", "m", "--kv-cache-memory-bytes", "lots"],
                 ["--model", "m", "--block-size", "12"]):
        with pytest.raises(SystemExit):
            parser.parse_args(argv)


# ------------------------------------------------------------------ check_model_config

_CONFIG = {"vocab_size": 8, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
           "num_attention_heads": 2, "max_position_embeddings": 8}


@pytest.mark.parametrize(("extra", "field"), [
    ({"rope_parameters": {"rope_type": "yarn", "factor": "abc"}}, "rope_parameters.factor"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0,
                       "original_max_position_embeddings": -5}},
     "rope_scaling.original_max_position_embeddings"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 0}}, "rope_parameters.factor"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 1.0}}, "low_freq_factor"),
    ({"rope_parameters": "yarn"}, "rope_parameters"),
    ({"rope_theta": -1.0}, "rope_theta"),
    ({"num_hidden_layers": 100000}, "num_hidden_layers"),
    ({"vocab_size": 10**12}, "vocab_size"),
    ({"hidden_size": 2**40}, "hidden_size"),
    ({"num_experts": 8, "num_experts_per_tok": 0}, "num_experts_per_tok"),
    ({"num_local_experts": 4, "num_experts_per_tok": 5}, "num_experts_per_tok"),
    ({"num_experts": -1, "num_experts_per_tok": 2}, "num_experts"),
    ({"num_experts": 8, "moe_intermediate_size": 0.5}, "moe_intermediate_size"),
    ({"shared_expert_intermediate_size": -64}, "shared_expert_intermediate_size"),
])
def test_check_model_config_refuses_garbage_naming_the_field(extra: dict, field: str) -> None:
    from pagellm.protocol.validation import check_model_config

    with pytest.raises(ValueError, match=field):
        check_model_config({**_CONFIG, **extra})


def test_check_model_config_takes_a_model_without_experts() -> None:
    """Granite 4.0's dense models say num_local_experts 0 and num_experts_per_tok 0 (a
    config transformers writes keeps its default of 2, unread without experts); a
    family whose block needs experts refuses none itself (registry.py, MoeSpec)."""
    from pagellm.protocol.validation import check_model_config

    for top_k in (0, 2):
        check_model_config({**_CONFIG, "num_local_experts": 0, "num_experts_per_tok": top_k})


def test_a_multimodal_config_is_checked_by_its_text_config() -> None:
    """A checkpoint whose text model sits in text_config (Qwen3.5's released ones): its
    sizes are checked there, the refusal naming text_config's field."""
    from pagellm.protocol.validation import check_model_config

    check_model_config({"text_config": _CONFIG, "vision_config": {"depth": 1}})
    with pytest.raises(ValueError, match=r"text_config\.num_attention_heads must be a "
                                         "positive integer, got 0"):
        check_model_config({"text_config": {**_CONFIG, "num_attention_heads": 0}})
    with pytest.raises(ValueError, match="vocab_size must be a positive integer"):
        check_model_config({"text_config": "not an object"})


def test_check_model_config_accepts_real_rope_scaling() -> None:
    from pagellm.protocol.validation import check_model_config

    check_model_config({**_CONFIG, "rope_theta": 500000.0, "rope_parameters": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192, "rope_theta": 500000.0}})
    check_model_config({**_CONFIG, "rope_scaling": {
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "attention_factor": None}})
