"""Prometheus metrics for the server under vLLM's names, labels and meanings, so that
dashboards and alerts written for vLLM (its Grafana dashboard, autoscalers reading
`vllm:num_requests_waiting`) work unchanged. In a registry of their own (several
servers in one process, as in tests, do not collide).

Every metric has vLLM V1's labels `model_name` (the served name) and `engine` (the
data-parallel rank, "0" with one engine core). Engine gauges and cumulative counters
come from `get_stats()` at scrape time, one series per engine core. Request metrics
are observed as outputs stream out of `AsyncLLM`; the frontend does not learn which
core served a request, so with data parallelism they carry engine="all".

One request is one completion, as in vLLM V1 (a request of `n` completions runs there
as n child requests): `vllm:request_success_total`, `vllm:e2e_request_latency_seconds_count`
and `vllm:time_to_first_token_seconds_count` count the same things, once each.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pagellm.frontend.outputs import RequestOutput
from pagellm.protocol.stats import EngineStats

# vLLM's buckets (vllm/v1/metrics/loggers.py), so histogram_quantile reads alike.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_N_BUCKETS = (1, 2, 5, 10, 20)
LABELS = ["model_name", "engine"]
# vLLM's speculative decoding counters: (name, help, EngineStats field).
_SPEC_DECODE = (
    ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", "spec_num_drafts"),
    ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", "spec_num_draft_tokens"),
    ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
     "spec_num_accepted_tokens"))


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    buckets: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return tuple(buckets)
            buckets.append(value)
        exponent += 1


class _EngineCollector:
    """Yields the last engine snapshot: one series per engine core."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: EngineStats | None = None

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        if stats is None:
            return
        cores = stats.per_engine or [stats]  # data parallel: by rank

        def family(kind: type[GaugeMetricFamily] | type[CounterMetricFamily], name: str,
                   doc: str, field: str) -> Metric:
            metric = kind(name, doc, labels=LABELS)
            for rank, core in enumerate(cores):
                metric.add_metric([self.model_name, str(rank)], getattr(core, field))
            return metric

        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        yield family(gauge, "vllm:num_requests_running",
                     "Number of requests in model execution batches.", "num_running_reqs")
        yield family(gauge, "vllm:num_requests_waiting",
                     "Number of requests waiting to be processed.", "num_waiting_reqs")
        yield family(gauge, "vllm:kv_cache_usage_perc",
                     "KV-cache usage. 1 means 100 percent usage.", "kv_cache_usage")
        yield family(counter, "vllm:prefix_cache_queries",
                     "Prefix cache queries, in terms of number of queried tokens.",
                     "prefix_cache_queries")
        yield family(counter, "vllm:prefix_cache_hits",
                     "Prefix cache hits, in terms of number of cached tokens.",
                     "prefix_cache_hits")
        yield family(counter, "vllm:num_preemptions",
                     "Cumulative number of preemption from the engine.", "num_preemptions")
        if any(core.spec_accepted_per_pos for core in cores):  # speculative decoding on
            for name, doc, field in _SPEC_DECODE:
                yield family(counter, name, doc, field)
            yield self._accepted_per_position(cores)
        # pagellm's own (no vLLM counterpart): steps run by each engine core.
        yield family(gauge, "pagellm:engine_num_steps", "Engine steps run by this core.",
                     "num_steps")

    def _accepted_per_position(self, cores: list[EngineStats]) -> Metric:
        """vLLM's per-position acceptance counter (its length is the engine's
        num_speculative_tokens)."""
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted tokens per draft position.",
                                      labels=[*LABELS, "position"])
        for rank, core in enumerate(cores):
            for position, count in enumerate(core.spec_accepted_per_pos):
                per_pos.add_metric([self.model_name, str(rank), str(position)], count)
        return per_pos


