"""HostKVPool: the host-memory pages of the hierarchical cache, and the copies to and from the
device pool.

Page-first, ``[pages, layers, 2, page_size, kv_heads, head_dim]``: one page holds every
layer's K and V contiguously (one block to move whole, to disk or to another replica), while
the device pool stays layer-first for attention. On CUDA the buffer is page-locked and mapped
(``cudaHostRegister``: torch's pinned allocator rounds sizes up to a power of two), and copies
run on a stream of their own: our page-copy kernel reads and writes host memory directly
(``--hicache-io-backend kernel``, the default) on a few CTAs, so the forward it runs beside
keeps the other SMs, or the DMA engines do, one 2D copy per page and K/V (``direct``). A batch's
writes go before its loads; with the kernel an event per layer lets attention start on layer 0
while later layers still load (the direct backend marks all layers at once). Writes always take
the DMA engines: nothing waits for them layer by layer, and the kernel's CTAs beside decode
steps cost a few percent when everything fits on the device.
On CPU, torch index copies.
"""

from __future__ import annotations

import logging
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from minisgl.device.kvcache.mha_pool import MHAKVCache
from minisgl.serve.cache.disk_store import DiskStore

logger = logging.getLogger(__name__)

Keyed = tuple[list[bytes], list[int]]  # (staging tokens or keys, host pages) of disk reads or writes


def _unregister(ops: object, buffer: torch.Tensor) -> None:
    ops.host_unregister(buffer.data_ptr())


