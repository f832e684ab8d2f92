"""Drop-in compatibility with vLLM's clients (issue #18, the HTTP half): vLLM's request
fields and response fields, unknown fields accepted and logged, OpenAI's error shape on
every error, echoed logprobs with offsets into the text. Against a live `pagellm serve`,
judged by transformers on the same weights and by hand."""

from __future__ import annotations

import json
import logging
from typing import Any

import openai
import pytest
import torch
from conftest import PROMPTS
from helpers import NAME, Server

from pagellm.frontend.server.api_models import ChatCompletionRequest
from pagellm.frontend.server.extra_fields import (
    LINES_PER_MINUTE,
    IgnoredFieldsLog,
    unknown_fields,
)

CAPITAL = "The capital of France is"
USER = [{"role": "user", "content": "Name a prime number."}]


@pytest.fixture(scope="module")
def served(model_dirs, tmp_path_factory):
    log = tmp_path_factory.mktemp("compat") / "server.log"
    s = Server(model_dirs["llama"], log=log)
    yield s, log
    assert s.stop() == 0


@pytest.fixture(scope="module")
def server(served):
    return served[0]


@pytest.fixture(scope="module")
def tokenizer(model_dirs):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dirs["llama"])


@pytest.fixture(scope="module")
def hf_log_softmax(model_dirs):
    """Per prompt position, transformers' log-probabilities of the next token (fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dirs["llama"],
                                                 dtype=torch.float32).eval()

    def compute(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]
        return torch.log_softmax(logits.float(), dim=-1)  # [len(ids), vocab]

    return compute


def chat_ids(tokenizer: Any, messages: list[dict[str, str]], **kwargs: Any) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False,
                                              **kwargs))


def assert_prompt_logprobs(entries: list[Any], ids: list[int], reference: torch.Tensor
                           ) -> None:
    """vLLM's prompt_logprobs: None first, then the actual token's logprob and rank
    (1 + how many tokens transformers finds likelier) and the top alternatives."""
    assert entries[0] is None and len(entries) == len(ids)
    for k in range(1, len(ids)):
        row = reference[k - 1]
        actual = entries[k][str(ids[k])]
        assert abs(actual["logprob"] - row[ids[k]].item()) < 1e-4, k
        assert actual["rank"] == 1 + int((row > row[ids[k]] + 1e-5).sum())
        for token, lp in entries[k].items():
            assert abs(lp["logprob"] - row[int(token)].item()) < 1e-4


# --- unknown and unserved fields --------------------------------------------------------


def test_unknown_fields_are_accepted_and_logged_once(served):
    server, log = served
    body = {"model": NAME, "prompt": "x", "max_tokens": 2, "frobnicate_level": 3,
            "reasoning_effort": "low"}
    for _ in range(3):
        status, response = server.post("/v1/completions", body)
        assert status == 200, response
    status, response = server.post("/v1/chat/completions", {
        "model": NAME, "max_tokens": 2, "frobnicate_level": 3,
        "messages": [{"role": "user", "content": "x", "vendor_note": "y"}],
        "stream_options": None})
    assert status == 200, response
    lines = [line for line in log.read_text().splitlines() if "ignored" in line]
    assert sum("frobnicate_level" in line for line in lines) == 1, lines
    assert sum("reasoning_effort" in line for line in lines) == 1, lines
    assert sum("messages[0].vendor_note" in line for line in lines) == 1, lines
    assert all("The following fields were present in the request but ignored" in line
               for line in lines)


def test_unknown_field_names_nested_structs():
    body = json.dumps({"messages": [{"role": "user", "x": 1}, {"role": "user"}],
                       "stream_options": {"include_usage": True, "y": 2}, "z": [1]}).encode()
    assert unknown_fields(body, ChatCompletionRequest) == \
        ["messages[0].x", "stream_options.y", "z"]


def test_the_ignored_fields_log_is_rate_limited(caplog):
    log = IgnoredFieldsLog()
    # The pagellm logger stops propagating once any test configured it (logger.py): hand
    # caplog's handler to it directly, so the count is the same alone and in the suite.
    # Not propagating meanwhile: alone (nothing configured it yet) caplog's root handler
    # would see every record a second time.
    pagellm_logger = logging.getLogger("pagellm")
    pagellm_logger.addHandler(caplog.handler)
    propagate, pagellm_logger.propagate = pagellm_logger.propagate, False
    try:
        with caplog.at_level(logging.WARNING, logger="pagellm"):
            for i in range(3 * LINES_PER_MINUTE):
                log.note([f"field_{i}", "x" * 10_000])
    finally:
        pagellm_logger.removeHandler(caplog.handler)
        pagellm_logger.propagate = propagate
    assert len(caplog.records) == LINES_PER_MINUTE
    assert all(len(r.getMessage()) < 300 for r in caplog.records)  # names are cut


UNSERVED = [
    ("/v1/completions", {"prompt": "x", "use_beam_search": True}, "use_beam_search"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": "x", "logits_processors": ["m.f"]}, "logits_processors"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True},
     "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    # Issue 39: these took the unknown-field path on /v1/completions (a 200, free text);
    # response_format is served now (tests/frontend/server/test_agent_requests.py).
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "xml"}},
     "response_format"),
    ("/v1/completions", {"prompt": "x", "tools": [{"type": "function", "function": {
        "name": "f"}}]}, "tools"),
    ("/v1/completions", {"prompt": "x", "tool_choice": "required"}, "tools"),
    ("/v1/chat/completions", {"messages": USER, "echo": True}, "echo"),
    ("/v1/chat/completions", {"messages": USER, "functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"messages": USER, "documents": [{"text": "d"}]}, "documents"),
    ("/v1/chat/completions", {"messages": USER, "continue_final_message": True},
     "continue_final_message"),
]


def test_fields_that_would_silently_change_results_are_400s_naming_them(server):
    for path, body, name in UNSERVED:
        status, response = server.post(path, {"model": NAME, **body})
        assert status == 400, (body, response)
        assert name in response["error"]["message"], (body, response)
    status, response = server.post("/v1/completions", {
        "model": NAME, "prompt": "x", "max_tokens": 2, "use_beam_search": False,
        "best_of": 1, "guided_json": None, "response_format": {"type": "text"},
        "tool_choice": "none"})
    assert status == 200, response  # defaults are fine


# --- error shape, ping, tokenizer_info --------------------------------------------------------


def test_every_error_has_openais_shape(server):
    for method, path, status, kind in [("GET", "/no/such/route", 404, "NotFoundError"),
                                       ("POST", "/v1/nope", 404, "NotFoundError"),
                                       ("GET", "/v1/completions", 405,
                                        "MethodNotAllowedError"),
                                       ("POST", "/health", 405, "MethodNotAllowedError")]:
        got, data = server.request(method, path, {} if method == "POST" else None)
        error = json.loads(data)["error"]
        assert got == status and error["code"] == status and error["type"] == kind
        assert path in error["message"] and set(error) == {"message", "type", "param",
                                                            "code"}
    with pytest.raises(openai.NotFoundError):  # the client parses it
        server.client().post("/no/such/route", cast_to=dict, body={})


def test_ping_answers_get_and_post(server):
    assert server.get("/ping")[0] == 200
    assert server.request("POST", "/ping")[0] == 200


def test_tokenizer_info_describes_the_tokenizer(server, tokenizer):
    status, data = server.get("/tokenizer_info")
    info = json.loads(data)
    assert status == 200
    assert info["tokenizer_class"] == type(tokenizer).__name__
    assert info["chat_template"] == tokenizer.chat_template
    assert info["eos_token"] == tokenizer.eos_token
    assert info["pad_token"] == tokenizer.pad_token
    _, models = server.get("/v1/models")
    assert info["model_max_length"] <= json.loads(models)["data"][0]["max_model_len"]
    assert not any(key.endswith("_file") for key in info)


def test_the_model_card_has_vllms_fields(server):
    """Issue 39: vLLM's /v1/models has parent and a permission entry; clients that
    parse OpenAI's older schema need them."""
    status, data = server.get("/v1/models")
    card = json.loads(data)["data"][0]
    assert status == 200 and card["id"] == NAME and card["parent"] is None
    [permission] = card["permission"]
    assert permission["object"] == "model_permission"
    assert permission["id"].startswith("modelperm-")
    assert permission["allow_sampling"] is True and permission["allow_logprobs"] is True
    assert permission["organization"] == "*" and permission["group"] is None


