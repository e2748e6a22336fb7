"""An n-gram index over the radix tree's token paths, for drafting speculative tokens.

Every n-gram (``min_n <= n <= max_n``) of a node's tokens, the ones reaching back into its
parent's included, maps to where it ends: the node and the absolute position (tokens from the
root) of the token after it. A later n-gram with the same tokens takes the entry over, so a
lookup finds the most recent continuation: a sibling sample's, an earlier request's.

Nodes are indexed once, when inserted (numpy hashes their windows at once); a split keeps the
lower part's depth, so positions stay right, and reading walks up to the part that holds them.
A removed node's entries go lazily (a lookup that finds it gone drops the entry); past
``capacity`` entries the index starts over.
"""

from __future__ import annotations

from typing import Any

import numpy as np

_BASE = np.uint64(0x9E3779B97F4A7C15)  # odd: invertible modulo 2**64
_BASE_INV = np.uint64(pow(int(_BASE), -1, 1 << 64))
_POS_BITS = 40
_B, _MASK = int(_BASE), (1 << 64) - 1


def window_hashes(tokens: np.ndarray, n: int) -> np.ndarray:
    """Hash of every length-``n`` window of ``tokens`` (uint64), ``sum t[i + j] * B**j`` modulo
    2**64, from one prefix sum: window i is (P[i + n] - P[i]) * B**-i."""
    m = len(tokens)
    if m < n:
        return np.zeros(0, dtype=np.uint64)
    with np.errstate(over="ignore"):
        powers = np.cumprod(np.full(m, _BASE, dtype=np.uint64)) * _BASE_INV  # B**0 .. B**(m-1)
        inv = np.cumprod(np.full(m, _BASE_INV, dtype=np.uint64)) * _BASE  # B**-0 .. B**-(m-1)
        prefix = np.concatenate([[np.uint64(0)], np.cumsum(tokens.astype(np.uint64) * powers, dtype=np.uint64)])
        return (prefix[n:] - prefix[: m - n + 1]) * inv[: m - n + 1]


def suffix_hashes(tokens: list[int], longest: int, end: int | None = None) -> list[int]:
    """``window_hashes`` of the last n tokens before ``end`` (default: all) for n = 1 ..
    ``longest`` (fewer if there are fewer), in one pass in Python (numpy's call overhead is
    most of the cost of a few short windows)."""
    end = len(tokens) if end is None else end
    out, h = [], 0
    for n in range(1, min(longest, end) + 1):
        h = (tokens[end - n] + h * _B) & _MASK
        out.append(h)
    return out


class NgramIndex:
    def __init__(self, min_n: int, max_n: int, capacity: int):
        self.min_n, self.max_n, self.capacity = min_n, max_n, capacity
        self.tables: dict[int, dict[int, int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.nodes: dict[int, Any] = {}  # serial -> node (radix ``_Node``)
        self.serial_of: dict[int, int] = {}  # id(node) -> serial
        self._next = 1
        self.entries = 0

    def add(self, node: Any) -> None:
        """Index a new node: its windows, with up to ``max_n - 1`` tokens of its path before it."""
        if self.entries > self.capacity:
            self.clear()
        start = node.depth - len(node.key)
        before = self._path_before(node, start, self.max_n - 1)
        tokens = np.asarray(before + node.key, dtype=np.int64)
        serial = self._next
        self._next += 1
        self.nodes[serial], self.serial_of[id(node)] = node, serial
        base = start - len(before)  # absolute position of tokens[0]
        for n, table in self.tables.items():
            hashes = window_hashes(tokens, n)
            first = max(len(before) - n + 1, 0)  # windows ending inside the node only
            if first >= len(hashes):
                continue
            ends = np.arange(first, len(hashes), dtype=np.int64) + n + base  # position after each window
            table.update(zip(hashes[first:].tolist(), ((serial << _POS_BITS) | ends).tolist()))
            self.entries += len(hashes) - first

    def forget(self, node: Any) -> None:
        """A node left the tree: its entries die (dropped when a lookup meets them)."""
        serial = self.serial_of.pop(id(node), None)
        if serial is not None:
            del self.nodes[serial]

    def clear(self) -> None:
        for table in self.tables.values():
            table.clear()
        self.nodes.clear()
        self.serial_of.clear()
        self.entries = 0

    def lookup(self, n: int, key: int, tail: list[int], count: int) -> list[int]:
        """Up to ``count`` tokens that followed the n-gram ``tail[-n:]`` (hash ``key``) in the tree."""
        table = self.tables[n]
        value = table.get(key)
        if value is None:
            return []
        node = self.nodes.get(value >> _POS_BITS)
        if node is None or node.parent is None:
            del table[key]
            return []
        end = value & ((1 << _POS_BITS) - 1)
        tokens = self.read(node, end - n, end + count)
        if tokens[:n] != tail[-n:]:  # a hash collision
            return []
        return tokens[n:]

    @staticmethod
    def _path_before(node: Any, start: int, count: int) -> list[int]:
        """The ``count`` tokens of ``node``'s path before absolute position ``start`` (fewer near the root)."""
        out: list[int] = []
        parent = node.parent
        while parent is not None and len(out) < count and parent.key:
            out = parent.key[-(count - len(out)) :] + out
            parent = parent.parent
        return out

    @staticmethod
    def read(node: Any, start: int, end: int) -> list[int]:
        """Tokens at absolute positions [start, end) of a path through ``node``: up through its
        ancestors for what lies before it, down through first children for what lies after."""
        chain = [node]
        while chain[-1].depth - len(chain[-1].key) > start and chain[-1].parent is not None:
            chain.append(chain[-1].parent)
        chain.reverse()
        out: list[int] = []
        at = chain[0].depth - len(chain[0].key)
        for part in chain:
            out += part.key[max(start - at, 0) : max(end - at, 0)]
            at = part.depth
        last = node
        while at < end and last.children:
            last = next(iter(last.children.values()))
            out += last.key[: end - at]
            at = last.depth
        return out
