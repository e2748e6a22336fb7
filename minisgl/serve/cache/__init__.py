"""The prefix cache's bookkeeping: the page allocator and the cache managers (plain Python,
owned by the scheduler; the device pools they index are ``minisgl.device.kvcache``'s)."""

from minisgl.serve.cache.allocator import PageAllocator
from minisgl.serve.cache.base_manager import BaseCacheManager, CacheHandle, SizeInfo
from minisgl.serve.cache.hiradix_manager import HiRadixCacheManager
from minisgl.serve.cache.host_tier import HostTier
from minisgl.serve.cache.naive_manager import NaiveCacheManager
from minisgl.serve.cache.radix_manager import RadixCacheManager
from minisgl.serve.cache.snapshot_manager import SnapshotRadixCacheManager


def create_cache_manager(
    page_size: int,
    disable_radix_cache: bool = False,
    host: HostTier | None = None,
    snapshot_rows: list[int] | None = None,
) -> BaseCacheManager:
    """``snapshot_rows``: a hybrid model's rows of the state pool for the tree's snapshots."""
    if disable_radix_cache:
        if host is not None:
            raise ValueError("the hierarchical cache needs the radix cache")
        return NaiveCacheManager(page_size)
    if snapshot_rows is not None:
        if host is not None:
            raise ValueError("the hierarchical cache does not keep hybrid models' state snapshots yet")
        return SnapshotRadixCacheManager(page_size, snapshot_rows)
    return RadixCacheManager(page_size) if host is None else HiRadixCacheManager(page_size, host)


__all__ = [
    "BaseCacheManager",
    "CacheHandle",
    "HiRadixCacheManager",
    "HostTier",
    "NaiveCacheManager",
    "PageAllocator",
    "RadixCacheManager",
    "SizeInfo",
    "SnapshotRadixCacheManager",
    "create_cache_manager",
]
