"""frontend/server/serving.py: the checks only the server can make, before the work
lands on its event loop or on the one tokenizer thread every request shares (issue 12):
a prompt too long for max_model_len is refused by its characters before it is
tokenized, lists are counted before they are walked (/detokenize's ids in app.py, chat
messages, logit_bias in api_models.py), every string a chat template may render counts
toward the prompt's size, and a stream the engine refuses after its 200 ends with an
error event. Against the `guarded` and `dev_server` servers (tests/conftest.py); the
reference for a server that stays responsive is /health's latency meanwhile."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest
from guarded_server import MESSAGES, completion_text, post, timed_health
from helpers import NAME


def test_a_huge_prompt_is_refused_before_tokenization_and_health_stays_fast(guarded):
    """Finding 6: a 10 MB /tokenize (tokenized on the event loop) blocked the server."""
    prompt = "a b " * 2_500_000  # 10 MB
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(post, guarded, path, body) for path, body in (
            ("/tokenize", {"prompt": prompt}),
            ("/v1/completions", {"model": NAME, "prompt": prompt}),
            ("/v1/chat/completions", {"model": NAME, "messages": [
                {"role": "user", "content": prompt}]}))]
        health = [timed_health(guarded) for _ in range(5)]
        results = [f.result() for f in futures]
    for status, body in results:
        assert status == 400 and "characters: more than max_model_len" in \
            body["error"]["message"], body
    assert max(health) < 2.0, health


def test_lists_are_counted_before_they_are_walked(guarded):
    """Review 2: a 14 MB /detokenize list (an 84 MB answer), 1.2M chat messages and 1.3M
    logit_bias keys were each walked on the event loop before being refused (2 s of a
    frozen /health apiece)."""
    limit = post(guarded, "/tokenize", {"prompt": "x"})[1]["max_model_len"]
    status, body = post(guarded, "/detokenize", {"tokens": [1] * (limit + 1)})
    assert status == 400 and f"more than max_model_len={limit}" in body["error"]["message"]
    assert post(guarded, "/detokenize", {"tokens": [1] * 8})[0] == 200
    status, body = post(guarded, "/v1/chat/completions", {
        "model": NAME, "messages": [{"role": "user", "content": "x"}] * (2**16 + 1)})
    assert status == 400 and "65537 messages, more than 65536" in body["error"]["message"]
    from pagellm.frontend.server.api_models import CompletionRequest

    request = msgspec.convert({"prompt": "x", "logit_bias": {str(i): 1 for i in range(
        2**20 + 1)}}, CompletionRequest)
    with pytest.raises(ValueError, match="logit_bias has 1048577 entries"):
        request.sampling_params(4, None)


def test_chat_roles_and_template_variables_count_toward_the_prompt_size(guarded):
    """Only message contents were counted: a 15 MB `role` was tokenized on the one
    tokenizer thread every request shares (17 s for everyone). Every string the
    template may render is counted before rendering, and the rendered text again
    before tokenizing (a trusted template may repeat what it is given)."""
    huge = "x" * 200_000  # more characters than max_model_len tokens can hold
    repeat = "{% for i in range(100000) %}{{ messages[0]['content'] }}{% endfor %}"
    for body, refused in (
            ({"messages": [{"role": huge, "content": "hi"}]}, "messages is 2000"),
            ({"messages": MESSAGES, "chat_template_kwargs": {"note": huge}}, "messages is"),
            ({"messages": MESSAGES, "chat_template": repeat}, "the rendered chat is")):
        status, response = post(guarded, "/v1/chat/completions",
                                 {"model": NAME, "max_tokens": 2, **body})
        assert status == 400, response
        message = response["error"]["message"]
        assert refused in message and "characters" in message, message
    assert completion_text(guarded, prompt="still serving")


def test_a_stream_the_engine_refuses_ends_with_an_error_event(dev_server):
    """The 200 and its headers are out before the engine answers: a refusal (here: the
    engine sleeps) must arrive as an error event and [DONE], not a dropped connection."""
    assert dev_server.request("POST", "/sleep?level=1")[0] == 200
    try:
        status, data = dev_server.request("POST", "/v1/completions", {
            "model": NAME, "prompt": "hi", "max_tokens": 4, "stream": True})
        assert status == 200
        events = [line.removeprefix(b"data: ") for line in data.split(b"\n\n") if line]
        assert events[-1] == b"[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == 503 and "sleeping" in error["message"], error
    finally:
        assert dev_server.request("POST", "/wake_up")[0] == 200


# A template that shows every field a tool conversation carries (the demo model's own
# ChatML template renders role and content alone).
TOOL_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}{% if m.name %}:{{ m.name }}{% endif %}"
    "{% if m.tool_call_id %}#{{ m.tool_call_id }}{% endif %}]{{ m['content'] }}"
    "{% for c in m.tool_calls or [] %}<call {{ c['function']['name'] }} "
    "{{ c['function']['arguments'] | tojson }}>{% endfor %}{% endfor %}"
    "{% for t in tools or [] %}<tool {{ t['function']['name'] }}>{% endfor %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}}}}
TOOL_HISTORY = [
    {"role": "user", "name": "ana", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]


EFFORT_TEMPLATE = "effort={{ reasoning_effort | default('unset') }}"


def test_reasoning_effort_is_a_template_variable(guarded, model_dirs):
    """OpenAI's reasoning_effort reaches the template as gpt-oss's reads it (its system
    message), chat_template_kwargs win over it, and the Responses API's reasoning.effort
    takes the same way; a value outside low/medium/high is a 400 naming the field.
    Reference: the tokenizer's encoding of the text the template must render."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dirs["llama"])  # the server's model
    for extra, rendered in (({}, "unset"), ({"reasoning_effort": "low"}, "low"),
                            ({"reasoning_effort": "low",
                              "chat_template_kwargs": {"reasoning_effort": "high"}}, "high")):
        status, response = post(guarded, "/v1/chat/completions", {
            "model": NAME, "messages": MESSAGES, "chat_template": EFFORT_TEMPLATE,
            "max_tokens": 1, "return_token_ids": True, **extra})
        assert status == 200, response
        assert response["prompt_token_ids"] == tokenizer.encode(f"effort={rendered}",
                                                                add_special_tokens=False)
    status, response = post(guarded, "/v1/chat/completions", {
        "model": NAME, "messages": MESSAGES, "max_tokens": 1, "reasoning_effort": "max"})
    assert status == 400 and "reasoning_effort" in response["error"]["message"], response
    status, response = post(guarded, "/v1/responses", {
        "model": NAME, "input": "Hi", "max_output_tokens": 1,
        "reasoning": {"effort": "minimal"}})
    assert status == 400 and "reasoning.effort" in response["error"]["message"], response


