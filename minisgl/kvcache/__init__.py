from minisgl.kvcache.base import BaseKVCache
from minisgl.kvcache.mha_pool import MHAKVCache

__all__ = ["BaseKVCache", "MHAKVCache"]
