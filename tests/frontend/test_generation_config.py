"""frontend/generation_config.py and where its defaults apply (issue 39): the model's
generation_config.json sampling fields, as vLLM reads them, for whatever a request
leaves unset (LLM.generate without params, get_default_sampling_params, the server's
bodies), and max_new_tokens as the cap of an unset max_tokens. References: hand-written
files with the expected mapping, and transformers' greedy tokens on the same weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pagellm import SamplingParams
from pagellm.frontend.generation_config import default_sampling_fields
from pagellm.frontend.input_processor import InputProcessor
from pagellm.frontend.server.api_models import ChatCompletionRequest, ChatMessage
from pagellm.protocol.messages import EngineInfo


def _write(directory: Path, config: object) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "generation_config.json").write_text(json.dumps(config))
    return directory


def test_the_fields_vllm_takes_are_read_and_nothing_else(tmp_path):
    model = _write(tmp_path / "model", {
        "temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
        "repetition_penalty": 1.1, "max_new_tokens": 7, "do_sample": True,
        "eos_token_id": [2, 5], "typical_p": 0.5, "top_a": None})
    assert default_sampling_fields(str(model), "auto") == {
        "temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
        "repetition_penalty": 1.1, "max_tokens": 7}
    assert default_sampling_fields(str(model), "vllm") == {}
    other = _write(tmp_path / "other", {"temperature": 0.2})
    assert default_sampling_fields(str(model), str(other)) == {"temperature": 0.2}
    assert default_sampling_fields(str(tmp_path / "bare"), "auto") == {}  # none: no defaults
    with pytest.raises(ValueError, match=r"no generation_config\.json"):
        default_sampling_fields(str(model), str(tmp_path / "bare"))


@pytest.mark.parametrize(("content", "complaint"), [
    ({"temperature": -1.0}, "temperature"),
    ({"top_k": "many"}, "top_k"),
    ({"max_new_tokens": 0}, "max_tokens"),
    ([1, 2], "JSON object"),
])
def test_a_bad_file_is_an_error_naming_it(tmp_path, content, complaint):
    model = _write(tmp_path / "model", content)
    with pytest.raises(ValueError, match=complaint) as raised:
        default_sampling_fields(str(model), "auto")
    assert "generation_config.json" in str(raised.value)
    (model / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        default_sampling_fields(str(model), "auto")


def test_a_body_takes_the_models_defaults_for_what_it_leaves_unset():
    defaults = {"temperature": 0.0, "top_p": 0.9, "top_k": 20, "max_tokens": 7}
    body = ChatCompletionRequest(messages=[ChatMessage("user", "hi")], top_p=0.5)
    params = body.sampling_params(None, None, None, defaults)
    assert (params.temperature, params.top_p, params.top_k) == (0.0, 0.5, 20)
    assert params.max_tokens is None  # the cap is the InputProcessor's (it knows the room)
    plain = body.sampling_params(None, None, None)
    assert (plain.temperature, plain.top_k) == (SamplingParams().temperature, 0)


def test_max_new_tokens_caps_an_unset_max_tokens_within_the_room_left():
    info = EngineInfo("m", 64, 1000, 16, 64, 256, "cpu", "float32")
    inputs = InputProcessor(None, info, [2], default_max_tokens=7)
    prompt = {"prompt_token_ids": [5, 6, 7]}

    def resolved(max_tokens: int | None, processor: InputProcessor = inputs) -> int | None:
        request = processor.process_inputs("r", prompt, SamplingParams(max_tokens=max_tokens))
        return request.engine_requests[0].sampling_params.max_tokens

    assert resolved(None) == 7
    assert resolved(20) == 20  # a request's own value wins
    assert resolved(None, InputProcessor(None, info, [2])) == 64 - 3  # no cap: the room
    assert resolved(None, InputProcessor(None, info, [2], default_max_tokens=500)) == 64 - 3


def test_llm_without_params_samples_with_the_models_defaults(model_dirs, make_llm,
                                                           hf_reference, tmp_path):
    model = Path(shutil.copytree(model_dirs["llama"], tmp_path / "llama"))
    path = model / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    _write(model, {**config, "temperature": 0.0, "max_new_tokens": 5})
    llm = make_llm(model)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens) == (0.0, 5)
    prompt = "The quick brown fox"
    out = llm.generate(prompt, use_tqdm=False)[0]  # no params: greedy, 5 tokens
    assert out.outputs[0].token_ids == hf_reference("llama", out.prompt_token_ids, 5)
    capped = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=None),
                          use_tqdm=False)[0]
    assert capped.outputs[0].token_ids == out.outputs[0].token_ids
    plain = make_llm(model, generation_config="vllm").get_default_sampling_params()
    assert (plain.temperature, plain.max_tokens) == (SamplingParams().temperature,
                                                     SamplingParams().max_tokens)
