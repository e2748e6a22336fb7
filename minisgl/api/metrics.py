"""Prometheus metrics of the API process (own registry, so several servers can share a process)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("minisgl_requests", "Finished requests by finish reason", ["finish_reason"], registry=r)
        self.errors = Counter("minisgl_http_errors", "Requests answered with an error, by status", ["status"], registry=r)
        self.prompt_tokens = Counter("minisgl_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter("minisgl_cached_tokens", "Prompt tokens served from the prefix cache", registry=r)
        self.generation_tokens = Counter("minisgl_generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("minisgl_time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("minisgl_inter_token_latency_seconds", "Time between output tokens",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("minisgl_e2e_request_latency_seconds", "Request latency, arrival to last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.engine = {
            name: Gauge(f"minisgl_{name}", doc, registry=r)
            for name, doc in [
                ("running_requests", "Requests holding a batch slot"),
                ("queued_requests", "Requests waiting to be scheduled"),
                ("total_pages", "KV cache pages in the pool"),
                ("free_pages", "KV pages holding nothing"),
                ("evictable_pages", "KV pages of cached prefixes no request uses"),
                ("protected_pages", "KV pages of cached prefixes locked by running requests"),
                ("kv_usage", "Fraction of KV pages that cannot be reclaimed now"),
                ("cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens looked up"),
                ("retractions", "Requests preempted for lack of KV pages, since start"),
            ]
        }

    def render(self, stats: dict[str, float]) -> bytes:
        """The exposition text, after refreshing the engine gauges from a fresh stats reply."""
        for name, gauge in self.engine.items():
            gauge.set(stats.get(name, 0))
        return generate_latest(self.registry)


class RequestTimer:
    """Feeds one request's TTFT, inter-token and end-to-end latencies to the histograms."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics
        self.start = self.last = time.perf_counter()
        self.tokens = 0

    def tokens_arrived(self, n: int) -> None:
        if n == 0:
            return
        now = time.perf_counter()
        if self.tokens == 0:
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
        m.requests.labels(reason).inc()
        m.prompt_tokens.inc(prompt_tokens)
        m.cached_tokens.inc(cached_tokens)
        m.generation_tokens.inc(self.tokens)
        return e2e
