"""/metrics in both expositions a scraper may ask for: each parses with prometheus_client's own
parser, every sample lands in its declared family, and the names are SGLang's."""

from __future__ import annotations

from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families as text_families

from minisgl.serve.api.metrics import Metrics


def test_both_expositions_parse_into_sglangs_families():
    metrics = Metrics("tiny")
    metrics.func_latency.labels("generate").observe(0.1)
    metrics.ttft.observe(0.2)
    metrics.prompt_tokens.inc(7)
    stats = {"running_requests": 2, "cache_hit_rate": 0.5}
    for openmetrics, parse in ((True, openmetrics_families), (False, text_families)):
        body, media = metrics.render(stats, openmetrics)
        families = {f.name: f for f in parse(body.decode())}
        assert media.startswith("application/openmetrics-text" if openmetrics else "text/plain")
        assert all(f.type != "unknown" for f in families.values()), sorted(families)
        tokens = families["sglang:prompt_tokens"]
        assert any(s.name == "sglang:prompt_tokens_total" and s.value == 7 for s in tokens.samples)
        latency = families["sglang:func_latency_seconds"]
        assert latency.type == "histogram" and {"name": "generate"} in [
            {k: v for k, v in s.labels.items() if k != "le"} for s in latency.samples
        ]
        assert families["sglang:num_running_reqs"].samples[0].value == 2
