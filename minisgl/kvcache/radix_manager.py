"""RadixCacheManager: a radix tree over token ids whose edges own KV pages.

Each node's key is a run of whole pages of tokens and its value the matching page ids; a
node's children are keyed by their first page of tokens. A lock on a node counts on the node
and every ancestor, so a locked prefix is never evicted. Eviction removes least-recently-used
unlocked leaves, so a prefix still shared by a cached suffix goes last.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Collection
from dataclasses import dataclass

from minisgl.kvcache.base_manager import BaseCacheManager, CacheHandle, SizeInfo, common_pages


class _Node:
    __slots__ = ("key", "pages", "children", "parent", "ref", "last_access", "depth", "_handle")

    def __init__(self, key: list[int], pages: list[int], parent: _Node | None, tick: int):
        self.key = key
        self.pages = pages
        self.children: dict[tuple[int, ...], _Node] = {}
        self.parent = parent
        self.ref = 0  # locks held on this node or any descendant
        self.last_access = tick
        self.depth = (parent.depth if parent is not None else 0) + len(key)  # tokens from the root to its end
        self._handle: RadixHandle | None = None

    @property
    def handle(self) -> RadixHandle:
        """One handle per node: requests locking the same prefix hold the same object, so
        they group by identity."""
        if self._handle is None:  # (a split keeps the lower part's depth: its handle stays right)
            self._handle = RadixHandle(self.depth, self)
        return self._handle

    def __lt__(self, other: _Node) -> bool:  # heap order for LRU eviction
        return self.last_access < other.last_access


@dataclass(frozen=True, eq=False)
class RadixHandle(CacheHandle):
    node: _Node

    __eq__ = object.__eq__  # one handle per node: identity is equality, and hashing is cheap
    __hash__ = object.__hash__


class RadixCacheManager(BaseCacheManager):
    def __init__(self, page_size: int):
        super().__init__(page_size)
        self._clock = itertools.count(1)
        self.root = _Node([], [], None, 0)
        self.root.ref = 1  # the root is never evicted
        self.evictable_pages = 0
        self.protected_pages = 0
        # Unlocked leaves by last use, kept as they appear (lazily: stale entries are skipped),
        # so eviction costs the pages it frees, not a walk of the tree.
        self._leaves: list[tuple[int, _Node]] = []
        self._num_nodes = 0

    # ---- walking ------------------------------------------------------------------------------

    def _edge(self, ids: list[int], start: int) -> tuple[int, ...]:
        return tuple(ids[start : start + self.page_size])

    def _split(self, node: _Node, num_pages: int) -> _Node:
        """Cut ``node`` after ``num_pages`` pages; returns the new upper half (same locks)."""
        self.epoch += 1
        cut = num_pages * self.page_size
        upper = _Node(node.key[:cut], node.pages[:num_pages], node.parent, node.last_access)
        upper.ref = node.ref
        node.parent.children[self._edge(upper.key, 0)] = upper
        node.key, node.pages, node.parent = node.key[cut:], node.pages[num_pages:], upper
        upper.children[self._edge(node.key, 0)] = node
        self._num_nodes += 1
        return upper

    def _walk(self, ids: list[int]) -> tuple[_Node, int]:
        """Deepest node whose path is a prefix of ids (splitting an edge if needed), and its length."""
        node, matched, tick = self.root, 0, next(self._clock)
        limit = self.aligned(len(ids))
        while matched < limit:
            child = node.children.get(self._edge(ids, matched))
            if child is None:
                break
            pages = common_pages(child.key, ids, matched, self.page_size, limit)
            if pages < len(child.pages):
                upper = self._split(child, pages)  # only the matched half counts as used
                upper.last_access = tick
                return upper, matched + pages * self.page_size
            child.last_access = tick
            node, matched = child, matched + len(child.key)
        return node, matched

    @staticmethod
    def _path_pages(node: _Node) -> list[int]:
        parts = []
        while node.parent is not None:
            parts.append(node.pages)
            node = node.parent
        return [p for part in reversed(parts) for p in part]

    # ---- interface ----------------------------------------------------------------------------

    def shared_prefix(self, handle: CacheHandle, min_requests: int = 2) -> tuple[object, int] | None:
        """The deepest node on the handle's path locked by ``min_requests`` or more requests,
        and its length in tokens: the part of the path that this request shares with others
        running. None when it shares nothing. Walks nodes, not pages."""
        node = handle.node
        while node is not self.root and node.ref < min_requests:
            node = node.parent
        return None if node is self.root else (node, node.depth)

    def start(self) -> tuple[_Node, int]:
        """A read-only walk's starting position: (node, tokens of its key matched so far)."""
        return self.root, 0

    def next_pages(self, pos: tuple[_Node, int]) -> Collection[tuple[int, ...]]:
        """The first pages of tokens the cache continues with after ``pos``."""
        node, off = pos
        if off < len(node.key):
            return (self._edge(node.key, off),)
        return node.children.keys()

    def advance(self, pos: tuple[_Node, int], ids: list[int]) -> tuple[tuple[_Node, int], int]:
        """Follow ``ids`` (whole pages) from ``pos`` as far as the cache holds them, without
        splitting or touching eviction order; returns the new position and the tokens matched."""
        node, off = pos
        matched = 0
        while matched < len(ids):
            if off == len(node.key):
                child = node.children.get(self._edge(ids, matched))
                if child is None:
                    break
                node, off = child, 0
            pages = common_pages(node.key[off:], ids, matched, self.page_size)
            off, matched = off + pages * self.page_size, matched + pages * self.page_size
            if off < len(node.key):
                break
        return (node, off), matched

    def match_prefix(self, ids: list[int]) -> tuple[RadixHandle, list[int]]:
        node, matched = self._walk(ids)
        assert matched == node.depth
        return node.handle, self._path_pages(node)

    def lock_handle(self, handle: CacheHandle, unlock: bool = False) -> None:
        self.epoch += 1
        node = handle.node
        while node is not self.root:
            if unlock:
                if node.ref <= 0:
                    raise AssertionError("unlocking a prefix that is not locked")
                node.ref -= 1
                if node.ref == 0:
                    self.protected_pages -= len(node.pages)
                    self.evictable_pages += len(node.pages)
                    self._maybe_evictable(node)
            else:
                if node.ref == 0:
                    self.evictable_pages -= len(node.pages)
                    self.protected_pages += len(node.pages)
                node.ref += 1
            node = node.parent

    def insert_prefix(self, ids: list[int], pages: list[int]) -> int:
        n = self.aligned(len(ids))
        if len(pages) < n // self.page_size:
            raise ValueError(f"{len(pages)} pages cannot hold {n} tokens of page size {self.page_size}")
        node, matched = self._walk(ids[:n])
        if matched < n:
            leaf = _Node(ids[matched:n], pages[matched // self.page_size : n // self.page_size], node, next(self._clock))
            node.children[self._edge(leaf.key, 0)] = leaf
            self.evictable_pages += len(leaf.pages)
            self._num_nodes += 1
            self._maybe_evictable(leaf)
        return matched

    def evict(self, num_pages: int) -> list[int]:
        if num_pages <= 0:
            return []
        if num_pages > self.evictable_pages:
            raise RuntimeError(f"cannot evict {num_pages} pages: only {self.evictable_pages} are evictable")
        freed: list[int] = []
        while len(freed) < num_pages:
            tick, node = heapq.heappop(self._leaves)
            if node.parent is None or node.children or node.ref:
                continue  # evicted already, no longer a leaf, or locked again: a stale entry
            if node.last_access != tick:  # used since it was queued: back in at its new age
                heapq.heappush(self._leaves, (node.last_access, node))
                continue
            freed += node.pages
            self.evictable_pages -= len(node.pages)
            parent = node.parent
            del parent.children[self._edge(node.key, 0)]
            node.parent = None
            self._num_nodes -= 1
            self._maybe_evictable(parent)
        return freed

    def _maybe_evictable(self, node: _Node) -> None:
        """Queue an unlocked leaf for eviction (entries that stop being one are skipped later)."""
        if node is not self.root and not node.children and node.ref == 0:
            heapq.heappush(self._leaves, (node.last_access, node))
            if len(self._leaves) > 2 * self._num_nodes + 64:  # mostly stale: keep one entry per leaf
                live = {id(n): n for _, n in self._leaves if n.parent is not None and not n.children and not n.ref}
                self._leaves = [(n.last_access, n) for n in live.values()]
                heapq.heapify(self._leaves)

    def size_info(self) -> SizeInfo:
        return SizeInfo(self.evictable_pages, self.protected_pages)

    def reset(self) -> list[int]:
        if self.protected_pages:
            raise RuntimeError(f"cannot reset: {self.protected_pages} pages are locked by running requests")
        freed = self.evict(self.evictable_pages)
        self.root.children.clear()
        self._leaves, self._num_nodes = [], 0
        return freed

    def _nodes(self) -> list[_Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def all_pages(self) -> list[int]:
        return [p for n in self._nodes() for p in n.pages]

    def check_integrity(self) -> None:
        evictable = protected = 0
        seen: set[int] = set()
        for node in self._nodes():
            assert node.pages and len(node.key) == len(node.pages) * self.page_size, "key/page length mismatch"
            assert node.parent.children.get(self._edge(node.key, 0)) is node, "child keyed by the wrong page"
            assert node.ref >= sum(c.ref for c in node.children.values()), "a locked node has an unlocked ancestor"
            assert node.ref >= 0, "negative lock count"
            assert node.depth == node.parent.depth + len(node.key), "node depth out of date"
            dup = seen.intersection(node.pages)
            assert not dup and len(set(node.pages)) == len(node.pages), f"page(s) {dup} appear twice"
            seen.update(node.pages)
            if node.ref:
                protected += len(node.pages)
            else:
                evictable += len(node.pages)
        assert (evictable, protected) == (self.evictable_pages, self.protected_pages), (
            f"size counters {(self.evictable_pages, self.protected_pages)} != tree {(evictable, protected)}"
        )
        nodes = self._nodes()
        assert self._num_nodes == len(nodes), f"node count {self._num_nodes} != tree {len(nodes)}"
        queued = {id(n) for _, n in self._leaves}
        assert all(id(n) in queued for n in nodes if not n.children and not n.ref), "an evictable leaf is not queued"
