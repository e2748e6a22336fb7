"""The cascade's shared level on our Triton kernel (``minisgl.kernels.shared_level``): planning.

Each step turns the groups into a work list (one item per group, tile of packed query rows and
split of the shared pages) and a split count per row; the kernel writes per-split partial
states and ``combine`` folds them into the own level's output. Under CUDA graphs the work list,
its length, the split counts and the partials live in fixed buffers and the launch shape is
fixed, so one captured graph serves any grouping that fits: everything a captured launch reads
is copied into those buffers at each plan.
"""

from __future__ import annotations

import numpy as np
import torch

from minisgl.attention.base import graph_groups
from minisgl.utils import cdiv

MAX_SPLITS = 8  # most splits of one group's shared pages (sizes the partial-state buffers)


def work_list(
    sizes: list[int], pages: list[int], members_per_tile: int, split_pages: int
) -> tuple[np.ndarray, np.ndarray]:
    """Items (first row, members, first page entry, pages, split) for groups of ``sizes`` rows
    (consecutive, from row 0) sharing ``pages`` pages each (concatenated in group order), and
    the split count of each grouped row. A group's pages split into runs of ``split_pages``, or
    into ``MAX_SPLITS`` runs where that is too many."""
    items, splits = [], []
    row = entry = 0
    for size, count in zip(sizes, pages):
        per = max(split_pages, cdiv(count, MAX_SPLITS))
        n = cdiv(count, per)
        for tile in range(0, size, members_per_tile):
            for s in range(n):
                items.append((row + tile, min(members_per_tile, size - tile), entry + s * per, min(per, count - s * per), s))
        splits += [n] * size
        row += size
        entry += count
    return np.array(items, dtype=np.int32).reshape(-1, 5), np.array(splits, dtype=np.int32)


class TritonSharedLevel:
    """Plans and runs the shared level for a backend whose caches are [pages, page_size, Hk, D]."""

    def __init__(
        self, num_qo_heads: int, num_kv_heads: int, head_dim: int, device: torch.device,
        split_tokens: int = 2048, block_m: int = 64, block_n: int = 64, programs_per_sm: int = 4,
        num_warps: int = 4, num_stages: int = 2,
    ):
        self.heads = (num_qo_heads, num_kv_heads, head_dim)
        self.device = device
        self.split_tokens = split_tokens
        self.launch = dict(block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages)
        self.members_per_tile = max(block_m // (num_qo_heads // num_kv_heads), 1)
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
        self.graph_programs = max(1, programs_per_sm * sms // num_kv_heads)
        self.graph_size: int | None = None

    def max_items(self, batch_size: int) -> int:
        return MAX_SPLITS * (graph_groups(batch_size) + batch_size // self.members_per_tile + 1)

    def init_cuda_graph(self, max_bs: int, max_pages_per_req: int) -> None:
        hq, _, dim = self.heads
        self._indices = torch.zeros(graph_groups(max_bs) * max_pages_per_req, dtype=torch.int32, device=self.device)
        self._work = torch.zeros(self.max_items(max_bs), 5, dtype=torch.int32, device=self.device)
        self._n_work = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._splits = torch.zeros(max_bs, dtype=torch.int32, device=self.device)
        self._part_o = torch.zeros(MAX_SPLITS, max_bs, hq, dim, dtype=torch.float32, device=self.device)
        self._part_lse = torch.zeros(MAX_SPLITS, max_bs, hq, dtype=torch.float32, device=self.device)

    def plan(self, sizes: list[int], pages: list[int], page_size: int, indices: torch.Tensor,
             graph_batch_size: int | None) -> None:
        """``indices``: the groups' shared pages, concatenated in group order, on the device."""
        hq, _, dim = self.heads
        work, splits = work_list(sizes, pages, self.members_per_tile, max(self.split_tokens // page_size, 1))
        self.graph_size = graph_batch_size
        if graph_batch_size is None:
            self.indices = indices
            self.programs = len(work)
            self.work = torch.from_numpy(work).to(self.device, non_blocking=True)
            self.n_work = torch.tensor([len(work)], dtype=torch.int32).to(self.device, non_blocking=True)
            self.splits = torch.from_numpy(splits).to(self.device, non_blocking=True)
            depth, rows = int(splits.max()), len(splits)
            self.part_o = torch.empty(depth, rows, hq, dim, dtype=torch.float32, device=self.device)
            self.part_lse = torch.empty(depth, rows, hq, dtype=torch.float32, device=self.device)
            return
        if len(work) > len(self._work) or len(indices) > len(self._indices):
            raise ValueError(f"{len(work)} shared-level work items on {len(indices)} pages; the graph of "
                             f"{graph_batch_size} holds {len(self._work)} on {len(self._indices)}")
        self.programs = min(self.graph_programs, self.max_items(graph_batch_size))
        padded = np.zeros(graph_batch_size, dtype=np.int32)
        padded[: len(splits)] = splits
        self._indices[: len(indices)].copy_(indices, non_blocking=True)
        self._work[: len(work)].copy_(torch.from_numpy(work), non_blocking=True)
        self._n_work.copy_(torch.tensor([len(work)], dtype=torch.int32), non_blocking=True)
        self._splits[:graph_batch_size].copy_(torch.from_numpy(padded), non_blocking=True)
        self.indices, self.work, self.n_work = self._indices, self._work, self._n_work
        self.splits = self._splits[:graph_batch_size]
        self.part_o, self.part_lse = self._part_o, self._part_lse

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> None:
        """The shared level's partial states, on the current stream."""
        from minisgl.kernels.shared_level import shared_level

        shared_level(q, k_cache, v_cache, self.indices, self.work, self.n_work, self.part_o, self.part_lse,
                     self.programs, scale, **self.launch)

    def combine(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Fold the partial states into the own level's (out, lse), rows in groups only."""
        from minisgl.kernels.shared_level import combine

        rows = len(self.splits)
        combine(out[:rows], lse[:rows], self.part_o, self.part_lse, self.splits)
