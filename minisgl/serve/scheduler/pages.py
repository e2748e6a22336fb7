"""Pages and page-table slots of running requests: the prefix cache, the free pages and the
free slots, and the moves between them (admit, publish, release). With a host tier, admission
also brings a prefix's host pages back to the device."""

from __future__ import annotations

from minisgl.serve.cache import CacheHandle, HostTier, PageAllocator, create_cache_manager
from minisgl.serve.cache.disk_store import DiskStore
from minisgl.serve.scheduler.request import Req
from minisgl.utils import cdiv
from minisgl.wire.steps import ForwardBatch


class Memory:
    def __init__(
        self,
        page_size: int,
        num_pages: int,
        num_slots: int,
        disable_radix_cache: bool,
        num_host_pages: int = 0,
        write_policy: str = "write_through",
        disk: DiskStore | None = None,
        page_bytes: int = 0,
        snapshot_rows: list[int] | None = None,
    ):
        """``snapshot_rows``: a hybrid model's state-pool rows for prefix snapshots."""
        self.page_size = page_size
        self.host = HostTier(num_host_pages, write_policy, disk, page_bytes) if num_host_pages else None
        self.cache = create_cache_manager(page_size, disable_radix_cache, self.host, snapshot_rows)
        self.allocator = PageAllocator(num_pages)
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.disk_hit_tokens = 0  # tokens admissions found in the storage tier (read into host pages first)

    def alloc(self, n: int) -> list[int] | None:
        """n free pages, evicting unlocked cache if needed; None if even that is not enough."""
        short = n - self.allocator.num_free
        if short > 0:
            if short > self.cache.size_info().evictable:
                return None
            self.allocator.free(self.cache.evict(short))
        return self.allocator.alloc(n)

    def admit(self, req: Req, reusable: int, shared: int = 0) -> int:
        """Give a request a slot and lock the longest cached prefix of its first ``reusable``
        tokens; returns how many of them came from the host tier. ``shared``: (hybrids) how much
        of its prompt a waiting one shares, where it should leave a snapshot for it."""
        ids, salt = req.all_ids[:reusable], req.kv_salt
        handle, pages = self.cache.match_prefix(ids, salt)
        loaded = 0
        if self.host is not None:
            self.cache.count_hit(handle)
            loaded = self._load(ids, handle)
            if loaded:
                handle, pages = self.cache.match_prefix(ids, salt)
        self.cache.lock_handle(handle)
        req.slot, req.handle, req.pages = self.free_slots.pop(), handle, pages
        req.kv_len, req.table_len, req.prefill_target = handle.cached_len, 0, len(req.all_ids)
        if self.cache.takes_snapshots:
            if handle.cached_len:
                req.state_load = self.cache.snapshot_of(handle)  # its state starts from the prefix's
            branch = self.cache.fork_depth(req.all_ids[:reusable], salt)  # where it leaves a cached path
            last = self.cache.aligned(req.prefill_target - 1)
            req.snapshot_at = sorted({p for p in (branch, min(shared, last), last) if p > handle.cached_len})
        return loaded

    def _load(self, ids: list[int], handle: CacheHandle) -> int:
        """Bring the host-only continuation of ``handle`` along ``ids`` to the device (copied
        by the batch being built, before its attention reads them); returns its tokens, 0 if
        the device has no room for it."""
        nodes = self.cache.match_host(handle, ids)
        tail = (nodes[-1] if nodes else handle.node).handle
        self.cache.lock_handle(tail)  # the path stays (every tier) while disk and device pages are found
        if self.host.disk is not None:
            disk = self.cache.match_disk(tail.node, ids)
            self.disk_hit_tokens += sum(len(node.key) for node in disk)
            nodes += disk
        n = sum(len(node.host) for node in nodes)
        pages = self.alloc(n) if n else None
        self.cache.lock_handle(tail, unlock=True)
        if pages is None:
            return 0
        self.cache.load(nodes, pages)
        return n * self.page_size

    @property
    def io_pending(self) -> bool:
        """Host copies or disk writes wait for a batch to carry them."""
        return self.host is not None and self.host.pending

    @property
    def io_urgent(self) -> bool:
        """Copies something waits for (``HostTier.urgent``)."""
        return self.host is not None and self.host.urgent

    def take_io(self, batch: ForwardBatch) -> None:
        """Put the host (and disk) copies of the batch being built in it (see ``HostTier.take``)."""
        if self.host.disk is not None:
            batch.disk_write_keys, batch.disk_write_pages = self.cache.disk_writes()
        batch.kv_writes, batch.kv_loads, batch.wait_kv_io, (batch.disk_read_keys, batch.disk_read_pages) = (
            self.host.take()
        )

    def rematch(self, req: Req, reusable: int) -> int:
        """Take up pages another request cached since this one's last chunk; returns how many
        tokens it gained."""
        handle, pages = self.cache.match_prefix(req.all_ids[:reusable], req.kv_salt)
        gained = handle.cached_len - req.kv_len
        if gained > 0:
            self.cache.lock_handle(handle)
            self.cache.lock_handle(req.handle, unlock=True)
            req.handle, req.pages, req.kv_len = handle, pages, handle.cached_len
        return max(gained, 0)

    def publish(self, req: Req, upto: int) -> None:
        """Put the request's whole pages of its first ``upto`` tokens in the cache now, so that
        requests scheduled after it reuse them. A hybrid model's request recomputes the cached
        pages past its snapshot: its own copies of them stay private until it is released."""
        req.handle, _, duplicates = self.cache.commit(req.all_ids[:upto], req.pages, req.handle, True, req.kv_salt)
        assert not duplicates or self.cache.takes_snapshots, "pages were cached between a match and its commit"

    def release(self, req: Req) -> None:
        """Cache the request's computed whole pages, free the rest and its slot."""
        computed = req.all_ids[: req.kv_len]
        handle, _, duplicates = self.cache.commit(computed, req.pages, req.handle, salt=req.kv_salt)
        self.cache.lock_handle(handle, unlock=True)
        tail = req.pages[self.cache.aligned(len(computed)) // self.page_size :]
        self.allocator.free(duplicates + tail)
        self.free_slots.append(req.slot)
        req.slot, req.handle, req.pages, req.kv_len, req.table_len = None, CacheHandle(0), [], 0, 0
        req.state_load = req.state_save = -1
        req.state_split = (-1, 0)

    def stats(self) -> dict[str, float]:
        info, total, free = self.cache.size_info(), self.allocator.num_pages, self.allocator.num_free
        return {
            "total_pages": total,
            "free_pages": free,
            "evictable_pages": info.evictable,
            "protected_pages": info.protected,
            "used_pages": total - free,
            # Pages that eviction cannot reclaim now: private to requests or locked by them.
            "kv_usage": (total - free - info.evictable) / total,
            **(self.host.stats() if self.host is not None else {}),
            **({"prefix_disk_hit_tokens": self.disk_hit_tokens} if self.host is not None and self.host.disk else {}),
        }

    def check_integrity(self, running: list[Req]) -> None:
        """Every page is exactly one of: free, cached, or private to one running request."""
        self.cache.check_integrity()  # (the host tier's pages too)
        free = self.allocator.free_pages()
        cached = set(self.cache.all_pages())
        private: list[int] = []
        for req in running:
            assert cdiv(req.kv_len, self.page_size) <= len(req.pages), f"request {req.rid} lacks pages"
            private += [p for p in req.pages if p not in cached]
        assert len(set(free)) == len(free), "a page is free twice"
        assert len(set(private)) == len(private), "a page is private to two requests"
        assert not set(free) & cached and not set(free) & set(private), "a used page is also free"
        info = self.cache.size_info()
        assert len(free) + info.total + len(private) == self.allocator.num_pages, (
            f"free {len(free)} + cached {info.total} + private {len(private)} != {self.allocator.num_pages}"
        )
        slots = [r.slot for r in running]
        assert len(set(slots)) == len(slots) and not set(slots) & set(self.free_slots), "a slot is used twice"
