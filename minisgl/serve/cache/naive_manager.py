"""NaiveCacheManager: no prefix reuse, the baseline behind --disable-radix-cache."""

from __future__ import annotations

from minisgl.serve.cache.base_manager import BaseCacheManager, CacheHandle, SizeInfo

_EMPTY = CacheHandle(0)


class NaiveCacheManager(BaseCacheManager):
    reuses_prefixes = False

    def match_prefix(self, ids: list[int], salt: str | None = None) -> tuple[CacheHandle, list[int]]:
        return _EMPTY, []

    def lock_handle(self, handle: CacheHandle, unlock: bool = False) -> None:
        pass

    def insert_prefix(self, ids: list[int], pages: list[int], computing: bool = False, salt: str | None = None) -> int:
        return 0

    def commit(
        self, ids: list[int], pages: list[int], handle: CacheHandle, computing: bool = False, salt: str | None = None
    ) -> tuple[CacheHandle, list[int], list[int]]:
        """Nothing is kept: every page of the prefix goes back to the caller to free."""
        return _EMPTY, [], pages[: self.aligned(len(ids)) // self.page_size]

    def evict(self, num_pages: int) -> list[int]:
        if num_pages > 0:
            raise RuntimeError(f"cannot evict {num_pages} pages: the naive cache holds none")
        return []

    def size_info(self) -> SizeInfo:
        return SizeInfo(0, 0)

    def all_pages(self) -> list[int]:
        return []

    def reset(self) -> list[int]:
        return []

    def check_integrity(self) -> None:
        pass
