"""The prefix-cache interface: which token prefixes own which KV pages, and what may be evicted.

All lengths are in tokens and always whole pages: matches and inserts cut ``ids`` down to a
multiple of ``page_size``; ``pages[j]`` holds tokens ``[j * page_size, (j + 1) * page_size)``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import NamedTuple


def common_pages(key: list[int], ids: list[int], start: int, page_size: int, end: int | None = None) -> int:
    """How many whole pages of ``key`` equal ``ids[start:end]``. List compares run in C: it
    bisects on pages rather than looping over tokens."""
    whole = min(len(key), (len(ids) if end is None else end) - start) // page_size
    n = whole * page_size
    if (key if n == len(key) else key[:n]) == ids[start : start + n]:
        return whole
    lo, hi = 0, whole - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if key[: mid * page_size] == ids[start : start + mid * page_size]:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(frozen=True)
class CacheHandle:
    """A matched prefix. Lock it before using its pages; unlock it when done."""

    cached_len: int


class SizeInfo(NamedTuple):
    evictable: int  # pages in the cache that no request holds
    protected: int  # pages in the cache held by at least one request

    @property
    def total(self) -> int:
        return self.evictable + self.protected


class BaseCacheManager(ABC):
    reuses_prefixes: bool = True
    takes_snapshots: bool = False  # a hybrid model's tree (``snapshot_manager``)

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.epoch = 0  # changes whenever what ``shared_prefix`` returns may have changed

    def aligned(self, n: int) -> int:
        return n - n % self.page_size

    @abstractmethod
    def match_prefix(self, ids: list[int], salt: str | None = None) -> tuple[CacheHandle, list[int]]:
        """Longest cached whole-page prefix of ``ids`` and its pages, among prefixes cached with
        the same ``salt`` (a request's cache_salt: tenants never share pages). Does not lock."""

    @abstractmethod
    def lock_handle(self, handle: CacheHandle, unlock: bool = False) -> None:
        """Protect (or release) the handle's prefix from eviction; locks nest."""

    @abstractmethod
    def insert_prefix(self, ids: list[int], pages: list[int], computing: bool = False, salt: str | None = None) -> int:
        """Cache ``pages`` under ``ids``; returns the length that was already cached (under its
        own pages: the caller's pages for that part are duplicates it must free). ``computing``:
        the batch being built computes them (a host tier copies them one batch later)."""

    @abstractmethod
    def evict(self, num_pages: int) -> list[int]:
        """Free at least ``num_pages`` unlocked pages, least recently used first (may free more)."""

    @abstractmethod
    def size_info(self) -> SizeInfo: ...

    def shared_prefix(self, handle: CacheHandle, min_requests: int = 2) -> tuple[object, int] | None:
        """(a key naming the deepest cached prefix this handle shares with ``min_requests`` - 1
        other locked handles, its length in tokens), or None. Caches that share nothing return None."""
        return None

    @abstractmethod
    def all_pages(self) -> list[int]:
        """Every page the cache holds, locked or not (for integrity checks)."""

    @abstractmethod
    def reset(self) -> list[int]:
        """Drop every unlocked entry; returns the freed pages. Raises if anything is locked."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Raise AssertionError if any internal invariant is broken."""

    def commit(
        self, ids: list[int], pages: list[int], handle: CacheHandle, computing: bool = False, salt: str | None = None
    ) -> tuple[CacheHandle, list[int], list[int]]:
        """Insert a request's computed whole pages and move its lock to the new, deeper prefix.

        Returns (new handle, the pages the request must use from now on for that prefix, the
        request's own pages that turned out to be duplicates and must be freed).
        """
        n = self.aligned(len(ids))
        own = pages[: n // self.page_size]
        self.insert_prefix(ids[:n], own, computing, salt)
        new_handle, tree_pages = self.match_prefix(ids[:n], salt)
        self.lock_handle(new_handle)
        self.lock_handle(handle, unlock=True)
        duplicates = [p for p, t in zip(own, tree_pages) if p != t]
        return new_handle, tree_pages, duplicates