def test_a_tool_conversation_reaches_the_template_whole(guarded, model_dirs):
    """Issue 39: name, an assistant's tool_calls and a tool message's tool_call_id were
    dropped before the chat template (role and content alone reached it), and tools
    with tool_choice "none" were a 400. Reference: transformers' apply_chat_template on
    the conversation as vLLM hands it over (each call's JSON arguments parsed)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dirs["llama"])  # the server's model
    status, response = post(guarded, "/v1/chat/completions", {
        "model": NAME, "messages": TOOL_HISTORY, "tools": [WEATHER], "tool_choice": "none",
        "chat_template": TOOL_TEMPLATE, "max_tokens": 1, "return_token_ids": True})
    assert status == 200, response
    conversation = json.loads(json.dumps(TOOL_HISTORY))
    conversation[1]["content"] = ""
    conversation[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    text = tokenizer.apply_chat_template(conversation, chat_template=TOOL_TEMPLATE,
                                         tools=[WEATHER], tokenize=False)
    assert "[tool#call_1]" in text and '<call get_weather {"city": "Paris"}>' in text
    assert "[user:ana]" in text and text.endswith("<tool get_weather>")
    assert response["prompt_token_ids"] == tokenizer.encode(text, add_special_tokens=False)
    # "auto" (the default with tools) needs a parser this server was not given.
    status, response = post(guarded, "/v1/chat/completions", {
        "model": NAME, "messages": MESSAGES, "max_tokens": 1, "tools": [WEATHER]})
    assert status == 400, response
    assert "--enable-auto-tool-choice" in response["error"]["message"], response
