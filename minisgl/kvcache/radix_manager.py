"""RadixCacheManager: a radix tree over token ids whose edges own KV pages.

Each node's key is a run of whole pages of tokens and its value the matching page ids; a
node's children are keyed by their first page of tokens. A lock on a node counts on the node
and every ancestor, so a locked prefix is never evicted. Eviction removes least-recently-used
unlocked leaves, so a prefix still shared by a cached suffix goes last.

With a host tier (``HostTier``, the hierarchical cache) a node's pages live on the device, in
host memory, or both: ``pages`` are device pages (None once only the host copy is left),
``host`` the host copy (None if none). Device residence is closed under parents: a node on
the device has its whole path there, so ``match_prefix`` (device pages only) stops at the
first node that is not, and ``match_host`` returns the host-only nodes after it, to be loaded.
Evicting a device leaf keeps the node when it has (or, under write_back, gets) a host copy;
host pages are evicted LRU too, from host-only leaves and from nodes also on the device.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Collection
from dataclasses import dataclass

from minisgl.kvcache.base_manager import BaseCacheManager, CacheHandle, SizeInfo, common_pages
from minisgl.kvcache.disk_store import page_keys
from minisgl.kvcache.host_tier import SELECTIVE_HITS, HostTier


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
    )

    def __init__(self, key: list[int], pages: list[int] | None, parent: _Node | None, tick: int):
        self.key = key
        self.pages = pages  # device pages; None when only the host copy is left
        self.host: list[int] | None = None  # host pages holding a copy (hierarchical cache)
        self.io_step = -1  # the batch carrying this node's latest host copy
        self.hits = 0
        self.disk_keys: list[bytes] | None = None  # its pages' storage-tier keys, once computed
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
    def __init__(self, page_size: int, host: HostTier | None = None):
        super().__init__(page_size)
        self.host = host
        self._clock = itertools.count(1)
        self.root = _Node([], [], None, 0)
        self.root.ref = 1  # the root is never evicted
        # cache_salt: each salt has a tree of its own, so tenants never share pages.
        self.roots: dict[str | None, _Node] = {None: self.root}
        self._salt_of: dict[_Node, str | None] = {self.root: None}  # (roots hash by identity)
        self.evictable_pages = 0  # device pages only, here and below
        self.protected_pages = 0
        # Unlocked device leaves by last use, kept as they appear (lazily: stale entries are
        # skipped), so eviction costs the pages it frees, not a walk of the tree.
        self._leaves: list[tuple[int, _Node]] = []
        self._host_leaves: list[tuple[int, _Node]] = []  # the same for host copies
        self._num_nodes = 0

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
        upper.ref, upper.io_step, upper.hits = node.ref, node.io_step, node.hits
        node.parent.children[self._edge(upper.key, 0)] = upper
        node.key, node.parent = node.key[cut:], upper
        if node.pages is not None:
            node.pages = node.pages[num_pages:]
        if node.host is not None:
            upper.host, node.host = node.host[:num_pages], node.host[num_pages:]
        if node.disk_keys is not None:
            upper.disk_keys, node.disk_keys = node.disk_keys[:num_pages], node.disk_keys[num_pages:]
        upper.children[self._edge(node.key, 0)] = node
        self._num_nodes += 1
        if self.host is not None:  # the upper half may be a device leaf over a host-only half
            self._maybe_evictable(upper)
            self._maybe_host_evictable(upper)
        return upper

    def _root(self, salt: str | None) -> _Node:
        root = self.roots.get(salt)
        if root is None:
            root = self.roots[salt] = _Node([], [], None, 0)
            root.ref = 1
            self._salt_of[root] = salt
        return root

    @staticmethod
    def _first_key(salt: str | None) -> bytes:
        """The disk key a tree's page chain starts from: a salted tree's pages get keys of their own."""
        return salt.encode() if salt is not None else b""

    def _walk(self, ids: list[int], on_device: bool = True, salt: str | None = None) -> tuple[_Node, int]:
        """Deepest node whose path is a prefix of ids (splitting an edge if needed), and its
        length; ``on_device``: through nodes with device pages only."""
        node, matched, tick = self._root(salt), 0, next(self._clock)
        limit = self.aligned(len(ids))
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

    def match_host(self, handle: CacheHandle, ids: list[int]) -> list[_Node]:
        """The host-only nodes that continue ``handle``'s device prefix along ``ids`` (the last
        one cut to what matches), to be loaded with ``load``."""
        node, matched, tick, out = handle.node, handle.cached_len, next(self._clock), []
        limit = self.aligned(len(ids))
        while matched < limit:
            child = node.children.get(self._edge(ids, matched))
            if child is None:
                break
            assert child.pages is None, "a device node below the end of a device match"
            pages = common_pages(child.key, ids, matched, self.page_size, limit)
            if pages * self.page_size < len(child.key):
                child = self._split(child, pages)
            child.last_access = tick
            out.append(child)
            node, matched = child, matched + len(child.key)
        return out

    def match_disk(self, node: _Node, ids: list[int]) -> list[_Node]:
        """The storage tier's continuation of ``node`` (the end of a device and host match)
        along ``ids``: as many whole pages as it holds good files for become a host-only leaf,
        read from disk before this batch's copies (``[]`` if none, or no host room)."""
        host, start, stop = self.host, node.depth, self.aligned(len(ids))
        if stop - start < self.page_size:
            return []
        keys = page_keys(ids, self.page_size, self._disk_keys(node)[-1], start, stop)
        n = host.disk.find(keys, host.page_bytes)
        if n and host.allocator.num_free < n:
            self._evict_host(n - host.allocator.num_free)
        pages = host.allocator.alloc(n) if n else None
        if pages is None:
            return []
        leaf = _Node(ids[start : start + n * self.page_size], None, node, next(self._clock))
        leaf.host, leaf.io_step, leaf.disk_keys = pages, host.step, keys[:n]
        node.children[self._edge(leaf.key, 0)] = leaf
        self._num_nodes += 1
        self._maybe_host_evictable(leaf)
        host.owner.update(zip(pages, keys))
        host.read_from_disk(keys[:n], pages)
        return [leaf]

    def disk_writes(self) -> tuple[list[bytes], list[int]]:
        """Keys and host pages of host copies now complete (their batch came back), still
        holding the page they were written with, and not yet on disk: to be written behind."""
        host, keys, pages, waiting = self.host, [], [], []
        for step, written_keys, written_pages in host.unpersisted:
            if step > host.confirmed:
                waiting.append((step, written_keys, written_pages))
                continue
            for key, page in zip(written_keys, written_pages):
                if host.owner.get(page) == key and not host.disk.exists(key):
                    keys.append(key)
                    pages.append(page)
        host.unpersisted = waiting
        host.disk_written_pages += len(pages)
        return keys, pages

    def _disk_keys(self, node: _Node) -> list[bytes]:
        """The storage-tier keys of ``node``'s pages, chained from the root's: computed once per
        node (a split slices them), so a write hashes its own pages, not the whole path."""
        if node.parent is None:
            return [self._first_key(self._salt_of[node])]
        if node.disk_keys is None:
            missing = []
            up = node
            while up.parent is not None and up.disk_keys is None:
                missing.append(up)
                up = up.parent
            before = self._disk_keys(up)[-1]
            for n in reversed(missing):
                n.disk_keys = page_keys(n.key, self.page_size, before)
                before = n.disk_keys[-1]
        return node.disk_keys

    def load(self, nodes: list[_Node], pages: list[int]) -> None:
        """Give host-only ``nodes`` (a path, as ``match_host`` returns it) the device ``pages``
        and queue the copies into them."""
        at = 0
        for node in nodes:
            n = len(node.host)
            self._to_device(node, pages[at : at + n])
            self.host.load(node.host, node.pages)
            node.io_step = self.host.step
            at += n

    def _to_device(self, node: _Node, pages: list[int]) -> None:
        node.pages = pages
        if node.ref:
            self.protected_pages += len(pages)
        else:
            self.evictable_pages += len(pages)
        self._maybe_evictable(node)
        self._maybe_host_evictable(node)

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
        if self.host is not None:  # host-only nodes on the path take the caller's pages (same tokens)
            path, up = [], node
            while up.parent is not None and up.pages is None:
                path.append(up)
                up = up.parent
            for part in reversed(path):
                start = (part.depth - len(part.key)) // self.page_size
                self._to_device(part, pages[start : start + len(part.host)])
        if matched < n:
            leaf = _Node(
                ids[matched:n], pages[matched // self.page_size : n // self.page_size], node, next(self._clock)
            )
            node.children[self._edge(leaf.key, 0)] = leaf
            self.evictable_pages += len(leaf.pages)
            self._num_nodes += 1
            self._maybe_evictable(leaf)
            if self.host is not None:
                leaf.io_step = self.host.step + computing  # the first batch that may copy it
                if self.host.policy == "write_through":
                    self._write(leaf, computing)
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
            if self._keep_on_host(node):
                node.pages = None
            else:
                self._remove(node)
            self._maybe_evictable(parent)
        return freed

    def _device_leaf(self, node: _Node) -> bool:
        if node.parent is None or node.pages is None or node.ref:
            return False
        if self.host is None:
            return not node.children
        return all(c.pages is None for c in node.children.values())

    def _keep_on_host(self, node: _Node) -> bool:
        """Whether an evicted device leaf stays as a host copy (written back first if the
        policy says so); if its copy may still be in flight, the batch waits for copies."""
        host = self.host
        if host is None:
            return False
        if node.host is None and (host.policy != "write_back" or not self._write(node, False)):
            return False
        if node.io_step > host.step:  # its write waits for a later batch: it goes with this one
            host.expedite(node.pages)
            node.io_step = host.step
        if node.io_step > host.confirmed:
            host.wait = True
        self._maybe_host_evictable(node)
        return True

    def _remove(self, node: _Node) -> None:
        """Take a node with no device descendants out of the tree, its host copies with it."""
        del node.parent.children[self._edge(node.key, 0)]
        stack = [node]
        while stack:
            n = stack.pop()
            if n.host is not None:
                self.host.allocator.free(n.host)
                n.host = None
            n.parent = None
            self._num_nodes -= 1
            stack.extend(n.children.values())
            n.children = {}

    def _maybe_evictable(self, node: _Node) -> None:
        """Queue an unlocked device leaf for eviction (entries that stop being one are skipped later)."""
        if self._device_leaf(node):
            heapq.heappush(self._leaves, (node.last_access, node))
            if len(self._leaves) > 2 * self._num_nodes + 64:  # mostly stale: keep one entry per leaf
                live = {id(n): n for _, n in self._leaves if self._device_leaf(n)}
                self._leaves = [(n.last_access, n) for n in live.values()]
                heapq.heapify(self._leaves)

    # ---- the host tier ------------------------------------------------------------------------

    def count_hit(self, handle: CacheHandle) -> None:
        """A request was admitted on this prefix: under write_through_selective, prefixes
        matched often enough get their host copy."""
        if self.host is None or self.host.policy != "write_through_selective":
            return
        node = handle.node
        while node.parent is not None and node.host is None:
            node.hits += 1
            if node.hits >= SELECTIVE_HITS:
                self._write(node, False)
            node = node.parent

    def _write(self, node: _Node, computing: bool) -> bool:
        """Give a device node a host copy (evicting host pages for it); False if none are free."""
        n, host = len(node.pages), self.host
        computing = computing or node.io_step > host.step  # (published by the batch being built)
        if host.allocator.num_free < n:
            self._evict_host(n - host.allocator.num_free)
        pages = host.allocator.alloc(n)
        if pages is None:
            return False
        node.host = pages
        node.io_step = host.write(node.pages, pages, computing)
        self._maybe_host_evictable(node)
        if host.disk is not None:  # written behind once the copy is done (pages may be split off by then)
            keys = list(self._disk_keys(node))
            host.owner.update(zip(pages, keys))
            host.unpersisted.append((node.io_step, keys, pages))
        return True

    def _host_evictable(self, node: _Node) -> bool:
        """A host copy that may go: not in a copy of a batch still being built, and either the
        node stays on the device or it is an unlocked leaf."""
        if node.parent is None or node.host is None or node.io_step >= self.host.step:
            return False
        return node.pages is not None or (not node.children and not node.ref)

    def _maybe_host_evictable(self, node: _Node) -> None:
        if node.parent is not None and node.host is not None:
            heapq.heappush(self._host_leaves, (node.last_access, node))
            if len(self._host_leaves) > 2 * self._num_nodes + 64:
                live = {id(n): n for _, n in self._host_leaves if n.parent is not None and n.host is not None}
                self._host_leaves = [(n.last_access, n) for n in live.values()]
                heapq.heapify(self._host_leaves)

    def _evict_host(self, num_pages: int) -> None:
        """Free at least ``num_pages`` host pages, least recently used first, if that many can go."""
        freed, busy = 0, []
        while freed < num_pages and self._host_leaves:
            tick, node = heapq.heappop(self._host_leaves)
            if node.parent is None or node.host is None:
                continue  # stale
            if node.last_access != tick:
                heapq.heappush(self._host_leaves, (node.last_access, node))
                continue
            if not self._host_evictable(node):
                if node.pages is not None or not node.children:
                    busy.append((tick, node))  # may become evictable later: keep its entry
                continue  # (an inner host-only node is queued again when its last child goes)
            freed += len(node.host)
            self.host.evicted_pages += len(node.host)
            if node.pages is not None:
                self.host.allocator.free(node.host)
                node.host = None
            else:
                parent = node.parent
                self._remove(node)
                self._maybe_host_evictable(parent)
        for entry in busy:
            heapq.heappush(self._host_leaves, entry)

    def host_pages(self) -> list[int]:
        """Every host page the tree holds (integrity checks)."""
        return [p for n in self._nodes() if n.host is not None for p in n.host]

    # ---- whole-cache operations ---------------------------------------------------------------

    def size_info(self) -> SizeInfo:
        return SizeInfo(self.evictable_pages, self.protected_pages)

    def reset(self) -> list[int]:
        if self.protected_pages:
            raise RuntimeError(f"cannot reset: {self.protected_pages} pages are locked by running requests")
        freed = [p for n in self._nodes() if n.pages is not None for p in n.pages]
        if self.host is not None:
            self.host.allocator.free(self.host_pages())
            self.host.drop_queued()
        self.evictable_pages = 0
        self.root.children.clear()
        self.roots, self._salt_of = {None: self.root}, {self.root: None}
        self._leaves, self._host_leaves, self._num_nodes = [], [], 0
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
        seen_host: set[int] = set()
        nodes = self._nodes()
        for node in nodes:
            size = len(node.key) // self.page_size
            assert size and len(node.key) % self.page_size == 0, "a node holds no whole pages"
            assert node.pages is not None or node.host is not None, "a node with no pages in any tier"
            assert node.pages is None or len(node.pages) == size, "key/page length mismatch"
            assert node.host is None or len(node.host) == size, "key/host page length mismatch"
            assert node.pages is None or node.parent.pages is not None, "a device node under a host-only one"
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
            if node.host is not None:
                dup = seen_host.intersection(node.host)
                assert not dup and len(set(node.host)) == len(node.host), f"host page(s) {dup} appear twice"
                seen_host.update(node.host)
        assert (evictable, protected) == (self.evictable_pages, self.protected_pages), (
            f"size counters {(self.evictable_pages, self.protected_pages)} != tree {(evictable, protected)}"
        )
        assert self._num_nodes == len(nodes), f"node count {self._num_nodes} != tree {len(nodes)}"
        queued = {id(n) for _, n in self._leaves}
        assert all(id(n) in queued for n in nodes if self._device_leaf(n)), "an evictable leaf is not queued"
        if self.host is not None:
            free = self.host.allocator.free_pages()
            assert len(set(free)) == len(free) and not seen_host.intersection(free), "a host page is free and used"
            assert len(free) + len(seen_host) == self.host.num_pages, (
                f"host pages: free {len(free)} + cached {len(seen_host)} != {self.host.num_pages}"
            )
            queued = {id(n) for _, n in self._host_leaves}
            assert all(
                id(n) in queued for n in nodes if n.host is not None and (n.pages is not None or not n.children)
            ), "a host copy is not queued"