class ServerMetrics:
    def __init__(self, model_name: str, max_model_len: int, data_parallel: bool = False
                 ) -> None:
        self.registry = CollectorRegistry()
        self.engine = _EngineCollector(model_name)
        self.registry.register(self.engine)
        self.labels = (model_name, "all" if data_parallel else "0")
        r = self.registry
        tokens = build_1_2_5_buckets(max_model_len)
        # prometheus_client adds "_total" to counters: vllm:prompt_tokens_total.
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens "
                                     "processed.", LABELS, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation "
                                         "tokens processed.", LABELS, registry=r)
        self.request_success = Counter("vllm:request_success", "Count of successfully "
                                       "processed requests.", [*LABELS, "finished_reason"],
                                       registry=r)
        self.request_prompt_tokens = Histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", LABELS,
            buckets=tokens, registry=r)
        self.request_generation_tokens = Histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.",
            LABELS, buckets=tokens, registry=r)
        self.request_params_n = Histogram("vllm:request_params_n", "Histogram of the n "
                                          "request parameter.", LABELS, buckets=_N_BUCKETS,
                                          registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", LABELS,
                              buckets=_TTFT_BUCKETS, registry=r)
        # vLLM up to 0.10 named the inter-token interval time_per_output_token_seconds;
        # later versions inter_token_latency_seconds. Both, with the same observations.
        self.itl = Histogram("vllm:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", LABELS,
                             buckets=_ITL_BUCKETS, registry=r)
        self.tpot = Histogram("vllm:time_per_output_token_seconds",
                              "Histogram of time per output token in seconds.", LABELS,
                              buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.", LABELS,
                             buckets=_E2E_BUCKETS, registry=r)
        # The model's series exist from the start, zero until observed, as vLLM's do (its
        # logger creates each labelled child up front): a scrape never lacks one because
        # no request has produced it yet (one request's tokens can arrive in one delta,
        # with no inter-token interval to observe).
        for metric in (self.prompt_tokens, self.generation_tokens,
                       self.request_prompt_tokens, self.request_generation_tokens,
                       self.request_params_n, self.ttft, self.itl, self.tpot, self.e2e):
            metric.labels(*self.labels)

        # Per LoRA adapter (pagellm's own: vLLM has only a gauge of the adapters running).
        self.lora_requests = Counter("pagellm:lora_requests", "Completions finished, per "
                                     "LoRA adapter.", [*LABELS, "lora_name"], registry=r)
        self.lora_generation_tokens = Counter(
            "pagellm:lora_generation_tokens", "Generation tokens, per LoRA adapter.",
            [*LABELS, "lora_name"], registry=r)

    def render(self, stats: EngineStats | None) -> bytes:
        self.engine.stats = stats
        return generate_latest(self.registry)

    def tracker(self, n: int, lora_name: str | None = None) -> RequestTracker:
        """A tracker for one request of `n` completions (of LoRA adapter `lora_name`)."""
        return RequestTracker(self, n, lora_name)


class RequestTracker:
    """Observes one request's stream. As in vLLM V1, where a request of `n` completions
    runs as n child requests, each completion counts as a request of its own: its time to
    first token, inter-token intervals, prompt tokens, end-to-end latency and success
    (with its own finished_reason) are observed once each, so every request counter and
    histogram count agrees; only `request_params_n` is observed once per user request."""

    def __init__(self, metrics: ServerMetrics, n: int, lora_name: str | None = None) -> None:
        self.metrics = metrics
        self.n = n
        self.lora_labels = None if lora_name is None else (*metrics.labels, lora_name)
        self.start = time.time()  # the arrival, should an output carry no metrics
        self.last: dict[int, float] = {}  # completion index -> when its last token came
        self.generated: dict[int, int] = {}  # completion index -> tokens so far
        self.finished: set[int] = set()

    def observe(self, output: RequestOutput) -> None:
        """`output` carries each completion's new tokens (a delta)."""
        m, labels = self.metrics, self.metrics.labels
        now = time.perf_counter()
        arrival = output.metrics.arrival_time if output.metrics is not None else self.start
        for completion in output.outputs:
            i, new_tokens = completion.index, len(completion.token_ids)
            if new_tokens:
                if i not in self.last:
                    m.ttft.labels(*labels).observe(max(time.time() - arrival, 0.0))
                    m.prompt_tokens.labels(*labels).inc(len(output.prompt_token_ids))
                else:
                    m.itl.labels(*labels).observe(now - self.last[i])
                    m.tpot.labels(*labels).observe(now - self.last[i])
                m.generation_tokens.labels(*labels).inc(new_tokens)
                if self.lora_labels is not None:
                    m.lora_generation_tokens.labels(*self.lora_labels).inc(new_tokens)
                self.generated[i] = self.generated.get(i, 0) + new_tokens
                self.last[i] = now
            if completion.finish_reason is not None and i not in self.finished:
                self.finished.add(i)
                m.e2e.labels(*labels).observe(max(time.time() - arrival, 0.0))
                m.request_success.labels(*labels, completion.finish_reason).inc()
                if self.lora_labels is not None:
                    m.lora_requests.labels(*self.lora_labels).inc()
                m.request_prompt_tokens.labels(*labels).observe(
                    len(output.prompt_token_ids))
                m.request_generation_tokens.labels(*labels).observe(self.generated.get(i, 0))
        if output.finished:
            m.request_params_n.labels(*labels).observe(self.n)
