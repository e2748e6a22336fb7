"""An n-gram index over the radix tree's token paths, for drafting speculative tokens.

Every n-gram (``min_n <= n <= max_n``) of a node's tokens, the ones reaching back into its
parent's included, maps to where it ends: the node and the absolute position (tokens from the
root) of the token after it. A later n-gram with the same tokens takes the entry over, so a
lookup finds the most recent continuation: a sibling sample's, an earlier request's.

Nodes are indexed once, when inserted (numpy hashes their windows at once); a split keeps the
lower part's depth, so positions stay right, and reading walks up to the part that holds them.
A removed node's entries die with it (a lookup that meets one finds no node); the tables have
a fixed size, newer windows taking the slots of older ones.
"""

from __future__ import annotations

from typing import Any

import numpy as np

_BASE = np.uint64(0x9E3779B97F4A7C15)
_POS_BITS = 26  # positions below 64M tokens; serials get the other 37 bits
_B, _MASK = int(_BASE), (1 << 64) - 1


def window_hashes(tokens: np.ndarray, longest: int) -> list[np.ndarray]:
    """Hashes (uint64) of every window of ``tokens`` of each length n = 1 .. ``longest`` (at
    [n - 1]): ``sum t[i + j] * B**j`` modulo 2**64, each length from the one before
    (h_n[i] = t[i] + B * h_{n-1}[i + 1]): a multiply-add over the tokens per length."""
    t = tokens.astype(np.uint64)
    out = [t] if len(t) and longest > 0 else []
    with np.errstate(over="ignore"):
        while 0 < len(out) < min(longest, len(t)):
            prev = out[-1]
            out.append(t[: len(prev) - 1] + prev[1:] * _BASE)
    return out


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
        self.min_n, self.max_n = min_n, max_n
        # One direct-mapped table per length, ``capacity`` slots (a power of two) of (hash, where):
        # numpy inserts a node's windows in a few calls (a dict took ~2 us a token), and a newer
        # window whose slot is taken simply replaces the older one, so the memory is fixed.
        self.mask = (1 << max(capacity - 1, 1).bit_length()) - 1
        self.keys: dict[int, np.ndarray] = {}
        self.values: dict[int, np.ndarray] = {}
        self.nodes: dict[int, Any] = {}  # serial -> node (radix ``_Node``)
        self.serial_of: dict[int, int] = {}  # id(node) -> serial
        self._next = 1

    def add(self, node: Any) -> None:
        """Index a new node: its windows, with up to ``max_n - 1`` tokens of its path before it."""
        if not self.keys:
            for n in range(self.min_n, self.max_n + 1):
                self.keys[n] = np.zeros(self.mask + 1, dtype=np.uint64)
                self.values[n] = np.zeros(self.mask + 1, dtype=np.int64)
        start = node.depth - len(node.key)
        before = self._path_before(node, start, self.max_n - 1)
        tokens = np.asarray(before + node.key, dtype=np.int64)
        serial = self._next
        self._next += 1
        self.nodes[serial], self.serial_of[id(node)] = node, serial
        base = start - len(before)  # absolute position of tokens[0]
        by_length = window_hashes(tokens, self.max_n)
        for n, keys in self.keys.items():
            if n > len(by_length):
                break
            first = max(len(before) - n + 1, 0)  # windows ending inside the node only
            hashes = by_length[n - 1][first:]
            if not len(hashes):
                continue
            ends = np.arange(first, first + len(hashes), dtype=np.int64) + n + base  # position after each window
            slots = (hashes & np.uint64(self.mask)).astype(np.int64)
            keys[slots] = hashes
            self.values[n][slots] = (serial << _POS_BITS) | ends

    def forget(self, node: Any) -> None:
        """A node left the tree: its entries die (a lookup that meets one finds no node)."""
        serial = self.serial_of.pop(id(node), None)
        if serial is not None:
            del self.nodes[serial]

    def clear(self) -> None:
        for keys in self.keys.values():
            keys.fill(0)
        self.nodes.clear()
        self.serial_of.clear()

    def lookup(self, n: int, key: int, tail: list[int], count: int) -> list[int]:
        """Up to ``count`` tokens that followed the n-gram ``tail[-n:]`` (hash ``key``) in the tree."""
        keys = self.keys.get(n)
        if keys is None:
            return []
        slot = key & self.mask
        if int(keys[slot]) != key:
            return []
        value = int(self.values[n][slot])
        node = self.nodes.get(value >> _POS_BITS)
        if node is None or node.parent is None:
            return []
        end = value & ((1 << _POS_BITS) - 1)
        tokens = self.read(node, end - n, end + count)
        if tokens[:n] != tail[-n:]:  # two windows with one hash
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
