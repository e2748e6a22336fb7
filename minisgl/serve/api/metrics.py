"""Prometheus metrics of the API process (own registry, so several servers can share a process)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.openmetrics import exposition as openmetrics_exposition

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


# The scheduler's stats as SGLang names them (name, help), labelled by model.
ENGINE_GAUGES = [
    ("sglang:num_running_reqs", "Requests holding a batch slot"),
    ("sglang:num_queue_reqs", "Requests waiting to be scheduled"),
    ("sglang:token_usage", "Fraction of KV pages that cannot be reclaimed now"),
    ("sglang:cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens looked up"),
    (
        "sglang:hicache_host_hit_rate",
        "Prompt tokens served from the hierarchical cache's host tier / prompt tokens looked up",
    ),
    ("sglang:gen_throughput", "Generated tokens per second since the previous scrape"),
    (
        "sglang:spec_accept_length",
        "Tokens a drafting request gains per verify step (1 without speculation)",
    ),
    ("minisgl_stats_age_seconds", "Age of the scheduler stats these gauges come from"),
]
# The KV pool's pages (minisgl's own names).
PAGE_GAUGES = [
    ("total_pages", "KV cache pages in the pool"),
    ("free_pages", "KV pages holding nothing"),
    ("evictable_pages", "KV pages of cached prefixes no request uses"),
    ("protected_pages", "KV pages of cached prefixes locked by running requests"),
    ("host_total_pages", "Host-tier KV pages (hierarchical cache; 0 when off)"),
    ("host_free_pages", "Host-tier KV pages holding nothing"),
    ("host_loaded_pages", "Host-tier pages loaded back to the device so far"),
    ("host_written_pages", "Device pages copied to the host tier so far"),
]


class Metrics:
    """SGLang's metric names and ``model_name`` label (so its Grafana dashboard and the smg router
    read them unchanged), plus minisgl's own for what SGLang has no name for (KV pages, HTTP
    errors, requests by finish reason)."""

    def __init__(self, model_name: str = "") -> None:
        r = self.registry = CollectorRegistry()
        model = ["model_name"]

        def counter(name: str, doc: str):
            return Counter(name, doc, model, registry=r).labels(model_name)

        def histogram(name: str, doc: str):
            return Histogram(name, doc, model, buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)

        self.prompt_tokens = counter("sglang:prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("sglang:generation_tokens", "Generated tokens of finished requests")
        self.cached_tokens = counter("sglang:cached_tokens", "Prompt tokens served from the prefix cache")
        self.retracted = counter("sglang:num_retracted_requests", "Requests preempted for lack of KV pages")
        self.ttft = histogram("sglang:time_to_first_token_seconds", "Time to first token")
        self.itl = histogram("sglang:inter_token_latency_seconds", "Time between output tokens")
        self.e2e = histogram("sglang:e2e_request_latency_seconds", "Request latency, arrival to last token")
        self.tpot = histogram(
            "sglang:time_per_output_token_seconds",
            "Per request, time from its first to its last output token per token after the first",
        )
        self.finished = counter("sglang:num_requests", "Finished requests")
        # SGLang's function timer: here each route's handling time, by route.
        self.func_latency = Histogram(
            "sglang:func_latency_seconds",
            "Time spent in a route's handler",
            ["name"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.gauges = {name: Gauge(name, doc, model, registry=r).labels(model_name) for name, doc in ENGINE_GAUGES}
        self.requests = Counter("minisgl_requests", "Finished requests by finish reason", ["finish_reason"], registry=r)
        self.errors = Counter(
            "minisgl_http_errors", "Requests answered with an error, by status", ["status"], registry=r
        )
        self.pages = {name: Gauge(f"minisgl_{name}", doc, registry=r) for name, doc in PAGE_GAUGES}
        self.tokens_streamed = 0  # output tokens as they arrive (gen_throughput)
        self._retracted_seen = 0
        self._scrape = (time.perf_counter(), 0.0)

    def render(self, stats: dict[str, float], openmetrics: bool = False) -> tuple[bytes, str]:
        """The exposition (Prometheus text, or OpenMetrics) and its media type, after refreshing
        the engine gauges from the scheduler's stats."""
        now, generated = time.perf_counter(), self.tokens_streamed
        last_time, last_generated = self._scrape
        self._scrape = (now, generated)
        values = {
            "sglang:num_running_reqs": stats.get("running_requests", 0),
            "sglang:num_queue_reqs": stats.get("queued_requests", 0),
            "sglang:token_usage": stats.get("kv_usage", 0),
            "sglang:cache_hit_rate": stats.get("cache_hit_rate", 0),
            "sglang:hicache_host_hit_rate": stats.get("prefix_host_hit_tokens", 0)
            / max(stats.get("prefix_queried_tokens", 0), 1),
            "sglang:gen_throughput": (generated - last_generated) / max(now - last_time, 1e-9),
            "minisgl_stats_age_seconds": stats.get("stats_age_s", 0),
            "sglang:spec_accept_length": stats.get("spec_accept_length", 1.0),
        }
        for name, gauge in self.gauges.items():
            gauge.set(values[name])
        for name, gauge in self.pages.items():
            gauge.set(stats.get(name, 0))
        retracted = int(stats.get("retractions", 0))  # the scheduler's running total
        if retracted > self._retracted_seen:
            self.retracted.inc(retracted - self._retracted_seen)
            self._retracted_seen = retracted
        if openmetrics:  # (its default escaping turns the samples' ':' into '_' but not their family's)
            body = openmetrics_exposition.generate_latest(self.registry, escaping=openmetrics_exposition.ALLOWUTF8)
            return body, openmetrics_exposition.CONTENT_TYPE_LATEST
        return generate_latest(self.registry), "text/plain; version=0.0.4; charset=utf-8"


class RequestTimer:
    """Feeds one request's TTFT, inter-token and end-to-end latencies to the histograms."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics
        self.start = self.last = self.first = time.perf_counter()
        self.tokens = 0

    def tokens_arrived(self, n: int) -> None:
        if n == 0:
            return
        now = time.perf_counter()
        self.metrics.tokens_streamed += n
        if self.tokens == 0:
            self.first = now
            self.metrics.ttft.observe(now - self.start)
        else:
            gap = (now - self.last) / n
            for _ in range(n):
                self.metrics.itl.observe(gap)
        self.tokens += n
        self.last = now

    def finished(self, reason: str, prompt_tokens: int, cached_tokens: int) -> float:
        """Record the end of the request; returns its end-to-end latency in seconds."""
        e2e = time.perf_counter() - self.start
        m = self.metrics
        m.e2e.observe(e2e)
        if self.tokens > 1:
            m.tpot.observe((self.last - self.first) / (self.tokens - 1))
        m.finished.inc()
        m.requests.labels(reason).inc()
        m.prompt_tokens.inc(prompt_tokens)
        m.cached_tokens.inc(cached_tokens)
        m.generation_tokens.inc(self.tokens)
        return e2e
