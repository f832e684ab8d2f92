"""frontend/server/template_sandbox.py: chat templates sent by clients render in a
killable child process with a time limit (issue 12, finding 3; the class of vLLM's
CVE-2025-61620): a nested loop is cut off while /health stays fast, a string bomb fails
alone, apply_chat_template's own options are refused. References: /health's latency
while a template spins, and for a harmless template transformers' tokenizer and greedy
tokens on the text it renders. Against the `guarded` server (tests/conftest.py)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from guarded_server import MESSAGES, post, timed_health
from helpers import NAME


@pytest.fixture(scope="module")
def tokenizer(model_dirs):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dirs["llama"])


def test_chat_templates_from_requests_run_sandboxed_with_a_time_limit(guarded, tokenizer,
                                                                       hf_reference):
    """Finding 3: a nested-loop template froze /health and even SIGTERM (the class of
    vLLM's CVE-2025-61620). Requests' templates now render in a killable process."""
    loop = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
            "{% endfor %}")
    bomb = "{{ 'x' * 10000000000 }}"
    with ThreadPoolExecutor(2) as pool:
        slow = pool.submit(post, guarded, "/v1/chat/completions", {
            "model": NAME, "messages": MESSAGES, "chat_template": loop})
        time.sleep(0.5)
        health = [timed_health(guarded) for _ in range(5)]  # while the template spins
        status, body = slow.result()
    assert status == 400 and "did not finish within 5 s" in body["error"]["message"], body
    assert max(health) < 2.0, health
    status, body = post(guarded, "/v1/chat/completions", {
        "model": NAME, "messages": MESSAGES, "chat_template_kwargs": {"chat_template": bomb}})
    assert status == 400 and "chat template failed" in body["error"]["message"], body
    # A harmless custom template works, and its tokens are the rendered text's.
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    status, body = post(guarded, "/v1/chat/completions", {
        "model": NAME, "messages": MESSAGES, "chat_template": template, "max_tokens": 6,
        "temperature": 0})
    assert status == 200, body
    ids = tokenizer.encode("<user>Tell me about blocks.\n", add_special_tokens=False)
    assert body["usage"]["prompt_tokens"] == len(ids)
    expected = tokenizer.decode(hf_reference("llama", ids, 6), skip_special_tokens=True)
    assert body["choices"][0]["message"]["content"] == expected
    status, body = post(guarded, "/v1/chat/completions", {
        "model": NAME, "messages": MESSAGES, "chat_template_kwargs": {"return_tensors": "pt"}})
    assert status == 400 and "return_tensors" in body["error"]["message"]
