"""Giving a rank's device memory back while a colocated trainer trains, and taking it again
(SGLang's ``release_memory_occupation`` / ``resume_memory_occupation``).

Tags: ``weights`` (every parameter and buffer; their values wait in pinned host memory, allocated
at the first release and kept: pinning 16 GB took most of a 17.5 s first release of the 8B),
``kv_cache`` (the KV pool and a hybrid's state pool; their contents are dropped, the scheduler
flushes the prefix cache),
``cuda_graph`` (the captured graphs' memory pools). Storages are emptied in place
(``resize_(0)``), so every tensor and view that refers to them stays valid and sees the memory
again on resume; CUDA graphs, which hold raw addresses, are dropped whenever any of it goes and
captured again once all of it is back.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from minisgl.device.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

TAGS = ("weights", "kv_cache", "cuda_graph")


def _storages(module: torch.nn.Module) -> list[torch.UntypedStorage]:
    """Each distinct storage behind the module's parameters, buffers and tensor attributes
    (an fp8 head's copy, rotary tables)."""
    found: dict[int, torch.UntypedStorage] = {}
    for m in module.modules():
        tensors = [*m.parameters(recurse=False), *m.buffers(recurse=False)]
        tensors += [v for v in vars(m).values() if isinstance(v, torch.Tensor)]
        for t in tensors:
            s = t.untyped_storage()
            if s.nbytes():
                found.setdefault(s.data_ptr(), s)
    return list(found.values())


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class MemorySaver:
    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.released: set[str] = set()
        self._weights: list[tuple[torch.UntypedStorage, torch.Tensor]] = []  # storage, its host copy
        self._host: torch.Tensor | None = None  # every host copy, back to back (kept between releases)
        self._kv_bytes: list[int] = []  # each pool storage's size when released

    def release(self, tags: list[str]) -> str:
        """Free the memory of ``tags`` (already released ones are skipped)."""
        runner, start = self.runner, time.perf_counter()
        cuda = runner.device.type == "cuda"
        before = torch.cuda.memory_reserved(runner.device) if cuda else 0
        tags = [t for t in tags if t not in self.released]
        if tags:  # graphs hold the addresses of weights and KV pages: they go whatever is released
            runner.drop_graphs()
        if "weights" in tags:
            storages = _storages(runner.model)
            total = sum(s.nbytes() for s in storages)
            if self._host is None or self._host.numel() != total:
                self._host = torch.empty(total, dtype=torch.uint8, pin_memory=cuda)
            self._weights, at = [], 0
            for s in storages:
                host = self._host[at : at + s.nbytes()]
                host.copy_(_bytes_of(s), non_blocking=cuda)
                self._weights.append((s, host))
                at += s.nbytes()
            if cuda:
                torch.cuda.synchronize(runner.device)
            for s, _ in self._weights:
                s.resize_(0)
        if "kv_cache" in tags:
            storages = self._pool_storages()
            self._kv_bytes = [s.nbytes() for s in storages]
            for storage in storages:
                storage.resize_(0)
        self.released |= set(tags) | {"cuda_graph"}
        gc.collect()
        freed = 0
        if cuda:
            torch.cuda.empty_cache()
            freed = before - torch.cuda.memory_reserved(runner.device)
        return (
            f"released {', '.join(sorted(tags)) or 'nothing'} ({freed / 2**30:.2f} GiB) in "
            f"{time.perf_counter() - start:.2f} s"
        )

    def _pool_storages(self) -> list[torch.UntypedStorage]:
        """What ``kv_cache`` releases: the KV pool, and a hybrid model's state pool (its
        requests' states and the prefix cache's snapshots, which the flush drops)."""
        runner = self.runner
        pools = [runner.kv_cache.buffer]
        if runner.states is not None:
            pools += [runner.states.conv, runner.states.ssm]
        return [p.untyped_storage() for p in pools]

    def resume(self, tags: list[str]) -> str:
        """Take the memory of ``tags`` again; graphs are captured again once nothing is left out."""
        runner, start = self.runner, time.perf_counter()
        tags = [t for t in tags if t in self.released]
        if "weights" in tags:
            for s, host in self._weights:
                s.resize_(host.numel())
                _bytes_of(s).copy_(host, non_blocking=True)
            if runner.device.type == "cuda":
                torch.cuda.synchronize(runner.device)
            self._weights = []
        if "kv_cache" in tags:
            for storage, size in zip(self._pool_storages(), self._kv_bytes):
                storage.resize_(size)
                _bytes_of(storage).zero_()  # (scratch pages included: nothing reads stale bytes as numbers)
        self.released -= set(tags)
        captured = ""
        if self.released == {"cuda_graph"}:
            self.released = set()
        if not self.released and runner.capture_graphs():
            captured = f", CUDA graphs captured again in {runner.graph_capture_s:.2f} s"
        return f"resumed {', '.join(sorted(tags)) or 'nothing'} in {time.perf_counter() - start:.2f} s{captured}"
