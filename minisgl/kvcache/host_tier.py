"""HostTier: the host-memory pages under the radix tree, seen from the scheduler.

The scheduler owns all cache metadata, host pages included: this is their free list, the write
policy, and the copies queued for the next batch. The worker moves the bytes (``host_pool.py``)
in the order the batch lists them, per layer: writes (device -> host) before loads (host ->
device). Two hazards follow, and the tree avoids both with ``io_step`` (the batch that carries
a node's last copy):

- a host page whose copy is still to be emitted, or emitted in this very batch, is never freed
  for another copy of the same batch (host eviction skips such nodes);
- device pages freed by eviction may be overwritten by this batch's compute, so when the write
  that saved them is not known to be done (``confirmed``), the batch asks the worker to wait
  for its copies first (``wait``).

Loads are issued when a request is admitted; while others decode, its prefill waits until they
are known to be done (``Memory.loading``), so the copy runs beside decode steps instead of ahead
of a prefill. A prefill step waits for every load not yet known to be done (``wait_for_loads``),
layer by layer with the copy kernel.
"""

from __future__ import annotations

from minisgl.args import HICACHE_WRITE_POLICIES as WRITE_POLICIES
from minisgl.kvcache.allocator import PageAllocator
from minisgl.kvcache.disk_store import DiskStore

SELECTIVE_HITS = 2  # write_through_selective: a prefix goes to host once it has been matched this often


class HostTier:
    """``disk``: the storage tier under it (``page_bytes``: one page's bytes on one rank)."""

    def __init__(self, num_pages: int, write_policy: str = "write_through", disk: DiskStore | None = None,
                 page_bytes: int = 0):
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"hicache_write_policy must be one of {', '.join(WRITE_POLICIES)}, got {write_policy!r}")
        self.allocator = PageAllocator(num_pages)
        self.policy = write_policy
        self.step = 0  # the batch being built: copies queued now are emitted with it
        self.confirmed = -1  # copies of batches up to this one are done (their outputs came back)
        self.wait = False
        self.load_step = -1  # the last batch carrying loads
        self._writes: list[int] = []  # (device page, host page) pairs, flattened, for this batch
        self._deferred: list[int] = []  # pages this batch computes: written with the next one
        self._loads: list[int] = []  # (host page, device page) pairs, flattened
        self.written_pages = 0
        self.loaded_pages = 0
        self.evicted_pages = 0  # host pages given up to make room
        self.disk, self.page_bytes = disk, page_bytes
        self.disk_reads: tuple[list[bytes], list[int]] = ([], [])  # (keys, host pages) read before this batch's copies
        self.unpersisted: list[tuple[int, list[bytes], list[int]]] = []  # (batch of the host copies, keys, pages)
        self.owner: dict[int, bytes] = {}  # host page -> the key of what was last copied into it
        self.disk_read_pages = 0
        self.disk_written_pages = 0

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    def write(self, device: list[int], host: list[int], computing: bool) -> int:
        """Queue a device -> host copy; returns the batch that will carry it. ``computing``: the
        batch being built computes those pages, so the copy waits for the next."""
        queue = self._deferred if computing else self._writes
        for d, h in zip(device, host):
            queue += (d, h)
        self.written_pages += len(device)
        return self.step + computing

    @property
    def pending(self) -> bool:
        return bool(self._writes or self._deferred or self._loads or self.disk_reads[0] or self.unpersisted)

    def read_from_disk(self, keys: list[bytes], host: list[int]) -> None:
        self.disk_reads[0].extend(keys)
        self.disk_reads[1].extend(host)
        self.disk_read_pages += len(host)

    def load(self, host: list[int], device: list[int]) -> None:
        for h, d in zip(host, device):
            self._loads += (h, d)
        self.loaded_pages += len(host)
        self.load_step = self.step

    def wait_for_loads(self) -> None:
        """The batch being built prefills: its attention may read pages still loading."""
        if self.load_step > self.confirmed:
            self.wait = True

    def take(self) -> tuple[list[int], list[int], bool, tuple[list[bytes], list[int]]]:
        """This batch's copies (writes, loads), whether its compute must wait for them, and the
        pages it reads from disk first."""
        out = (self._writes, self._loads, self.wait, self.disk_reads)
        self._writes, self._deferred, self._loads, self.wait = self._deferred, [], [], False
        self.disk_reads = ([], [])
        self.step += 1
        return out

    def drop_queued(self) -> None:
        """Forget queued writes (the tree they were for is gone: flush)."""
        self._writes, self._deferred, self.unpersisted = [], [], []

    def done(self, step: int) -> None:
        """The batch ``step`` came back: its copies are complete."""
        self.confirmed = max(self.confirmed, step)

    def stats(self) -> dict[str, float]:
        return {
            "host_total_pages": self.allocator.num_pages,
            "host_free_pages": self.allocator.num_free,
            "host_written_pages": self.written_pages,
            "host_loaded_pages": self.loaded_pages,
            "host_evicted_pages": self.evicted_pages,
            **({"disk_read_pages": self.disk_read_pages, "disk_written_pages": self.disk_written_pages,
                "disk_corrupt_files": self.disk.corrupt} if self.disk is not None else {}),
        }
