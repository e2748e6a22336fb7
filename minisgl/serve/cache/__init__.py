"""The prefix cache's bookkeeping: the page allocator and the cache managers (plain Python,
owned by the scheduler; the device pools they index are ``minisgl.device.kvcache``'s)."""

from minisgl.serve.cache.allocator import PageAllocator
from minisgl.serve.cache.base_manager import BaseCacheManager, CacheHandle, SizeInfo
from minisgl.serve.cache.hiradix_manager import HiRadixCacheManager
from minisgl.serve.cache.host_tier import HostTier
from minisgl.serve.cache.naive_manager import NaiveCacheManager
from minisgl.serve.cache.radix_manager import RadixCacheManager


def create_cache_manager(
    page_size: int, disable_radix_cache: bool = False, host: HostTier | None = None
) -> BaseCacheManager:
    if disable_radix_cache:
        if host is not None:
            raise ValueError("the hierarchical cache needs the radix cache")
        return NaiveCacheManager(page_size)
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
    "create_cache_manager",
]
