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

Writes are spread over batches, at most ``max_writes`` pages each (the worker issues two DMA
copies per page, and past about a thousand queued copies every further call blocks the host
thread until one finishes: 256 requests finishing at once on the 8B held it 160 ms;
``benchmarks/hicache_bandwidth.py``). Each write is given its batch when it is queued, so
``io_step`` stays exact; a device page evicted before its write's batch has its copy moved into
the batch being built (``expedite``).

Loads are issued when a request is admitted, with the batch that prefills it; a prefill step
waits for every load not yet known to be done (``wait_for_loads``), layer by layer with the copy
kernel, so the copy of layer i overlaps the prefill of the layers before it.
"""

from __future__ import annotations

from collections import deque

from minisgl.config.args import HICACHE_WRITE_POLICIES as WRITE_POLICIES
from minisgl.serve.cache.allocator import PageAllocator
from minisgl.serve.cache.disk_store import DiskStore

SELECTIVE_HITS = 2  # write_through_selective: a prefix goes to host once it has been matched this often
MAX_WRITES_PER_BATCH = 256  # pages: 512 DMA copies, ~1 ms of the host thread; 11 ms of copying on the 8B


class HostTier:
    """``disk``: the storage tier under it (``page_bytes``: one page's bytes on one rank)."""

    def __init__(
        self,
        num_pages: int,
        write_policy: str = "write_through",
        disk: DiskStore | None = None,
        page_bytes: int = 0,
        max_writes: int = MAX_WRITES_PER_BATCH,
    ):
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"hicache_write_policy must be one of {', '.join(WRITE_POLICIES)}, got {write_policy!r}")
        self.allocator = PageAllocator(num_pages)
        self.policy = write_policy
        self.step = 0  # the batch being built: copies queued now are emitted with it
        self.confirmed = -1  # copies of batches up to this one are done (their outputs came back)
        self.wait = False
        self.load_step = -1  # the last batch carrying loads
        self.max_writes = max_writes
        # (device page, host page) pairs, flattened, per batch from the one being built on
        self._writes: deque[list[int]] = deque([[]])
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
        """Queue a device -> host copy in the first batches with room; returns the last batch
        that carries part of it. ``computing``: the batch being built computes those pages, so
        the copy starts with the next."""
        at, pairs = int(computing), [x for pair in zip(device, host) for x in pair]
        while True:
            while len(self._writes) <= at:
                self._writes.append([])
            room = 2 * self.max_writes - len(self._writes[at])
            self._writes[at] += pairs[:room]
            pairs = pairs[room:]
            if not pairs:
                break
            at += 1
        self.written_pages += len(device)
        return self.step + at

    def expedite(self, device: list[int]) -> None:
        """Move the queued writes of these device pages (about to be freed) into the batch being
        built; the node that owned them now has its copy there."""
        moving = set(device)
        for queued in list(self._writes)[1:]:
            keep = []
            for i in range(0, len(queued), 2):
                (self._writes[0] if queued[i] in moving else keep).extend(queued[i : i + 2])
            queued[:] = keep

    @property
    def pending(self) -> bool:
        return any(self._writes) or self.urgent

    @property
    def urgent(self) -> bool:
        """Copies something waits for: loads, disk reads, and writes the storage tier persists
        (writes that only fill the host tier go out with whatever batch comes next)."""
        return bool(self._loads or self.disk_reads[0] or self.unpersisted)

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
        out = (self._writes.popleft(), self._loads, self.wait, self.disk_reads)
        if not self._writes:
            self._writes.append([])
        self._loads, self.wait = [], False
        self.disk_reads = ([], [])
        self.step += 1
        return out

    def drop_queued(self) -> None:
        """Forget queued writes (the tree they were for is gone: flush)."""
        self._writes, self.unpersisted = deque([[]]), []

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
            **(
                {
                    "disk_read_pages": self.disk_read_pages,
                    "disk_written_pages": self.disk_written_pages,
                    "disk_corrupt_files": self.disk.corrupt,
                }
                if self.disk is not None
                else {}
            ),
        }
