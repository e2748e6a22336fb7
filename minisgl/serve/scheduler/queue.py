"""The waiting queue: which request goes next, at a cost that does not grow with the queue.

``fcfs`` admits in arrival order, ``random`` in an order drawn at arrival (SGLang's policy of that
name shuffles its queue each round; a key drawn once costs O(log n) per request). ``lpm`` puts the
requests whose prompts are cached the furthest first and keeps requests that share a prefix next to
each other: the first one admitted computes the prefix, and because the scheduler publishes a
chunk's pages when it schedules it, the ones right behind it reuse them. Among equal hits, subtrees
go oldest first: the oldest request leads, then those sharing most with it. Requests queued for
``AGING_STEPS`` scheduler steps or more go ahead of every younger one (lpm among themselves), so
newer requests with better hits cannot starve a prompt with none. A retracted request goes back in
front of every other (fcfs) or into the aged tier (lpm).

lpm keeps the waiting prompts in a trie of whole pages (the unit the cache shares), kept up to
date as requests arrive and leave: O(prompt pages) per request. Each node knows the oldest
request below it and keeps its children in a heap by that, so the trie's depth-first order,
children oldest first, is the queue in "oldest subtree first" order. Sequence numbers grow with
arrival, so the aged tier is the requests below a sequence number: no request moves when it
ages, and a tier's reading skips subtrees that hold none of it. A round walks the trie
together with the radix cache, through the nodes both hold only, and finds where each waiting
subtree's cached prefix ends; a subtree whose cached prefix ends deeper than its parent's is a
region of its own with a higher hit. Regions go by hit (ties in trie order) and each is read in
trie order, lazily: a round costs the trie nodes shared with the cache plus the requests it
admits, however many wait.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import random
from collections import deque
from collections.abc import Iterator
from typing import Any

from minisgl.serve.cache import BaseCacheManager
from minisgl.serve.cache.base_manager import common_pages
from minisgl.serve.scheduler.request import Req

AGING_STEPS = 256
POLICIES = ("lpm", "fcfs", "random")


class _Node:
    """A run of whole pages in the trie of waiting prompts."""

    __slots__ = ("key", "parent", "children", "own", "heap", "oldest", "version")

    def __init__(self, key: list[int], parent: _Node | None):
        self.key = key
        self.parent = parent
        self.children: dict[tuple[int, ...], _Node] = {}
        self.own: list[tuple[int, Req]] = []  # requests whose whole pages end here, by seniority
        # Children by their oldest request: (oldest, version, child); an entry is stale once the
        # child's version moved on or it left this node.
        self.heap: list[tuple[int, int, _Node]] = []
        self.oldest = _NEVER  # the most senior request below (smallest sequence number)
        self.version = 0

    def __lt__(self, other: _Node) -> bool:  # heap ties: a stale entry and a live one can share (oldest, version)
        return id(self) < id(other)

    def entry_valid(self, entry: tuple[int, int, _Node]) -> bool:
        oldest, version, child = entry
        return child.parent is self and child.version == version

    def first_child(self) -> int:
        """The oldest request among the children's subtrees (dropping stale heap entries)."""
        heap = self.heap
        while heap and not self.entry_valid(heap[0]):
            heapq.heappop(heap)
        return heap[0][0] if heap else _NEVER

    def children_in_order(self) -> Iterator[_Node]:
        """Children oldest first, read from the heap without popping it (a heap of its indices)."""
        heap, todo = self.heap, [(self.heap[0], 0)] if self.heap else []
        while todo:
            entry, i = heapq.heappop(todo)
            if self.entry_valid(entry):
                yield entry[2]
            for j in (2 * i + 1, 2 * i + 2):
                if j < len(heap):
                    heapq.heappush(todo, (heap[j], j))

    def items(self, lo: int, hi: int) -> Iterator[Req | _Node]:
        """Own requests with sequence numbers in [lo, hi) and the children holding any, merged
        by seniority: this node's part of the trie order."""
        own = self.own
        i, end = bisect.bisect_left(own, (lo,)), bisect.bisect_left(own, (hi,))
        for child in self.children_in_order():
            if child.oldest >= hi:
                break
            while i < end and own[i][0] < child.oldest:
                yield own[i][1]
                i += 1
            yield child
        for k in range(i, end):
            yield own[k][1]


_NEVER = 1 << 62


