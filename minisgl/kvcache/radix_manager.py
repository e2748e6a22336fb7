"""RadixCacheManager: a radix tree over token ids whose edges own KV pages.

Each node's key is a run of whole pages of tokens and its value the matching page ids; a
node's children are keyed by their first page of tokens. A lock on a node counts on the node
and every ancestor, so a locked prefix is never evicted. Eviction removes least-recently-used
unlocked leaves, so a prefix still shared by a cached suffix goes last.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

from minisgl.kvcache.base_manager import BaseCacheManager, CacheHandle, SizeInfo


class _Node:
    __slots__ = ("key", "pages", "children", "parent", "ref", "last_access", "depth")

    def __init__(self, key: list[int], pages: list[int], parent: _Node | None, tick: int):
        self.key = key
        self.pages = pages
        self.children: dict[tuple[int, ...], _Node] = {}
        self.parent = parent
        self.ref = 0  # locks held on this node or any descendant
        self.last_access = tick
        self.depth = (parent.depth if parent is not None else 0) + len(key)  # tokens from the root to its end

    def __lt__(self, other: _Node) -> bool:  # heap order for LRU eviction
        return self.last_access < other.last_access


@dataclass(frozen=True)
class RadixHandle(CacheHandle):
    node: _Node


class RadixCacheManager(BaseCacheManager):
    def __init__(self, page_size: int):
        super().__init__(page_size)
        self._clock = itertools.count(1)
        self.root = _Node([], [], None, 0)
        self.root.ref = 1  # the root is never evicted
        self.evictable_pages = 0
        self.protected_pages = 0

    # ---- walking ------------------------------------------------------------------------------

    def _edge(self, ids: list[int], start: int) -> tuple[int, ...]:
        return tuple(ids[start : start + self.page_size])

    def _common_pages(self, key: list[int], ids: list[int], start: int) -> int:
        """How many whole pages of ``key`` equal ``ids[start:]``."""
        p, n = self.page_size, min(len(key), len(ids) - start)
        if key[:n] == ids[start : start + n]:
            return n // p
        i = next(i for i in range(n) if key[i] != ids[start + i])
        return i // p

    def _split(self, node: _Node, num_pages: int) -> _Node:
        """Cut ``node`` after ``num_pages`` pages; returns the new upper half (same locks)."""
        self.epoch += 1
        cut = num_pages * self.page_size
        upper = _Node(node.key[:cut], node.pages[:num_pages], node.parent, node.last_access)
        upper.ref = node.ref
        node.parent.children[self._edge(upper.key, 0)] = upper
        node.key, node.pages, node.parent = node.key[cut:], node.pages[num_pages:], upper
        upper.children[self._edge(node.key, 0)] = node
        return upper

    def _walk(self, ids: list[int]) -> tuple[_Node, int]:
        """Deepest node whose path is a prefix of ids (splitting an edge if needed), and its length."""
        node, matched, tick = self.root, 0, next(self._clock)
        limit = self.aligned(len(ids))
        while matched < limit:
            child = node.children.get(self._edge(ids, matched))
            if child is None:
                break
            pages = self._common_pages(child.key, ids[:limit], matched)
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

    def cached_lengths(self, seqs: list[list[int]], common: list[int]) -> list[int]:
        """Walks read only (no split, no LRU touch); each starts from the deepest node of the
        previous walk that lies within the part its sequence shares with the previous one, so
        sorted sequences cost about their distinct cached tokens, not their total."""
        out, node = [], self.root
        for ids, shared in zip(seqs, common):
            limit = self.aligned(max(len(ids) - 1, 0))
            while node.depth > min(shared, limit):
                node = node.parent
            matched = node.depth
            while matched < limit:
                child = node.children.get(self._edge(ids, matched))
                if child is None:
                    break
                pages = min(self._common_pages(child.key, ids, matched), (limit - matched) // self.page_size)
                if pages < len(child.pages):
                    matched += pages * self.page_size
                    break
                node, matched = child, child.depth
            out.append(matched)
        return out

    def match_prefix(self, ids: list[int]) -> tuple[RadixHandle, list[int]]:
        node, matched = self._walk(ids)
        return RadixHandle(matched, node), self._path_pages(node)

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
        return matched

    def evict(self, num_pages: int) -> list[int]:
        if num_pages <= 0:
            return []
        if num_pages > self.evictable_pages:
            raise RuntimeError(f"cannot evict {num_pages} pages: only {self.evictable_pages} are evictable")
        heap = [n for n in self._nodes() if not n.children and n.ref == 0]
        heapq.heapify(heap)
        freed: list[int] = []
        while len(freed) < num_pages:
            node = heapq.heappop(heap)
            freed += node.pages
            self.evictable_pages -= len(node.pages)
            parent = node.parent
            del parent.children[self._edge(node.key, 0)]
            if parent is not self.root and not parent.children and parent.ref == 0:
                heapq.heappush(heap, parent)
        return freed

    def size_info(self) -> SizeInfo:
        return SizeInfo(self.evictable_pages, self.protected_pages)

    def reset(self) -> list[int]:
        if self.protected_pages:
            raise RuntimeError(f"cannot reset: {self.protected_pages} pages are locked by running requests")
        freed = self.evict(self.evictable_pages)
        self.root.children.clear()
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
