"""Cascade groups: which decoding requests read a shared prefix's KV pages once per step.

The radix tree knows who shares what: every running request locks its cached prefix, so a
node locked n times is a prefix that n running requests share. A request's group is the
deepest node on its path that ``MIN_GROUP_SIZE`` requests share (in a chat tree, the system
prompt that many conversations share, rather than a turn that only the next turn extends).
The cost rule keeps a group when reading its prefix once saves more than the extra kernels
cost. Fitted to benchmarks/decode_bench.py part 3 on the H100 (8B attention shape, both levels
on our Triton kernel, results/gpu_2026-11-22.md "Session 6"): from batch 32 on, batches whose
groups skip 44% or more of the step's KV reads win (16 groups of 16 on 2048 tokens 2.1x, pairs
on 2048 tokens 2%), while batches with many long requests outside groups lose even where
groups save a third of the reads (64 requests, 32 of them alone on 2304 tokens: 0.160 vs
0.153 ms): the plain decode already serves a small group's re-reads from L2, and our own level
is slower than FlashInfer's decode on long runs. Below batch 32 the cascade's fixed cost (a
second launch and the merge, ~5-7 us a layer) loses to the latency-bound plain decode.
Kept: groups of at least ``MIN_GROUP_SIZE`` requests (broad groups, so a chat tree's system
prompt rather than a pair's turn) sharing at least ``MIN_SHARED_TOKENS``, and a step only when
it has ``MIN_BATCH`` requests and its groups together skip ``MIN_SAVED_SHARE`` of its reads.

On CPU the rule does not hold: the torch reference's cascade loops over requests and took 2.2-2.8x
the plain decode's time (issue 31), so CPU engines form no groups (``ON_CPU``; tests turn it on
to check the two-level path against the plain one).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minisgl.serve.cache import BaseCacheManager, CacheHandle
from minisgl.serve.scheduler.request import Req
from minisgl.wire.steps import MAX_CASCADE_GROUPS

MIN_GROUP_SIZE = 4
MIN_SHARED_TOKENS = 256
MIN_BATCH = 32
MIN_SAVED_SHARE = 0.4
ON_CPU = False


@dataclass
class DecodeOrder:
    """Decoding requests in batch order: the groups' members first, group by group."""

    reqs: list[Req]
    group_sizes: list[int] = field(default_factory=list)
    group_pages: list[int] = field(default_factory=list)


def plan_cascade(reqs: list[Req], cache: BaseCacheManager, page_size: int, enabled: bool = True) -> DecodeOrder:
    if not enabled or not cache.reuses_prefixes:
        return DecodeOrder(sorted(reqs, key=_first_page))
    min_size = max(MIN_GROUP_SIZE, 2)
    by_handle: dict[CacheHandle, list[Req]] = {}  # requests locking one prefix hold one handle
    for req in reqs:
        members = by_handle.get(req.handle)
        if members is None:
            by_handle[req.handle] = [req]
        else:
            members.append(req)
    buckets: dict[int, tuple[int, list[Req]]] = {}
    loose: list[Req] = []
    for handle, members in by_handle.items():
        shared = cache.shared_prefix(handle, min_size)
        if shared is None or shared[1] < MIN_SHARED_TOKENS:
            loose += members
        else:
            buckets.setdefault(id(shared[0]), (shared[1], []))[1].extend(members)
    groups = []
    for tokens, members in buckets.values():
        if len(members) >= min_size:
            groups.append((tokens, members))
        else:
            loose += members
    groups.sort(key=lambda g: -(len(g[1]) - 1) * g[0])  # the largest savings first
    for _, members in groups[MAX_CASCADE_GROUPS:]:
        loose += members
    groups = groups[:MAX_CASCADE_GROUPS]
    saved = sum((len(m) - 1) * t for t, m in groups)
    if len(reqs) < MIN_BATCH or saved < MIN_SAVED_SHARE * sum(r.kv_len for r in reqs):
        loose, groups = reqs, []
    # Neighbouring thread blocks attend at the same time: requests that still share pages
    # (ungrouped ones with a common first page) sit together so their re-reads hit L2.
    return DecodeOrder(
        [r for _, m in groups for r in m] + sorted(loose, key=_first_page),
        group_sizes=[len(m) for _, m in groups],
        group_pages=[t // page_size for t, _ in groups],
    )


def _first_page(req: Req) -> int:
    return req.pages[0]
