"""HiRadixCacheManager: the radix tree with host memory (and a disk folder) under it, the
hierarchical cache.

A node's pages live on the device, in host memory, or both: ``pages`` are device pages (None
once only the host copy is left), ``host`` the host copy (None if none). Device residence is
closed under parents: a node on the device has its whole path there, so ``match_prefix``
(device pages only) stops at the first node that is not, and ``match_host`` returns the
host-only nodes after it, to be loaded. Evicting a device leaf keeps the node when it has (or,
under write_back, gets) a host copy; host pages are evicted LRU too, from host-only leaves and
from nodes also on the device. With a storage tier, host copies are written behind to files
keyed by the chain of their tokens (``disk_store``), and a prefix past the host's is read back.
The copies themselves are ``HostTier``'s to queue; this class decides which pages move.
"""

from __future__ import annotations

import heapq

from minisgl.serve.cache.base_manager import CacheHandle, common_pages
from minisgl.serve.cache.disk_store import page_keys
from minisgl.serve.cache.host_tier import SELECTIVE_HITS, HostTier
from minisgl.serve.cache.radix_manager import RadixCacheManager, _Node, push_lru


def _has_host_copy(node: _Node) -> bool:
    return node.parent is not None and node.host is not None


class HiRadixCacheManager(RadixCacheManager):
    def __init__(self, page_size: int, host: HostTier):
        super().__init__(page_size)
        self.host = host
        self._host_leaves: list[tuple[int, _Node]] = []  # host copies by last use, as ``_leaves``

    # ---- finding and loading what the device lacks ---------------------------------------------

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
        tokens = host.disk.stage(keys, host.page_bytes)
        n = len(tokens)
        if n and host.allocator.num_free < n:
            self._evict_host(n - host.allocator.num_free)
        pages = host.allocator.alloc(n) if n else None
        if pages is None:
            host.disk.unstage(tokens)
            return []
        leaf = _Node(ids[start : start + n * self.page_size], None, node, next(self._clock))
        leaf.host, leaf.io_step, leaf.disk_keys = pages, host.step, keys[:n]
        node.children[self._edge(leaf.key, 0)] = leaf
        self._num_nodes += 1
        self._maybe_host_evictable(leaf)
        if self.ngrams is not None:  # (speculative drafts read its tokens as any other node's)
            self.ngrams.add(leaf)
        host.owner.update(zip(pages, keys))
        host.read_from_disk(tokens, pages)
        return [leaf]

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

    # ---- writing copies -----------------------------------------------------------------------

    def count_hit(self, handle: CacheHandle) -> None:
        """A request was admitted on this prefix: under write_through_selective, prefixes
        matched often enough get their host copy."""
        if self.host.policy != "write_through_selective":
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
        node (a split slices them), so a write hashes its own pages, not the whole path. A
        salted tree's chain starts from its salt, so its pages get keys of their own."""
        if node.parent is None:
            salt = self._salt_of[node]
            return [salt.encode() if salt is not None else b""]
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

    # ---- evicting host copies -----------------------------------------------------------------

    def _host_evictable(self, node: _Node) -> bool:
        """A host copy that may go: not in a copy of a batch still being built, and either the
        node stays on the device or it is an unlocked leaf."""
        if not _has_host_copy(node) or node.io_step >= self.host.step:
            return False
        return node.pages is not None or (not node.children and not node.ref)

    def _maybe_host_evictable(self, node: _Node) -> None:
        if _has_host_copy(node):
            push_lru(self._host_leaves, node, self._num_nodes, _has_host_copy)

    def _evict_host(self, num_pages: int) -> None:
        """Free at least ``num_pages`` host pages, least recently used first, if that many can go."""
        freed, busy = 0, []
        while freed < num_pages and self._host_leaves:
            tick, node = heapq.heappop(self._host_leaves)
            if not _has_host_copy(node):
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

    def reset(self) -> list[int]:
        if self.protected_pages:
            raise RuntimeError(f"cannot reset: {self.protected_pages} pages are locked by running requests")
        self.host.allocator.free(self.host_pages())
        self.host.drop_queued()
        self._host_leaves = []
        return super().reset()

    # ---- the tree's hooks ---------------------------------------------------------------------

    def _split(self, node: _Node, num_pages: int) -> _Node:
        upper = super()._split(node, num_pages)
        upper.io_step, upper.hits = node.io_step, node.hits
        if node.host is not None:
            upper.host, node.host = node.host[:num_pages], node.host[num_pages:]
        if node.disk_keys is not None:
            upper.disk_keys, node.disk_keys = node.disk_keys[:num_pages], node.disk_keys[num_pages:]
        self._maybe_evictable(upper)  # the upper half may be a device leaf over a host-only half
        self._maybe_host_evictable(upper)
        return upper

    def _bottom(self, node: _Node) -> bool:
        return all(c.pages is None for c in node.children.values())

    def _adopt(self, node: _Node, pages: list[int]) -> None:
        """Host-only nodes on an insert's path take the caller's pages (the same tokens)."""
        path, up = [], node
        while up.parent is not None and up.pages is None:
            path.append(up)
            up = up.parent
        for part in reversed(path):
            start = (part.depth - len(part.key)) // self.page_size
            self._to_device(part, pages[start : start + len(part.host)])

    def _inserted(self, leaf: _Node, computing: bool) -> None:
        leaf.io_step = self.host.step + computing  # the first batch that may copy it
        if self.host.policy == "write_through":
            self._write(leaf, computing)

    def _stays(self, node: _Node) -> bool:
        """An evicted device leaf stays as its host copy (written back first if the policy says
        so); if that copy may still be in flight, the batch waits for copies."""
        host = self.host
        if node.host is None and (host.policy != "write_back" or not self._write(node, False)):
            return False
        if node.io_step > host.step:  # its write waits for a later batch: it goes with this one
            host.expedite(node.pages)
            node.io_step = host.step
        if node.io_step > host.confirmed:
            host.wait = True
        self._maybe_host_evictable(node)
        return True

    def _forget(self, node: _Node) -> None:
        if node.host is not None:
            self.host.allocator.free(node.host)
            node.host = None

    def _check_node(self, node: _Node, size: int) -> None:
        assert node.pages is not None or node.host is not None, "a node with no pages in any tier"
        assert node.pages is None or len(node.pages) == size, "key/page length mismatch"
        assert node.host is None or len(node.host) == size, "key/host page length mismatch"
        assert node.pages is None or node.parent.pages is not None, "a device node under a host-only one"

    def _check_tiers(self, nodes: list[_Node]) -> None:
        seen: set[int] = set()
        for node in nodes:
            if node.host is not None:
                dup = seen.intersection(node.host)
                assert not dup and len(set(node.host)) == len(node.host), f"host page(s) {dup} appear twice"
                seen.update(node.host)
        free = self.host.allocator.free_pages()
        assert len(set(free)) == len(free) and not seen.intersection(free), "a host page is free and used"
        assert len(free) + len(seen) == self.host.num_pages, (
            f"host pages: free {len(free)} + cached {len(seen)} != {self.host.num_pages}"
        )
        queued = {id(n) for _, n in self._host_leaves}
        assert all(id(n) in queued for n in nodes if n.host is not None and (n.pages is not None or not n.children)), (
            "a host copy is not queued"
        )
