"""A request's predicted output (OpenAI's ``prediction``: text the answer will largely repeat,
such as a file being edited) as a source of speculative drafts.

Every n-gram of the predicted tokens is hashed once (numpy), sorted by hash per length, so a
lookup is two binary searches. Where an n-gram occurs several times, the first occurrence at or
after the place the last draft came from wins: an answer that follows the prediction keeps
drafting from where it is in it, not from an earlier repeat of the same line.
"""

from __future__ import annotations

import numpy as np

from minisgl.serve.cache.ngram_index import window_hashes

CANDIDATES = 4  # occurrences of an n-gram checked token by token per lookup


class Prediction:
    def __init__(self, tokens: list[int], min_n: int, max_n: int):
        self.tokens = tokens
        self.cursor = 0  # where the last draft taken from it started
        self.hashes: dict[int, np.ndarray] = {}  # n -> sorted window hashes
        self.ends: dict[int, np.ndarray] = {}  # n -> the end of each (ascending among equal hashes)
        by_length = window_hashes(np.asarray(tokens, dtype=np.int64), max_n)
        for n in range(min_n, len(by_length) + 1):
            order = np.argsort(by_length[n - 1], kind="stable")
            self.hashes[n] = by_length[n - 1][order]
            self.ends[n] = order.astype(np.int64) + n

    def draft(self, n: int, key: int, tail: list[int], count: int) -> list[int]:
        """Up to ``count`` predicted tokens after an occurrence of ``tail``'s last n tokens
        (hash ``key``), or none."""
        hashes = self.hashes.get(n)
        if hashes is None:
            return []
        key = np.uint64(key)
        lo, hi = np.searchsorted(hashes, key, "left"), np.searchsorted(hashes, key, "right")
        if lo == hi:
            return []
        ends = self.ends[n][lo:hi]
        at = int(np.searchsorted(ends, self.cursor, "left"))
        # (a few candidates: equal hashes of unequal tokens are rare)
        for end in [*ends[at:].tolist(), *ends[:at].tolist()][:CANDIDATES]:
            if end < len(self.tokens) and self.tokens[end - n : end] == tail[-n:]:
                self.cursor = end
                return self.tokens[end : end + count]
        return []
