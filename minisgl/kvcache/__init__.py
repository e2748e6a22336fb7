"""Paged KV cache: the page allocator and prefix-cache managers (plain Python, used by the
scheduler) and the device KV pools (torch, worker only, imported on first use)."""

from typing import Any

from minisgl.kvcache.allocator import PageAllocator
from minisgl.kvcache.base_manager import BaseCacheManager, CacheHandle, SizeInfo
from minisgl.kvcache.hiradix_manager import HiRadixCacheManager
from minisgl.kvcache.host_tier import HostTier
from minisgl.kvcache.naive_manager import NaiveCacheManager
from minisgl.kvcache.radix_manager import RadixCacheManager


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
    "BaseKVCache",
    "CacheHandle",
    "HiRadixCacheManager",
    "HostKVPool",
    "HostTier",
    "MHAKVCache",
    "NaiveCacheManager",
    "PageAllocator",
    "RadixCacheManager",
    "SizeInfo",
    "create_cache_manager",
]


def __getattr__(name: str) -> Any:
    if name == "BaseKVCache":
        from minisgl.kvcache.kv_storage import BaseKVCache

        return BaseKVCache
    if name == "HostKVPool":
        from minisgl.kvcache.host_pool import HostKVPool

        return HostKVPool
    if name == "MHAKVCache":
        from minisgl.kvcache.mha_pool import MHAKVCache

        return MHAKVCache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
