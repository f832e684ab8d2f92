"""Prometheus metrics for the server, in a registry of its own (several servers in
one process, as in tests, do not collide).

Engine gauges and cumulative counters come from `get_stats()` at scrape time; request
latencies are observed as outputs stream out of `AsyncLLM`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pagellm.frontend.outputs import RequestOutput
from pagellm.protocol.stats import EngineStats

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0)


class _EngineCollector:
    """Yields the last engine snapshot as gauges and counters."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: EngineStats | None = None

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        if stats is None:
            return
        labels = ["model_name"]
        values = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            metric = GaugeMetricFamily(name, doc, labels=labels)
            metric.add_metric(values, value)
            return metric

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            metric = CounterMetricFamily(name, doc, labels=labels)
            metric.add_metric(values, value)
            return metric

        yield gauge("pagellm:num_requests_running", "Requests running in the engine.",
                    stats.num_running_reqs)
        yield gauge("pagellm:num_requests_waiting", "Requests waiting to run.",
                    stats.num_waiting_reqs)
        yield gauge("pagellm:kv_cache_usage_perc", "Share of KV blocks held by requests.",
                    stats.kv_cache_usage)
        yield gauge("pagellm:prefix_cache_hit_rate", "Prefix-cache hits / queries (tokens).",
                    stats.prefix_cache_hits / max(stats.prefix_cache_queries, 1))
        yield counter("pagellm:prefix_cache_queries", "Tokens looked up in the prefix cache.",
                      stats.prefix_cache_queries)
        yield counter("pagellm:prefix_cache_hits", "Tokens found in the prefix cache.",
                      stats.prefix_cache_hits)
        yield counter("pagellm:num_preemptions", "Requests preempted.", stats.num_preemptions)
        if stats.per_engine:  # data parallel: each engine core by its rank (vLLM's label)
            for name, doc, field in (
                    ("pagellm:engine_num_steps", "Engine steps run by this core.",
                     "num_steps"),
                    ("pagellm:engine_num_requests_running", "Requests running in this core.",
                     "num_running_reqs")):
                family = GaugeMetricFamily(name, doc, labels=["model_name", "engine"])
                for rank, core in enumerate(stats.per_engine):
                    family.add_metric([self.model_name, str(rank)], getattr(core, field))
                yield family


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.engine = _EngineCollector(model_name)
        self.registry.register(self.engine)
        labels = ["model_name"]
        self.model_name = model_name
        self.prompt_tokens = Counter("pagellm:prompt_tokens", "Prompt tokens processed.",
                                     labels, registry=self.registry)
        self.generation_tokens = Counter("pagellm:generation_tokens", "Tokens generated.",
                                         labels, registry=self.registry)
        self.request_success = Counter("pagellm:request_success", "Finished requests.",
                                       [*labels, "finished_reason"], registry=self.registry)
        self.ttft = Histogram("pagellm:time_to_first_token_seconds",
                              "Time to the first generated token.", labels,
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("pagellm:inter_token_latency_seconds",
                             "Time between two outputs of a request.", labels,
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("pagellm:e2e_request_latency_seconds",
                             "Time from arrival to the last output.", labels,
                             buckets=_E2E_BUCKETS, registry=self.registry)

    def render(self, stats: EngineStats | None) -> bytes:
        self.engine.stats = stats
        return generate_latest(self.registry)

    def tracker(self) -> RequestTracker:
        return RequestTracker(self)


class RequestTracker:
    """Observes one request's stream: TTFT, inter-token latency, end to end, tokens."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.start = self.last = time.perf_counter()
        self.first = True

    def observe(self, output: RequestOutput, new_tokens: int) -> None:
        m, label = self.metrics, self.metrics.model_name
        now = time.perf_counter()
        if new_tokens:
            if self.first:
                m.ttft.labels(label).observe(now - self.start)
                m.prompt_tokens.labels(label).inc(len(output.prompt_token_ids))
                self.first = False
            else:
                m.itl.labels(label).observe(now - self.last)
            m.generation_tokens.labels(label).inc(new_tokens)
            self.last = now
        if output.finished:
            m.e2e.labels(label).observe(now - self.start)
            for completion in output.outputs:
                m.request_success.labels(label, completion.finish_reason or "unknown").inc()
