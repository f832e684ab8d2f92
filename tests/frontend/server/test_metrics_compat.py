"""/metrics under vLLM's names, labels and meanings (what vLLM's Grafana dashboard
queries), read with prometheus_client's own parser after a known workload."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest
from helpers import NAME, Server

TEMPLATE = "{% for m in messages %}<<{{ m.role }}: {{ m.content }}>>{% endfor %}"


@pytest.fixture(scope="module")
def server(model_dirs, tmp_path_factory):
    template = Path(tmp_path_factory.mktemp("template")) / "chat.jinja"
    template.write_text(TEMPLATE)
    s = Server(model_dirs["llama"], "--chat-template", str(template),
               "--disable-log-requests", "--trust-remote-code", "--disable-log-stats")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def tokenizer(model_dirs):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dirs["llama"])


def samples(server: Server) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Sample name -> [(labels, value)], as Prometheus would read them."""
    from prometheus_client.parser import text_string_to_metric_families

    result: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    for family in text_string_to_metric_families(server.get("/metrics")[1].decode()):
        for sample in family.samples:
            result[sample.name].append((sample.labels, sample.value))
    return result


def total(found: dict[str, list[tuple[dict[str, str], float]]], name: str,
          **labels: str) -> float:
    return sum(value for sample_labels, value in found[name]
               if all(sample_labels.get(k) == v for k, v in labels.items()))


STREAMED = 64  # tokens of each streamed completion


@pytest.mark.slow
def test_a_known_workload_counts_each_completion_once_under_vllm_names(server, tokenizer):
    before = samples(server)
    prompts = ["one two three", "four five"]
    # One request with two prompts of 4 tokens, one streamed of 64 (inter-token
    # latencies are observed between streamed outputs; a stream read slower than the
    # engine steps gets several tokens per output, so it is long enough to be split).
    for body in ({"prompt": prompts, "n": 2, "max_tokens": 4},
                 {"prompt": "six", "n": 2, "stream": True, "max_tokens": STREAMED}):
        status, reply = server.request("POST", "/v1/completions", {
            "model": NAME, "temperature": 1.0, "ignore_eos": True, **body})
        assert status == 200, reply
    after = samples(server)

    def delta(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    # 3 prompts, each of n=2 completions. As in vLLM V1 (n child requests), each
    # completion is a request: every request counter agrees on 6.
    prompts_sent, completions = 3, 6
    for name in ("vllm:request_success_total", "vllm:e2e_request_latency_seconds_count",
                 "vllm:time_to_first_token_seconds_count",
                 "vllm:request_generation_tokens_count",
                 "vllm:request_prompt_tokens_count"):
        assert delta(name) == completions, name
    assert delta("vllm:request_success_total", finished_reason="length") == completions
    assert delta("vllm:request_params_n_count") == prompts_sent
    assert delta("vllm:request_params_n_sum") == 2 * prompts_sent
    generated = 4 * 4 + 2 * STREAMED
    assert delta("vllm:generation_tokens_total") == generated
    assert delta("vllm:request_generation_tokens_sum") == generated
    prompt_tokens = 2 * sum(len(tokenizer.encode(p)) for p in [*prompts, "six"])
    assert delta("vllm:prompt_tokens_total") == prompt_tokens
    assert delta("vllm:request_prompt_tokens_sum") == prompt_tokens
    # Inter-token intervals: at most STREAMED - 1 per streamed completion (fewer when
    # one streamed delta carries several steps' tokens); none for the unstreamed ones.
    assert 0 < delta("vllm:inter_token_latency_seconds_count") <= 2 * (STREAMED - 1)
    assert delta("vllm:prefix_cache_queries_total") > 0

    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prefix_cache_hits_total",
                 "vllm:num_preemptions_total", "vllm:inter_token_latency_seconds_count",
                 "vllm:time_per_output_token_seconds_count"):
        assert name in after, name
    # vLLM's labels on every vLLM metric: the served name and the engine index.
    vllm_samples = [(name, labels) for name, found in after.items()
                    if name.startswith("vllm:") for labels, _ in found]
    assert vllm_samples
    for name, labels in vllm_samples:
        assert labels.get("model_name") == NAME and labels.get("engine") == "0", name
    assert not [name for name in after if name.startswith("pagellm:")
                and name != "pagellm:engine_num_steps"]


@pytest.mark.slow
def test_chat_template_flag_replaces_the_tokenizers_template(server, tokenizer):
    messages = [{"role": "user", "content": "hi"}]
    status, body = server.post("/tokenize", {"messages": messages})
    assert status == 200, body
    assert body["tokens"] == tokenizer.encode("<<user: hi>>", add_special_tokens=False)
