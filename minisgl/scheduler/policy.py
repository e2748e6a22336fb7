"""Which waiting request goes next: fcfs (arrival order) or lpm (prefix-aware).

lpm puts the requests whose prompts are cached the furthest first, and keeps requests that
share a prefix next to each other: the first one admitted computes the prefix, and because
the scheduler publishes a chunk's pages when it schedules it, the ones right behind it reuse
them in the same round or the next. Sharing comes from the radix order of the prompts (sorted
token sequences: a shared prefix is a contiguous run), so a round costs O(n log n) however long
the queue. Among equal hits, subtrees go oldest first: the oldest request leads, then those
sharing most with it. Requests queued for ``AGING_STEPS`` scheduler steps or more go ahead of
every younger one (in the same order among themselves), so newer requests with better hits
cannot starve a prompt with none.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from minisgl.kvcache import BaseCacheManager
from minisgl.scheduler.request import Req

AGING_STEPS = 256


def order_waiting(waiting: Sequence[Req], cache: BaseCacheManager, policy: str, step: int) -> list[Req]:
    """The queue in admission order; ``waiting`` is in arrival order, ``step`` the current
    scheduler step."""
    if policy not in ("fcfs", "lpm"):
        raise ValueError(f"unknown schedule policy {policy!r} (fcfs, lpm)")
    queue = list(waiting)
    if policy == "fcfs" or not cache.reuses_prefixes or len(queue) < 2:
        return queue
    aged = [r for r in queue if step - r.queued_step >= AGING_STEPS]
    young = [r for r in queue if step - r.queued_step < AGING_STEPS]
    return prefix_order(aged, cache) + prefix_order(young, cache)


def prefix_order(reqs: list[Req], cache: BaseCacheManager) -> list[Req]:
    """Longest cached prefix first; ties in subtree order, oldest subtree first."""
    if len(reqs) < 2:
        return reqs
    seniority = {id(r): i for i, r in enumerate(reqs)}
    radix = sorted(reqs, key=Req.queue_key)
    common = [0] + [_common_tokens(a.queue_key(), b.queue_key()) for a, b in zip(radix, radix[1:])]
    hits = cache.cached_lengths([r.all_ids for r in radix], common)
    rank = {id(r): i for i, r in enumerate(_subtree_order(radix, common, seniority))}
    hit = {id(r): h for r, h in zip(radix, hits)}
    return sorted(reqs, key=lambda r: (-hit[id(r)], rank[id(r)]))


def _common_tokens(a: bytes, b: bytes) -> int:
    """Leading tokens two packed int32 token sequences share."""
    n = min(len(a), len(b)) // 4
    x, y = np.frombuffer(a, np.int32, n), np.frombuffer(b, np.int32, n)
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if len(diff) else n


class _Subtree:
    """A branch point of the waiting prompts' implicit trie: requests and subtrees below it."""

    __slots__ = ("depth", "items", "oldest")

    def __init__(self, depth: int, items: list):
        self.depth, self.items, self.oldest = depth, items, 0


def _subtree_order(radix: list[Req], common: list[int], seniority: dict[int, int]) -> list[Req]:
    """Depth-first order of the trie of ``radix`` (sorted sequences, ``common[i]`` shared with
    the previous one), visiting each node's children oldest first. Iterative: prompts nested
    inside each other make the trie as deep as the queue is long."""
    root = _Subtree(0, [radix[0]])
    stack = [root]
    for req, shared in zip(radix[1:], common[1:]):
        while stack[-1].depth > shared:
            stack.pop()
        if stack[-1].depth < shared:  # a new branch point: the previous item moves under it
            node = _Subtree(shared, [stack[-1].items.pop()])
            stack[-1].items.append(node)
            stack.append(node)
        stack[-1].items.append(req)
    preorder, todo = [], [root]
    while todo:
        node = todo.pop()
        preorder.append(node)
        todo += [c for c in node.items if isinstance(c, _Subtree)]
    for node in reversed(preorder):  # children before parents
        node.items.sort(key=lambda c: c.oldest if isinstance(c, _Subtree) else seniority[id(c)])
        first = node.items[0]
        node.oldest = first.oldest if isinstance(first, _Subtree) else seniority[id(first)]
    order, todo = [], [root]
    while todo:
        item = todo.pop()
        if isinstance(item, _Subtree):
            todo += reversed(item.items)
        else:
            order.append(item)
    return order