# --- echo and prompt logprobs ---------------------------------------------------------


@pytest.mark.parametrize("prompt", [CAPITAL, PROMPTS[3], PROMPTS[9]])
def test_echoed_logprobs_start_at_the_first_token_with_offsets_into_the_text(
        server, tokenizer, prompt):
    choice = server.client().completions.create(model=NAME, prompt=prompt, max_tokens=6,
                                                temperature=0, echo=True, logprobs=1
                                                ).choices[0]
    lp, text = choice.logprobs, choice.text
    ids = tokenizer.encode(prompt)
    assert text.startswith(prompt)
    assert len(lp.tokens) == len(ids) + 6
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None for v in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == text
    for token, offset in zip(lp.tokens, lp.text_offset, strict=True):
        assert text[offset:offset + len(token)] == token
    if prompt == CAPITAL:  # ASCII: each token decodes alone; offsets by hand
        assert lp.tokens[:len(ids)] == [tokenizer.decode([t]) for t in ids]
        assert lp.tokens[0] == tokenizer.decode(ids[:1]) != ""
        assert lp.text_offset[:len(ids)] == [len(tokenizer.decode(ids[:k]))
                                            for k in range(len(ids))]


def test_echo_with_max_tokens_0_scores_the_prompt(server, tokenizer, hf_log_softmax):
    response = server.client().completions.create(model=NAME, prompt=CAPITAL,
                                                  max_tokens=0, echo=True, logprobs=0)
    choice, ids = response.choices[0], tokenizer.encode(CAPITAL)
    assert choice.text == CAPITAL
    assert choice.logprobs.tokens == [tokenizer.decode([t]) for t in ids]
    reference = hf_log_softmax(ids)
    assert choice.logprobs.token_logprobs[0] is None
    for k in range(1, len(ids)):
        assert abs(choice.logprobs.token_logprobs[k] - reference[k - 1, ids[k]].item()) \
            < 1e-4
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (len(ids), 0)


