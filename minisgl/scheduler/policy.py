"""Which waiting request goes next: fcfs, or lpm (longest cached prefix first)."""

from __future__ import annotations

from collections.abc import Iterable

from minisgl.kvcache import BaseCacheManager
from minisgl.scheduler.request import Req

# Matching every queued request each round costs too much beyond this; lpm falls back to fcfs.
LPM_MAX_QUEUE = 128


def order_waiting(waiting: Iterable[Req], cache: BaseCacheManager, policy: str) -> list[Req]:
    queue = list(waiting)
    if policy == "fcfs" or not cache.reuses_prefixes or len(queue) > LPM_MAX_QUEUE:
        return queue
    if policy == "lpm":
        hits = {req.rid: cache.match_prefix(req.all_ids[:-1])[0].cached_len for req in queue}
        return sorted(queue, key=lambda r: -hits[r.rid])  # stable: ties keep arrival order
    raise ValueError(f"unknown schedule policy {policy!r} (fcfs, lpm)")