class _Trie:
    """Waiting prompts by their whole pages (each request's last token excluded: it is always
    computed, so it is never a cache hit). A salted prompt (``kv_salt``) starts with a page of
    its salt, so its hit is read in that salt's tree of the cache, as admission matches it."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.root = _Node([], None)

    def _edge(self, ids: list[int], at: int) -> tuple[int, ...]:
        return tuple(ids[at : at + self.page_size])

    def _split(self, child: _Node, pages: int) -> _Node:
        """Cut ``child`` after ``pages`` pages: the upper part takes its place in its parent."""
        parent, cut = child.parent, pages * self.page_size
        upper = _Node(child.key[:cut], parent)
        parent.children[self._edge(upper.key, 0)] = upper
        child.key, child.parent = child.key[cut:], upper
        upper.children[self._edge(child.key, 0)] = child
        child.version += 1
        upper.oldest = child.oldest
        upper.heap = [(child.oldest, child.version, child)]
        heapq.heappush(parent.heap, (upper.oldest, upper.version, upper))
        return upper

    def insert(self, req: Req, seq: int) -> None:
        ids = req.all_ids
        n = len(ids) - 1
        ids, node, at = ids[: n - n % self.page_size], self.root, 0
        if req.kv_salt is not None:  # a salt's prompts share a subtree, under a page of the salt
            mark = [req.kv_salt] * self.page_size
            node = self.root.children.get(tuple(mark))
            if node is None:
                node = self.root.children[tuple(mark)] = _Node(mark, self.root)
        while at < len(ids):
            child = node.children.get(self._edge(ids, at))
            if child is None:
                child = _Node(ids[at:], node)
                node.children[self._edge(ids, at)] = child
                at = len(ids)
            else:
                pages = common_pages(child.key, ids, at, self.page_size)
                if pages * self.page_size < len(child.key):
                    child = self._split(child, pages)
                at += len(child.key)
            node = child
        bisect.insort(node.own, (seq, req))  # sequence numbers are unique: requests never compared
        req.queue_node = node
        while node is not None and seq < node.oldest:  # seniority flows up while it is the oldest
            node.oldest = seq
            node.version += 1
            if node.parent is not None:
                heapq.heappush(node.parent.heap, (seq, node.version, node))
            node = node.parent

    def remove(self, req: Req, seq: int) -> None:
        """Take a request (queued as ``seq``) out of the trie."""
        node: _Node = req.queue_node
        req.queue_node = None
        del node.own[bisect.bisect_left(node.own, (seq,))]
        while node is not None:
            parent = node.parent
            if parent is not None and not node.own and not node.children:
                del parent.children[self._edge(node.key, 0)]
                node.parent = None  # its heap entries go stale
            else:
                oldest = min(node.own[0][0] if node.own else _NEVER, node.first_child())
                if oldest == node.oldest:
                    return
                node.oldest = oldest
                node.version += 1
                if parent is not None:
                    heapq.heappush(parent.heap, (oldest, node.version, node))
                    if len(parent.heap) > 2 * len(parent.children) + 8:  # drop stale entries
                        parent.heap = [e for e in parent.heap if parent.entry_valid(e)]
                        heapq.heapify(parent.heap)
            node = parent

    def shared_depth(self, req: Req) -> int:
        """Tokens of the request's prompt (whole pages) that another waiting prompt shares: where
        they branch. Walks up from the request's node: O(its trie depth)."""
        node, child, depth = req.queue_node, None, 0
        up = node
        while up.parent is not None:
            depth += len(up.key)
            up = up.parent
        if req.kv_salt is not None:
            depth -= self.page_size  # (the salt's page)
        while node.parent is not None:
            if len(node.children) > (child is not None) or any(r is not req for _, r in node.own):
                return max(depth, 0)
            depth -= len(node.key)
            child, node = node, node.parent
        return 0

    def regions(self, cache: BaseCacheManager) -> list[tuple[int, _Node]]:
        """(hit, node) for the root (hit 0) and every node whose cached prefix ends deeper than
        its parent's: walks only the nodes the trie and the cache both hold."""
        found = [(0, self.root)]
        todo: list[tuple[_Node, int, Any]] = [(self.root, 0, cache.start())]
        for edge, node in self.root.children.items():  # salted subtrees: along their salt's tree
            pos = cache.start(edge[0]) if isinstance(edge[0], str) else None
            if pos is not None:
                todo.append((node, 0, pos))
        while todo:
            node, depth, pos = todo.pop()
            ours, theirs = node.children, cache.next_pages(pos)
            if len(theirs) < len(ours):
                matches = [ours[k] for k in theirs if k in ours]
            else:
                matches = [c for k, c in ours.items() if k in theirs]
            for child in matches:
                at, matched = cache.advance(pos, child.key)
                found.append((depth + matched, child))
                if matched == len(child.key):
                    todo.append((child, depth + matched, at))
        return found

    def order(self, cache: BaseCacheManager, tiers: list[tuple[int, int]]) -> Iterator[Req]:
        """Waiting requests tier by tier (ranges of sequence numbers), each by cached prefix,
        longest first, equal hits in trie order."""
        if not self.root.own and not self.root.children:
            return
        regions = self.regions(cache)
        inner = {id(node) for _, node in regions[1:]}
        regions.sort(key=lambda r: (-r[0], _rank(r[1])))
        for lo, hi in tiers:
            for _, top in regions:
                stack = [top.items(lo, hi)]
                while stack:
                    item = next(stack[-1], None)
                    if item is None:
                        stack.pop()
                    elif isinstance(item, _Node):
                        if id(item) not in inner:  # a region of its own, read at its hit
                            stack.append(item.items(lo, hi))
                    else:
                        yield item


