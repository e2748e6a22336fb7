from minisgl.kvcache.allocator import PageAllocator
from minisgl.kvcache.base import BaseKVCache
from minisgl.kvcache.base_manager import BaseCacheManager, CacheHandle, SizeInfo
from minisgl.kvcache.mha_pool import MHAKVCache
from minisgl.kvcache.naive_manager import NaiveCacheManager
from minisgl.kvcache.radix_manager import RadixCacheManager


def create_cache_manager(page_size: int, disable_radix_cache: bool = False) -> BaseCacheManager:
    return NaiveCacheManager(page_size) if disable_radix_cache else RadixCacheManager(page_size)


__all__ = [
    "BaseCacheManager", "BaseKVCache", "CacheHandle", "MHAKVCache", "NaiveCacheManager",
    "PageAllocator", "RadixCacheManager", "SizeInfo", "create_cache_manager",
]