class HostKVPool:
    """``disk``: the storage tier; this rank (``rank``) reads pages from it before a batch's
    copies and writes pages to it behind, on threads of its own."""

    def __init__(
        self,
        num_pages: int,
        device_cache: MHAKVCache,
        io_backend: str = "kernel",
        disk: DiskStore | None = None,
        rank: int = 0,
        kernel_ctas: int = 32,
    ):
        dev = device_cache.buffer
        _, layers, _, page_size, heads, dim = dev.shape
        self.num_pages, self.num_layers, self.io_backend = num_pages, layers, io_backend
        self.kernel_ctas = kernel_ctas  # CTAs of the copy kernel: enough to fill the bus, few of the SMs
        self.buffer = torch.empty((num_pages, layers, 2, page_size, heads, dim), dtype=dev.dtype)
        self.on_cuda = dev.is_cuda
        self.disk, self.rank = disk, rank
        self._disk_jobs: dict[int, Future] = {}  # host page -> its write to disk, while it runs
        self._writer = ThreadPoolExecutor(4, thread_name_prefix="kv-disk") if disk is not None else None
        self.block = page_size * heads * dim * dev.dtype.itemsize  # bytes of one page of one layer's K
        if self.on_cuda:
            from minisgl.device.kernels.jit import load_module

            self._ops = load_module("page_copy")
            self.device_ptr = self._ops.host_register(self.buffer.data_ptr(), self.buffer.nbytes)
            self.stream = torch.cuda.Stream(dev.device)
            # The page pairs of queued copies, pinned and on the device, kept until their copies
            # are done: the copy stream can run far behind, and a pinned block handed to another
            # transfer before its queued upload ran would send garbage page numbers.
            self._held: deque[tuple[torch.cuda.Event, list[torch.Tensor]]] = deque()
            # Unregistered before the buffer's memory goes back (the finalizer holds the buffer).
            self._unregister = weakref.finalize(self, _unregister, self._ops, self.buffer)

    def close(self) -> None:
        """Unpin the buffer now (else when the pool is collected)."""
        if self.on_cuda:
            self._unregister()

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes

    def _strides(self, cache: MHAKVCache) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """(page, layer, kv) byte strides of the host pool and of the device pool."""
        b, pages = self.block, cache.buffer.shape[2]
        return (self.num_layers * 2 * b, 2 * b, b), (b, pages * b, self.num_layers * pages * b)

    def page_bytes(self, page: int) -> memoryview:
        return memoryview(self.buffer[page].view(torch.uint8).reshape(-1).numpy())

    def _disk(self, writes: list[int], disk_reads: Keyed, disk_writes: Keyed) -> None:
        """Start this batch's disk writes (their pages' copies are done), wait for those still
        reading a page this batch overwrites, then read this batch's pages from disk."""
        for key, page in zip(*disk_writes):
            self._disk_jobs[page] = self._writer.submit(self.disk.write_from, key, self.rank, self.page_bytes(page))
        for page in set(writes[1::2]) | set(disk_reads[1]):
            job = self._disk_jobs.pop(page, None)
            if job is not None:
                job.result()
        for page in [p for p, job in self._disk_jobs.items() if job.done()]:
            error = self._disk_jobs.pop(page).exception()
            if error is not None:
                logger.warning("writing a KV page to disk failed: %s", error)
        if disk_reads[0]:
            if self.on_cuda:
                self.stream.synchronize()  # earlier copies into these host pages are done
            for token, page in zip(*disk_reads):
                self.disk.read_staged(token, self.rank, self.page_bytes(page))

    def transfer(
        self,
        cache: MHAKVCache,
        writes: list[int],
        loads: list[int],
        disk_reads: Keyed = ([], []),
        disk_writes: Keyed = ([], []),
    ) -> list[torch.cuda.Event]:
        """Copy device pages to host pages (``writes``: flat (device, host) pairs), then host
        pages to device pages (``loads``: (host, device) pairs), after the disk reads (and
        writes) of the storage tier. On CUDA the copies are queued on the copy stream behind the
        work already on the current stream, and the returned events mark each layer's copies
        done (one event for all layers when no load goes through the kernel)."""
        if self.disk is not None:
            self._disk(writes, disk_reads, disk_writes)
        if not writes and not loads:
            return []
        self._check(writes, cache.num_pages, self.num_pages, "write (device, host)")
        self._check(loads, self.num_pages, cache.num_pages, "load (host, device)")
        if not self.on_cuda:
            self._transfer_torch(cache, writes, loads)
            return []
        while self._held and self._held[0][0].query():
            self._held.popleft()
        compute = torch.cuda.current_stream()
        self.stream.wait_stream(compute)  # the pages written were computed by earlier steps
        host, device = self._strides(cache)
        dev_ptr = cache.buffer.data_ptr()
        events: list[torch.cuda.Event] = []
        with torch.cuda.stream(self.stream):
            if writes:  # (the DMA engines: nothing waits for writes layer by layer)
                self._dma(writes, dev_ptr, self.device_ptr, device, host)
            if loads and self.io_backend == "direct":
                self._dma(loads, self.device_ptr, dev_ptr, host, device)
            elif loads:
                events = self._kernel_loads(cache, loads, host, device)
            if not events:
                event = torch.cuda.Event()
                event.record(self.stream)
                events = [event] * self.num_layers
        return events

    def _kernel_loads(
        self, cache: MHAKVCache, loads: list[int], host: tuple[int, ...], device: tuple[int, ...]
    ) -> list[torch.cuda.Event]:
        """Host-to-device page copies through the page-copy kernel, layer by layer on the copy
        stream: an event per layer, so a prefill's layer waits only for its own pages."""
        pinned = torch.tensor(loads, dtype=torch.int64).pin_memory()  # (so its upload can run behind)
        on_device = pinned.to(cache.buffer.device, non_blocking=True)
        dev_ptr, events = cache.buffer.data_ptr(), []
        for layer in range(self.num_layers):
            self._ops.copy_pages(
                self.device_ptr, dev_ptr, on_device, *host, *device, layer, layer + 1, self.block,
                self.kernel_ctas, self.stream.cuda_stream,
            )  # fmt: skip
            event = torch.cuda.Event()
            event.record(self.stream)
            events.append(event)
        self._held.append((events[-1], [pinned, on_device]))
        return events

    def _dma(
        self, pairs: list[int], src: int, dst: int, src_strides: tuple[int, int, int], dst_strides: tuple[int, int, int]
    ) -> None:
        """(source, destination) page pairs through the DMA engines, every layer in one 2D copy
        per pair and K/V (the pairs are read on the host, in the call)."""
        self._ops.copy_pages_direct(
            src,
            dst,
            torch.tensor(pairs, dtype=torch.int64),
            *src_strides,
            *dst_strides,
            self.num_layers,
            self.block,
            self.stream.cuda_stream,
        )

    @staticmethod
    def _check(pairs: list[int], sources: int, destinations: int, what: str) -> None:
        """Refuse a page outside either pool: the copies read and write raw addresses, so a bad
        index would corrupt memory or fault the device far from its cause."""
        if pairs and not (
            0 <= min(pairs[0::2])
            and max(pairs[0::2]) < sources
            and 0 <= min(pairs[1::2])
            and max(pairs[1::2]) < destinations
        ):
            raise IndexError(
                f"a {what} page pair is outside the pools ({sources} and {destinations} pages): "
                f"sources {min(pairs[0::2])}..{max(pairs[0::2])}, "
                f"destinations {min(pairs[1::2])}..{max(pairs[1::2])}"
            )

    def _transfer_torch(self, cache: MHAKVCache, writes: list[int], loads: list[int]) -> None:
        """The reference: whole pages through torch indexing (bytes, so fp8 pools work too)."""
        dev, host = cache.buffer.view(torch.uint8), self.buffer.view(torch.uint8)
        if writes:
            d, h = torch.tensor(writes[0::2]), torch.tensor(writes[1::2])
            host[h] = dev[:, :, d].permute(2, 1, 0, 3, 4, 5).to(host.device)
        if loads:
            h, d = torch.tensor(loads[0::2]), torch.tensor(loads[1::2])
            dev[:, :, d] = host[h].permute(2, 1, 0, 3, 4, 5).to(dev.device)