def _rank(node: _Node) -> tuple[int, ...]:
    """The node's place in trie order: its ancestors' and its own seniority, from the top."""
    keys = []
    while node.parent is not None:
        keys.append(node.oldest)
        node = node.parent
    return tuple(reversed(keys))


class WaitingQueue:
    """Requests waiting for a slot, in admission order for ``policy``. ``order`` reads the queue
    lazily; requests admitted from it leave with ``remove`` once the reading is done."""

    def __init__(self, policy: str, page_size: int):
        if policy not in POLICIES:
            raise ValueError(f"unknown schedule policy {policy!r} ({', '.join(POLICIES)})")
        self.policy = policy
        self._arrived = itertools.count(0)
        self._retracted = itertools.count(-1, -1)  # in front of every arrival, latest first
        # fcfs: sequence numbers in order (arrivals appended, retractions in front), dropped lazily.
        self._fifo: deque[tuple[int, Req]] = deque()
        self._gone = 0
        # random: (key, sequence number, request) sorted by a key drawn at arrival (retractions
        # below every draw), dropped lazily.
        self._shuffled: list[tuple[float, int, Req]] = []
        self._rng = random.Random(0)
        # lpm: one trie; arrivals by the step they came at, the oldest first: sequence numbers
        # below the first arrival younger than AGING_STEPS are the aged tier.
        self._trie = _Trie(page_size)
        self._arrival_steps: list[int] = []
        self._arrival_seqs: list[int] = []
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __contains__(self, req: Req) -> bool:
        return req.queue_seq is not None

    def push(self, req: Req, step: int, front: bool = False) -> None:
        """Queue a request at scheduler step ``step``: at the back, or (a retracted one) in
        front of every other, aged at once (it ran before and holds outputs)."""
        seq = next(self._retracted) if front else next(self._arrived)
        req.queue_seq = seq
        self._size += 1
        if not front:
            req.queued_step = step
        if self.policy == "fcfs":
            self._fifo.appendleft((seq, req)) if front else self._fifo.append((seq, req))
            return
        if self.policy == "random":  # (key, seq) is unique: requests are never compared
            bisect.insort(self._shuffled, (float(seq) if front else self._rng.random(), seq, req))
            return
        self._trie.insert(req, seq)
        if not front:
            self._arrival_steps.append(step)
            self._arrival_seqs.append(seq)

    def rekey(self, req: Req, kv_salt: str | None) -> None:
        """Give a queued request another tree of the cache (``Req.kv_salt``), keeping its place."""
        if self.policy == "lpm" and req.queue_seq is not None and kv_salt != req.kv_salt:
            self._trie.remove(req, req.queue_seq)
            req.kv_salt = kv_salt
            self._trie.insert(req, req.queue_seq)
        req.kv_salt = kv_salt

    def requests(self) -> list[Req]:
        """Every queued request (in no particular order)."""
        if self.policy == "fcfs":
            return [r for seq, r in self._fifo if r.queue_seq == seq]
        if self.policy == "random":
            return [r for _, seq, r in self._shuffled if r.queue_seq == seq]
        found, todo = [], [self._trie.root]
        while todo:
            node = todo.pop()
            found += [r for _, r in node.own]
            todo += node.children.values()
        return found

    def remove(self, req: Req) -> None:
        if req.queue_seq is None:
            return
        self._size -= 1
        seq, req.queue_seq = req.queue_seq, None
        if self.policy == "lpm":
            self._trie.remove(req, seq)
            return
        self._gone += 1
        if self.policy == "random":
            if self._gone > len(self._shuffled) // 2:
                self._shuffled = [e for e in self._shuffled if e[2].queue_seq == e[1]]
                self._gone = 0
            return
        fifo = self._fifo
        while fifo and fifo[0][1].queue_seq != fifo[0][0]:
            fifo.popleft()
            self._gone -= 1
        if self._gone > len(fifo) // 2:
            self._fifo = deque(e for e in fifo if e[1].queue_seq == e[0])
            self._gone = 0

    def shared_depth(self, req: Req) -> int:
        """(lpm) How many tokens of a queued request's prompt another queued prompt shares, in
        whole pages (0 under the other policies, which keep no trie)."""
        return self._trie.shared_depth(req) if self.policy == "lpm" and req.queue_seq is not None else 0

    def order(self, step: int, cache: BaseCacheManager) -> Iterator[Req]:
        """The queue in admission order at scheduler step ``step``, read lazily. Do not push or
        remove while reading."""
        if self.policy == "fcfs":
            return (req for seq, req in self._fifo if req.queue_seq == seq)
        if self.policy == "random":
            return (req for _, seq, req in self._shuffled if req.queue_seq == seq)
        steps, seqs = self._arrival_steps, self._arrival_seqs
        aged = bisect.bisect_right(steps, step - AGING_STEPS)  # a burst of arrivals ages at once
        young = seqs[aged] if aged < len(seqs) else _NEVER
        if aged > len(steps) // 2:
            del steps[:aged], seqs[:aged]
        return self._trie.order(cache, [(-_NEVER, young), (young, _NEVER)])
