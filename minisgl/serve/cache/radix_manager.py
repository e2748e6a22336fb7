"""RadixCacheManager: a radix tree over token ids whose edges own KV pages.

Each node's key is a run of whole pages of tokens and its value the matching page ids; a
node's children are keyed by their first page of tokens. A lock on a node counts on the node
and every ancestor, so a locked prefix is never evicted. Eviction removes least-recently-used
unlocked leaves, so a prefix still shared by a cached suffix goes last.

The host and disk tiers under the tree are ``hiradix_manager.HiRadixCacheManager``'s: it
subclasses this one through the hooks in the last section (what a split, an insert, an
eviction and a removal do to a node's other copies).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Collection
from dataclasses import dataclass

from minisgl.serve.cache.base_manager import BaseCacheManager, CacheHandle, SizeInfo, common_pages
from minisgl.serve.cache.ngram_index import NgramIndex


def push_lru(heap: list[tuple[int, _Node]], node: _Node, num_nodes: int, live: Callable[[_Node], bool]) -> None:
    """Queue ``node`` by its last use in an eviction heap whose stale entries are skipped when
    popped; once they are most of it, keep one entry per node still ``live``."""
    heapq.heappush(heap, (node.last_access, node))
    if len(heap) > 2 * num_nodes + 64:
        nodes = {id(n): n for _, n in heap if live(n)}
        heap[:] = [(n.last_access, n) for n in nodes.values()]
        heapq.heapify(heap)


class _Node:
    __slots__ = (
        "key",
        "pages",
        "children",
        "parent",
        "ref",
        "last_access",
        "depth",
        "_handle",
        "host",
        "io_step",
        "hits",
        "disk_keys",
        "snapshot",
        "snapshot_step",
    )

    def __init__(self, key: list[int], pages: list[int] | None, parent: _Node | None, tick: int):
        self.key = key
        self.pages = pages  # device pages; None when only a host copy is left (hierarchical cache)
        self.host: list[int] | None = None  # host pages holding a copy (hierarchical cache)
        self.io_step = -1  # the batch carrying this node's latest host copy
        self.hits = 0
        self.disk_keys: list[bytes] | None = None  # its pages' storage-tier keys, once computed
        self.snapshot: int | None = None  # a hybrid model's state after its last token (snapshot_manager)
        self.snapshot_step = 0  # the step that writes it
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


def _new_root() -> _Node:
    root = _Node([], [], None, 0)
    root.ref = 1  # a root is never evicted
    return root


class RadixCacheManager(BaseCacheManager):
    def __init__(self, page_size: int):
        super().__init__(page_size)
        self._clock = itertools.count(1)
        self.root = _new_root()
        # cache_salt: each salt has a tree of its own, so tenants never share pages. A salt's
        # root is made by its first insert and goes when its tree empties (a client sending a
        # new salt each time, or the trees of weights replaced by an update, leave nothing).
        self.roots: dict[str | None, _Node] = {None: self.root}
        self._salt_of: dict[_Node, str | None] = {self.root: None}  # (roots hash by identity)
        self.evictable_pages = 0  # device pages only, here and below
        self.protected_pages = 0
        # Unlocked device leaves by last use, kept as they appear (lazily: stale entries are
        # skipped), so eviction costs the pages it frees, not a walk of the tree.
        self._leaves: list[tuple[int, _Node]] = []
        self._num_nodes = 0
        self.ngrams: NgramIndex | None = None  # speculative decoding's index over the paths

    # ---- walking ------------------------------------------------------------------------------

    def _edge(self, ids: list[int], start: int) -> tuple[int, ...]:
        return tuple(ids[start : start + self.page_size])

    def _split(self, node: _Node, num_pages: int) -> _Node:
        """Cut ``node`` after ``num_pages`` pages; returns the new upper half (same locks)."""
        self.epoch += 1
        cut = num_pages * self.page_size
        upper = _Node(
            node.key[:cut], None if node.pages is None else node.pages[:num_pages], node.parent, node.last_access
        )
        upper.ref = node.ref
        node.parent.children[self._edge(upper.key, 0)] = upper
        node.key, node.parent = node.key[cut:], upper
        if node.pages is not None:
            node.pages = node.pages[num_pages:]
        upper.children[self._edge(node.key, 0)] = node
        self._num_nodes += 1
        return upper

    def _root(self, salt: str | None) -> _Node:
        root = self.roots.get(salt)
        if root is None:
            root = self.roots[salt] = _new_root()
            self._salt_of[root] = salt
        return root

    def _walk(self, ids: list[int], on_device: bool = True, salt: str | None = None) -> tuple[_Node, int]:
        """Deepest node whose path is a prefix of ids (splitting an edge if needed), and its
        length; ``on_device``: through nodes with device pages only (a lookup: a salt without
        a tree matches nothing, on a root of its own that is not kept)."""
        limit = self.aligned(len(ids))
        if not on_device and limit:  # (an insert of whole pages: its salt's tree is made if new)
            root = self._root(salt)
        else:
            root = self.roots.get(salt) or _new_root()
        node, matched, tick = root, 0, next(self._clock)
        while matched < limit:
            child = node.children.get(self._edge(ids, matched))
            if child is None or (on_device and child.pages is None):
                break
            pages = common_pages(child.key, ids, matched, self.page_size, limit)
            if pages * self.page_size < len(child.key):
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
        while node.parent is not None and node.ref < min_requests:
            node = node.parent
        return None if node.parent is None else (node, node.depth)

    def start(self, salt: str | None = None) -> tuple[_Node, int] | None:
        """A read-only walk's starting position: (node, tokens of its key matched so far), in
        the tree of ``salt`` (None if that salt has none)."""
        root = self.roots.get(salt)
        return None if root is None else (root, 0)

    def next_pages(self, pos: tuple[_Node, int]) -> Collection[tuple[int, ...]]:
        """The first pages of tokens the cache continues with after ``pos``."""
        node, off = pos
        if off < len(node.key):
            return (self._edge(node.key, off),)
        return node.children.keys()

    def advance(self, pos: tuple[_Node, int], ids: list[int]) -> tuple[tuple[_Node, int], int]:
        """Follow ``ids`` (whole pages) from ``pos`` as far as the cache holds them (in either
        tier), without splitting or touching eviction order; returns the new position and the
        tokens matched."""
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

    def match_prefix(self, ids: list[int], salt: str | None = None) -> tuple[RadixHandle, list[int]]:
        node, matched = self._walk(ids, salt=salt)
        assert matched == node.depth
        return node.handle, self._path_pages(node)

    def lock_handle(self, handle: CacheHandle, unlock: bool = False) -> None:
        self.epoch += 1
        node = handle.node
        while node.parent is not None:
            n = len(node.pages) if node.pages is not None else 0
            if unlock:
                if node.ref <= 0:
                    raise AssertionError("unlocking a prefix that is not locked")
                node.ref -= 1
                if node.ref == 0:
                    self.protected_pages -= n
                    self.evictable_pages += n
                    self._maybe_evictable(node)
            else:
                if node.ref == 0:
                    self.evictable_pages -= n
                    self.protected_pages += n
                node.ref += 1
            node = node.parent

    def insert_prefix(self, ids: list[int], pages: list[int], computing: bool = False, salt: str | None = None) -> int:
        """``computing``: the batch being built computes these pages (a host copy of them must
        wait for the next batch)."""
        return self._insert(ids, pages, computing, salt)[1]

    def commit(
        self, ids: list[int], pages: list[int], handle: CacheHandle, computing: bool = False, salt: str | None = None
    ) -> tuple[RadixHandle, list[int], list[int]]:
        """The base class's commit in one walk: the node the insert ends on is the new prefix
        (a finishing batch of 256 requests of 2432 tokens commits in half the time)."""
        n = self.aligned(len(ids))
        own = pages[: n // self.page_size]
        node, matched = self._insert(ids[:n], own, computing, salt)
        self.lock_handle(node.handle)
        self.lock_handle(handle, unlock=True)
        tree = self._path_pages(node)
        cached = matched // self.page_size  # past it the tree took the request's own pages
        if own[:cached] == tree[:cached]:
            return node.handle, tree, []
        return node.handle, tree, [p for p, t in zip(own[:cached], tree[:cached]) if p != t]

    def _insert(self, ids: list[int], pages: list[int], computing: bool, salt: str | None) -> tuple[_Node, int]:
        """``insert_prefix``, also returning the node whose path is the whole of ``ids``."""
        n = self.aligned(len(ids))
        if len(pages) < n // self.page_size:
            raise ValueError(f"{len(pages)} pages cannot hold {n} tokens of page size {self.page_size}")
        node, matched = self._walk(ids[:n], on_device=False, salt=salt)
        self._adopt(node, pages)
        if matched < n:
            leaf = _Node(
                ids[matched:n], pages[matched // self.page_size : n // self.page_size], node, next(self._clock)
            )
            node.children[self._edge(leaf.key, 0)] = leaf
            self.evictable_pages += len(leaf.pages)
            self._num_nodes += 1
            self._maybe_evictable(leaf)
            self._inserted(leaf, computing)
            if self.ngrams is not None:
                self.ngrams.add(leaf)
            node = leaf
        return node, matched

    def evict(self, num_pages: int) -> list[int]:
        if num_pages <= 0:
            return []
        if num_pages > self.evictable_pages:
            raise RuntimeError(f"cannot evict {num_pages} pages: only {self.evictable_pages} are evictable")
        freed: list[int] = []
        while len(freed) < num_pages:
            tick, node = heapq.heappop(self._leaves)
            if not self._device_leaf(node):
                continue  # evicted already, no longer a leaf, or locked again: a stale entry
            if node.last_access != tick:  # used since it was queued: back in at its new age
                heapq.heappush(self._leaves, (node.last_access, node))
                continue
            freed += node.pages
            self.evictable_pages -= len(node.pages)
            parent = node.parent
            if self._stays(node):
                node.pages = None
            else:
                self._remove(node)
            self._maybe_evictable(parent)
        return freed

    def _device_leaf(self, node: _Node) -> bool:
        return node.parent is not None and node.pages is not None and not node.ref and self._bottom(node)

    def _remove(self, node: _Node) -> None:
        """Take a node with no device descendants out of the tree, with everything below it (and
        a salt's root left with nothing)."""
        parent = node.parent
        del parent.children[self._edge(node.key, 0)]
        if parent.parent is None and not parent.children and parent is not self.root:
            del self.roots[self._salt_of.pop(parent)]
        stack = [node]
        while stack:
            n = stack.pop()
            self._forget(n)
            if self.ngrams is not None:
                self.ngrams.forget(n)
            n.parent = None
            self._num_nodes -= 1
            stack.extend(n.children.values())
            n.children = {}

    def _maybe_evictable(self, node: _Node) -> None:
        """Queue an unlocked device leaf for eviction (entries that stop being one are skipped later)."""
        if self._device_leaf(node):
            push_lru(self._leaves, node, self._num_nodes, self._device_leaf)

    # ---- whole-cache operations ---------------------------------------------------------------

    def size_info(self) -> SizeInfo:
        return SizeInfo(self.evictable_pages, self.protected_pages)

    def reset(self) -> list[int]:
        if self.protected_pages:
            raise RuntimeError(f"cannot reset: {self.protected_pages} pages are locked by running requests")
        freed = [p for n in self._nodes() if n.pages is not None for p in n.pages]
        self.evictable_pages = 0
        self.root.children.clear()
        self.roots, self._salt_of = {None: self.root}, {self.root: None}
        self._leaves, self._num_nodes = [], 0
        if self.ngrams is not None:
            self.ngrams.clear()
        return freed

    def _nodes(self) -> list[_Node]:
        out, stack = [], [c for root in self.roots.values() for c in root.children.values()]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def all_pages(self) -> list[int]:
        return [p for n in self._nodes() if n.pages is not None for p in n.pages]

    def check_integrity(self) -> None:
        evictable = protected = 0
        seen: set[int] = set()
        nodes = self._nodes()
        for node in nodes:
            size = len(node.key) // self.page_size
            assert size and len(node.key) % self.page_size == 0, "a node holds no whole pages"
            self._check_node(node, size)
            assert node.parent.children.get(self._edge(node.key, 0)) is node, "child keyed by the wrong page"
            assert node.ref >= sum(c.ref for c in node.children.values()), "a locked node has an unlocked ancestor"
            assert node.ref >= 0, "negative lock count"
            assert node.depth == node.parent.depth + len(node.key), "node depth out of date"
            if node.pages is not None:
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
        assert self._num_nodes == len(nodes), f"node count {self._num_nodes} != tree {len(nodes)}"
        assert all(r.children for r in self.roots.values() if r is not self.root), "an empty salt's tree is kept"
        queued = {id(n) for _, n in self._leaves}
        assert all(id(n) in queued for n in nodes if self._device_leaf(n)), "an evictable leaf is not queued"
        self._check_tiers(nodes)

    # ---- hooks for the tiers under the tree (hiradix_manager) ---------------------------------

    def _check_node(self, node: _Node, size: int) -> None:
        assert node.pages is not None and len(node.pages) == size, "key/page length mismatch"

    def _check_tiers(self, nodes: list[_Node]) -> None:
        """Integrity of the copies the tree keeps elsewhere."""

    def _bottom(self, node: _Node) -> bool:
        """Whether no device node hangs below ``node``."""
        return not node.children

    def _adopt(self, node: _Node, pages: list[int]) -> None:
        """An insert's path ends at ``node``; ``pages`` are the inserted tokens' pages."""

    def _inserted(self, leaf: _Node, computing: bool) -> None:
        """A new leaf of device pages, which the batch being built computes if ``computing``."""

    def _stays(self, node: _Node) -> bool:
        """Whether an evicted device leaf stays in the tree (its pages kept elsewhere)."""
        return False

    def _forget(self, node: _Node) -> None:
        """A node leaves the tree: release what it holds besides device pages."""
