"""SnapshotRadixCacheManager: the radix tree of a hybrid model, with recurrent-state snapshots.

A hybrid model's attention layers read a cached prefix's KV pages as any model's do, but its
Gated DeltaNet layers need their state after the prefix's last token, which no page holds. The
tree keeps such states (rows of the worker's ``StatePool``) at chosen nodes: a prefix is a hit
only up to the deepest node on its path that has a snapshot, and the rest is computed again
from there. A node without a snapshot is never a hit, so a hit is never approximate.

The scheduler takes a snapshot at a page boundary of a prefill chunk (``take`` a row, ``attach``
it to the node whose pages end there; the worker saves the state part-way through the chunk's
forward, and a chunk with two such points ends at the first): at the last page boundary
before each prompt's last token, so that the next turn of a conversation and every sample of
the prompt start from it; and where the prompt leaves a cached path that goes on with other
tokens (``fork_depth``: a branch point with no snapshot yet, such as the end of a system prompt
that another request computed on its way to its own question), so that the prompts after it
that share it start from there. A prompt that extends a cached path where it ends (the next
turn of a conversation) takes no snapshot there: nothing branches from it yet. A snapshot is
written by the step that computes its prefix; steps run in order on the worker, so it is usable
from the next step on (``ready``) and a request admitted meanwhile whose path has one coming
waits for it (``pending``) rather than computing the prefix again. Snapshots live and die with
their nodes (evicting a node's pages frees its snapshot); when rows run out, the least recently
used snapshot that is written goes first (the shallowest among equals), its pages staying for
the KV they hold.
"""

from __future__ import annotations

from minisgl.serve.cache.radix_manager import RadixCacheManager, RadixHandle, _Node


class SnapshotRadixCacheManager(RadixCacheManager):
    takes_snapshots = True

    def __init__(self, page_size: int, rows: list[int]):
        super().__init__(page_size)
        self.rows = list(rows)
        self.free_rows = list(reversed(self.rows))
        self.holders: dict[int, _Node] = {}  # row -> the node whose snapshot it holds
        self.now = 0  # the step being scheduled (snapshots of earlier steps are written)

    def _ready(self, node: _Node) -> bool:
        return node.snapshot is not None and node.snapshot_step < self.now

    def match_prefix(self, ids: list[int], salt: str | None = None) -> tuple[RadixHandle, list[int]]:
        node, _ = self._walk(ids, salt=salt)
        while node.parent is not None and not self._ready(node):
            node = node.parent
        return node.handle, self._path_pages(node)

    def fork_depth(self, ids: list[int], salt: str | None = None) -> int:
        """Where ``ids`` leaves a cached path that goes on with other tokens (a branch point,
        snapshot or not), in tokens; 0 where it leaves none: its path ends inside ``ids`` (a
        conversation's next turn extends its last one, where no other request branches) or
        follows the cache to the end."""
        pos = self.start(salt)
        if pos is None:
            return 0
        (node, off), matched = self.advance(pos, ids[: self.aligned(len(ids))])
        forks = off < len(node.key) or bool(node.children)
        return matched if forks else 0

    def snapshot_of(self, handle: RadixHandle) -> int:
        """The row a matched prefix's state is copied from (-1: the empty prefix, zeros)."""
        node = handle.node
        return -1 if node.parent is None else node.snapshot

    def pending(self, ids: list[int], salt: str | None = None) -> bool:
        """Whether a snapshot past the match of ``ids`` is being written by a step in flight."""
        pos = self.start(salt)
        if pos is None:
            return False
        node, matched = pos[0], 0
        while matched < len(ids):
            child = node.children.get(self._edge(ids, matched))
            if child is None or ids[matched : matched + len(child.key)] != child.key:
                return False
            node, matched = child, matched + len(child.key)
            if node.snapshot is not None and not self._ready(node):
                return True
        return False

    def take(self) -> int | None:
        """A free row for a new snapshot, freeing the least recently used written one if none is
        free (None: every row is being written by this step)."""
        if not self.free_rows:
            written = [n for n in self.holders.values() if self._ready(n)]
            if not written:
                return None
            # A walk touches every node on its path at once, so a conversation's older snapshots
            # (its ancestors) are as recent as its deepest, the one its next turn starts from:
            # among equals the shallowest goes.
            self._drop(min(written, key=lambda n: (n.last_access, n.depth)))
        return self.free_rows.pop()

    def attach(self, ids: list[int], row: int, salt: str | None = None) -> bool:
        """Give the node whose path is ``ids`` (cached, locked by the request) the snapshot in
        ``row``, written by the step being scheduled; a node that has one keeps it (and the row
        goes back: False)."""
        node, matched = self._walk(ids, on_device=False, salt=salt)
        if matched != len(ids) or node.parent is None or node.snapshot is not None:
            self.free_rows.append(row)
            return False
        node.snapshot, node.snapshot_step = row, self.now
        self.holders[row] = node
        return True

    def _drop(self, node: _Node) -> None:
        row, node.snapshot = node.snapshot, None
        del self.holders[row]
        self.free_rows.append(row)

    # ---- the base tree's hooks and whole-cache operations -------------------------------------

    def _forget(self, node: _Node) -> None:
        if node.snapshot is not None:
            self._drop(node)
        super()._forget(node)

    def reset(self) -> list[int]:
        freed = super().reset()
        self.holders, self.free_rows = {}, list(reversed(self.rows))
        return freed

    def check_integrity(self) -> None:
        super().check_integrity()
        nodes = self._nodes()
        held = [n.snapshot for n in nodes if n.snapshot is not None]
        assert len(set(held)) == len(held), "a snapshot row is held twice"
        assert {id(self.holders[r]) for r in held} == {id(n) for n in nodes if n.snapshot is not None}, "holders"
        assert sorted(held + self.free_rows) == sorted(self.rows), "snapshot rows lost or duplicated"