def test_prompt_logprobs_equal_transformers_log_softmax(server, tokenizer, hf_log_softmax):
    ids = tokenizer.encode(PROMPTS[1])
    status, response = server.post("/v1/completions", {
        "model": NAME, "prompt": PROMPTS[1], "max_tokens": 1, "prompt_logprobs": 3})
    assert status == 200, response
    entries = response["choices"][0]["prompt_logprobs"]
    assert_prompt_logprobs(entries, ids, hf_log_softmax(ids))
    assert all(len(e) >= 3 for e in entries[1:])

    status, response = server.post("/v1/chat/completions", {
        "model": NAME, "messages": USER, "max_tokens": 1, "prompt_logprobs": 0,
        "return_token_ids": True})
    assert status == 200, response
    chat = chat_ids(tokenizer, USER, add_generation_prompt=True)
    assert response["prompt_token_ids"] == chat
    assert_prompt_logprobs(response["prompt_logprobs"], chat, hf_log_softmax(chat))


# --- token ids ---------------------------------------------------------------------------


def test_return_token_ids_gives_the_prompt_and_generated_ids(server, tokenizer, hf_reference):
    client = server.client()
    ids = tokenizer.encode(PROMPTS[1])
    completion = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=8,
                                           temperature=0,
                                           extra_body={"return_token_ids": True})
    choice = completion.choices[0].model_dump()
    assert choice["prompt_token_ids"] == ids
    assert choice["token_ids"] == hf_reference("llama", ids, 8)

    stream = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=8,
                                       temperature=0, stream=True,
                                       extra_body={"return_token_ids": True})
    chunks = [c.choices[0].model_dump() for c in stream if c.choices]
    assert chunks[0]["prompt_token_ids"] == ids
    assert all(c["prompt_token_ids"] is None for c in chunks[1:])
    assert [t for c in chunks for t in c["token_ids"]] == choice["token_ids"]

    chat = client.chat.completions.create(model=NAME, messages=USER, max_tokens=8,
                                          temperature=0,
                                          extra_body={"return_token_ids": True})
    prompt = chat_ids(tokenizer, USER, add_generation_prompt=True)
    assert chat.model_dump()["prompt_token_ids"] == prompt
    assert chat.choices[0].model_dump()["token_ids"] == hf_reference("llama", prompt, 8)

    plain = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=1,
                                      extra_body={"return_token_ids": True,
                                                  "add_special_tokens": False})
    assert plain.choices[0].model_dump()["prompt_token_ids"] == \
        tokenizer.encode(PROMPTS[0], add_special_tokens=False)


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(server):
    client = server.client()
    extra = {"return_tokens_as_token_ids": True, "return_token_ids": True}
    choice = client.completions.create(model=NAME, prompt=CAPITAL, max_tokens=5,
                                       temperature=0, logprobs=2, extra_body=extra
                                       ).choices[0]
    ids = choice.model_dump()["token_ids"]
    assert choice.logprobs.tokens == [f"token_id:{t}" for t in ids]
    assert all(all(k.startswith("token_id:") for k in top)
               for top in choice.logprobs.top_logprobs)
    chat = client.chat.completions.create(model=NAME, messages=USER, max_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body=extra).choices[0]
    ids = chat.model_dump()["token_ids"]
    assert [t.token for t in chat.logprobs.content] == [f"token_id:{t}" for t in ids]
    assert all(t.bytes == list(t.token.encode()) for t in chat.logprobs.content)


