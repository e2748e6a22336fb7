"""RadixCacheManager against a reference model, driven by hypothesis with random operations.

The machine plays the scheduler's part: requests match and lock a prefix, take free pages for
the rest, write KV, commit (insert + move the lock), and finish. Every step checks the tree's
integrity, the page accounting, and that matched pages hold the KV written for those tokens.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from minisgl.serve.cache import PageAllocator, RadixCacheManager

TOTAL_PAGES = 40
# A tiny alphabet and short sequences make shared prefixes and duplicate inserts common.
ids_strategy = st.lists(st.integers(0, 2), min_size=1, max_size=14)


class RadixMachine(RuleBasedStateMachine):
    @initialize(page_size=st.sampled_from([1, 2, 3]))
    def setup(self, page_size):
        self.p = page_size
        self.cache = RadixCacheManager(page_size)
        self.alloc = PageAllocator(TOTAL_PAGES)
        self.kv: dict[int, tuple[int, ...]] = {}  # page -> the token prefix whose last page it holds
        self.model: dict[tuple[int, ...], int] = {}  # reference: cached page-aligned prefix -> page
        self.running: list[dict] = []

    # ---- reference model ---------------------------------------------------------------------

    def model_match(self, ids: list[int]) -> list[int]:
        pages = []
        for end in range(self.p, len(ids) - len(ids) % self.p + 1, self.p):
            page = self.model.get(tuple(ids[:end]))
            if page is None:
                break
            pages.append(page)
        return pages

    def model_insert(self, ids: list[int], pages: list[int]) -> None:
        for j, end in enumerate(range(self.p, len(ids) - len(ids) % self.p + 1, self.p)):
            self.model.setdefault(tuple(ids[:end]), pages[j])

    def check_kv(self, ids: list[int], pages: list[int]) -> None:
        for j, page in enumerate(pages):
            assert self.kv[page] == tuple(ids[: (j + 1) * self.p]), "matched page holds other tokens"

    # ---- operations --------------------------------------------------------------------------

    @rule(ids=ids_strategy)
    def match(self, ids):
        handle, pages = self.cache.match_prefix(ids)
        assert pages == self.model_match(ids)
        assert handle.cached_len == len(pages) * self.p
        self.check_kv(ids, pages)

    @rule(ids=ids_strategy)
    def start_request(self, ids):
        handle, pages = self.cache.match_prefix(ids)
        self.cache.lock_handle(handle)
        need = -(-len(ids) // self.p) - len(pages)
        short = need - self.alloc.num_free
        if short > 0 and short <= self.cache.size_info().evictable:
            self.forget(self.cache.evict(short))
        own = self.alloc.alloc(need)
        if own is None:
            self.cache.lock_handle(handle, unlock=True)
            return
        for j, page in enumerate(own, start=len(pages)):
            self.kv[page] = tuple(ids[: (j + 1) * self.p])  # "compute" the KV of that page
        self.running.append({"ids": ids, "pages": pages + own, "handle": handle})

    @precondition(lambda self: self.running)
    @rule(data=st.data(), finish=st.booleans())
    def commit_request(self, data, finish):
        """Insert a running request's pages; on finish also unlock and free what it owned alone."""
        req = data.draw(st.sampled_from(self.running))
        ids, pages = req["ids"], req["pages"]
        n = len(ids) - len(ids) % self.p
        expected_tree = self.model_match(ids[:n])
        handle, tree_pages, dups = self.cache.commit(ids, pages, req["handle"])
        self.model_insert(ids[:n], pages)
        assert tree_pages == self.model_match(ids[:n]) and len(tree_pages) == n // self.p
        assert tree_pages[: len(expected_tree)] == expected_tree, "commit replaced cached pages"
        req["pages"], req["handle"] = tree_pages + pages[n // self.p :], handle
        self.alloc.free(dups)  # duplicates of cached pages: the request now uses the cached ones
        for page in dups:
            del self.kv[page]
        in_use = {p for r in self.running for p in r["pages"]}
        assert not in_use & set(dups), "a freed duplicate page is still used by a running request"
        if finish:
            self.cache.lock_handle(handle, unlock=True)
            tail = req["pages"][n // self.p :]
            self.alloc.free(tail)
            for page in tail:
                del self.kv[page]
            self.running.remove(req)

    @rule(n=st.integers(0, 12))
    def evict(self, n):
        n = min(n, self.cache.size_info().evictable)
        freed = self.cache.evict(n)
        assert len(freed) >= n
        self.forget(freed)

    def forget(self, freed: list[int]) -> None:
        locked = {p for r in self.running for p in r["pages"]}
        assert not locked & set(freed), "evicted a page a running request holds"
        gone = {k for k, v in self.model.items() if v in set(freed)}
        for k in gone:
            del self.model[k]
            assert not any(m[: len(k)] == k and m not in gone for m in self.model), "evicted a non-leaf"
        for page in freed:
            del self.kv[page]
        self.alloc.free(freed)

    # ---- invariants --------------------------------------------------------------------------

    @invariant()
    def integrity(self):
        if not hasattr(self, "cache"):
            return
        self.cache.check_integrity()
        info = self.cache.size_info()
        cached = set(self.cache.all_pages())
        assert cached == set(self.model.values())
        private = [p for r in self.running for p in r["pages"] if p not in cached]
        assert len(private) == len(set(private))
        assert self.alloc.num_free + info.total + len(private) == TOTAL_PAGES
        for r in self.running:
            self.check_kv(r["ids"], r["pages"][: len(r["ids"]) // self.p])


TestRadixMachine = RadixMachine.TestCase
TestRadixMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_duplicate_insert_returns_cached_length():
    cache = RadixCacheManager(2)
    assert cache.insert_prefix([1, 2, 3, 4], [0, 1]) == 0
    assert cache.insert_prefix([1, 2, 3, 4, 5, 6], [7, 8, 9]) == 4
    handle, pages = cache.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert pages == [0, 1, 9] and handle.cached_len == 6
    cache.check_integrity()


def test_locked_prefix_and_ancestors_survive_eviction():
    cache = RadixCacheManager(1)
    cache.insert_prefix([1, 2, 3], [0, 1, 2])
    cache.insert_prefix([1, 2, 9], [0, 1, 5])
    handle, _ = cache.match_prefix([1, 2, 3])
    cache.lock_handle(handle)
    assert cache.size_info() == (1, 3)
    assert cache.evict(1) == [5]
    try:
        cache.evict(1)
    except RuntimeError as e:
        assert "evictable" in str(e)
    else:
        raise AssertionError("evicted a locked prefix")
    cache.lock_handle(handle, unlock=True)
    assert sorted(cache.reset()) == [0, 1, 2]
    cache.check_integrity()


def test_lru_evicts_least_recently_used_leaf():
    cache = RadixCacheManager(1)
    cache.insert_prefix([1, 2], [0, 1])
    cache.insert_prefix([3, 4], [2, 3])
    cache.match_prefix([1, 2])  # touch: [3, 4] is now older
    assert cache.evict(1) == [2, 3]  # the whole [3, 4] leaf goes
    assert cache.match_prefix([1, 2])[1] == [0, 1]


def test_salted_prefixes_live_in_trees_of_their_own():
    """cache_salt: the same tokens under another salt (or none) match nothing of each other;
    eviction, integrity and reset cover every tree."""
    cache = RadixCacheManager(2)
    cache.insert_prefix([1, 2, 3, 4], [0, 1])
    cache.insert_prefix([1, 2, 3, 4], [2, 3], salt="a")
    assert cache.match_prefix([1, 2, 3, 4])[1] == [0, 1]
    assert cache.match_prefix([1, 2, 3, 4], "a")[1] == [2, 3]
    assert cache.match_prefix([1, 2, 3, 4], "b")[0].cached_len == 0
    cache.check_integrity()
    assert sorted(cache.evict(4)) == [0, 1, 2, 3]
    cache.insert_prefix([5, 6], [4], salt="a")
    assert cache.reset() == [4] and cache.match_prefix([5, 6], "a")[0].cached_len == 0
    cache.check_integrity()


def test_a_salts_tree_goes_when_it_empties():
    """A client that sends a new cache_salt each time (or the trees of replaced weights) must
    leave nothing behind: a lookup under an unknown salt makes no tree, and a salt's root goes
    with its last page; its next insert starts a new one."""
    cache = RadixCacheManager(2)
    for i in range(100):
        handle, _ = cache.match_prefix([1, 2, 3, 4], f"s{i}")
        cache.lock_handle(handle)
        handle, _, _ = cache.commit([1, 2, 3, 4], [2 * i, 2 * i + 1], handle, salt=f"s{i}")
        cache.lock_handle(handle, unlock=True)
        cache.insert_prefix([7], [], salt=f"short{i}")  # (less than a page: nothing to keep)
    assert len(cache.roots) == 101
    cache.check_integrity()
    assert len(cache.evict(200)) == 200
    assert list(cache.roots) == [None] and len(cache._salt_of) == 1
    cache.check_integrity()
    cache.insert_prefix([1, 2], [0], salt="s0")
    assert cache.match_prefix([1, 2], "s0")[1] == [0] and cache.match_prefix([1, 2], "s1")[1] == []
    cache.check_integrity()
