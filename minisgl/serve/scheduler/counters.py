"""The scheduler's running totals, read by its stats (the log line, /metrics, /server_info) and
kept by the planners that do the work."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Counters:
    prefix_queried_tokens: int = 0  # tokens looked up in the prefix cache
    prefix_hit_tokens: int = 0  # of those, tokens served from the cache (any tier)
    prefix_host_hit_tokens: int = 0  # of those, tokens the host tier held (loaded back)
    retractions: int = 0
    steps: int = 0
    prefill_tokens: int = 0  # prompt tokens computed (not served from the cache)
    decode_steps: int = 0
    cascade_steps: int = 0  # decode steps that read shared prefixes once per group
    mixed_steps: int = 0  # prefill steps that also decoded (--enable-mixed-chunk)