# --- chat prompts ------------------------------------------------------------------------


def test_continue_final_message_continues_the_assistant(server, tokenizer, hf_reference):
    messages = [*USER, {"role": "assistant", "content": "The answer is"}]
    chat = server.client().chat.completions.create(
        model=NAME, messages=messages, max_tokens=6, temperature=0,  # type: ignore[arg-type]
        extra_body={"continue_final_message": True, "add_generation_prompt": False,
                    "return_token_ids": True})
    expected = chat_ids(tokenizer, messages, continue_final_message=True)
    assert chat.model_dump()["prompt_token_ids"] == expected
    assert tokenizer.decode(expected).endswith("The answer is")
    assert chat.choices[0].model_dump()["token_ids"] == hf_reference("llama", expected, 6)
    status, tokens = server.post("/tokenize", {"messages": messages,
                                               "add_generation_prompt": False,
                                               "continue_final_message": True})
    assert status == 200 and tokens["tokens"] == expected


def test_add_special_tokens_in_chat_tokenizes_the_rendered_template_with_them(
        server, tokenizer):
    text = tokenizer.apply_chat_template(USER, tokenize=False, add_generation_prompt=True)
    for flag in (False, True):
        chat = server.client().chat.completions.create(
            model=NAME, messages=USER, max_tokens=1,  # type: ignore[arg-type]
            extra_body={"add_special_tokens": flag, "return_token_ids": True})
        assert chat.model_dump()["prompt_token_ids"] == \
            tokenizer.encode(text, add_special_tokens=flag)


# --- streaming usage ---------------------------------------------------------------------


@pytest.mark.parametrize("path", ["completions", "chat"])
def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(server, path):
    client = server.client()
    options = {"include_usage": True, "continuous_usage_stats": True}
    if path == "completions":
        stream = client.completions.create(model=NAME, prompt=CAPITAL, max_tokens=7,
                                           temperature=0, stream=True,
                                           extra_body={"stream_options": options})
    else:
        stream = client.chat.completions.create(model=NAME, messages=USER,  # type: ignore
                                                max_tokens=7, temperature=0, stream=True,
                                                extra_body={"stream_options": options})
    chunks = list(stream)
    assert all(c.usage is not None for c in chunks)
    completion = [c.usage.completion_tokens for c in chunks]
    assert completion == sorted(completion) and completion[-1] == 7
    assert len({c.usage.prompt_tokens for c in chunks}) == 1
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
               for c in chunks)
    assert chunks[-1].choices == []  # the final usage chunk, as with include_usage alone
