"""Cascade decode on our Triton kernel (``minisgl.kernels.partial_attention``): planning.

Each step turns the groups into a shared work list (one item per group, tile of packed query
rows and split of the shared pages) and, when the own level runs here too, an own work list
(one item per request over its pages past its group's). Every item writes a partial state
into a slot of its rows: a group's splits take slots 0..n-1 of its members, the own level the
next one. ``combine`` merges each row's slots (into the own level's state when FlashInfer ran
that level). Under CUDA graphs the work lists, page lists, lengths and slot counts live in
fixed buffers and the launch shapes are fixed, so one captured graph serves any grouping that
fits: everything a captured launch reads is copied into those buffers at each plan.
"""

from __future__ import annotations

import numpy as np
import torch

from minisgl.attention.base import graph_groups
from minisgl.utils import cdiv

MAX_SPLITS = 8  # most splits of one group's shared pages (with the next, sizes the partial states)
MAX_OWN_SPLITS = 8  # most splits of one request's own pages


def shared_work(
    sizes: list[int], pages: list[int], page_size: int, members_per_tile: int, target_items: int, min_split_pages: int
) -> tuple[np.ndarray, np.ndarray]:
    """Items (first row, members, first page entry, tokens, slot) for groups of ``sizes`` rows
    (consecutive, from row 0) sharing ``pages`` whole pages each (concatenated in group order),
    and the slot count of each grouped row. Groups' pages split evenly until there are about
    ``target_items`` items (at most ``MAX_SPLITS`` runs a group, none under ``min_split_pages``):
    few groups need splits to fill the GPU, many groups only pay for them in partial states."""
    tiles = sum(cdiv(size, members_per_tile) for size in sizes)
    want = min(max(target_items // max(tiles, 1), 1), MAX_SPLITS)
    items, splits = [], []
    row = entry = 0
    for size, count in zip(sizes, pages):
        per = max(cdiv(count, want), min(min_split_pages, count), cdiv(count, MAX_SPLITS))
        n = cdiv(count, per)
        for tile in range(0, size, members_per_tile):
            for s in range(n):
                items.append((row + tile, min(members_per_tile, size - tile), entry + s * per,
                              min(per, count - s * per) * page_size, s))
        splits += [n] * size
        row += size
        entry += count
    return np.array(items, dtype=np.int32).reshape(-1, 5), np.array(splits, dtype=np.int32)


def own_work(tokens: list[int], pages: list[int], first_slots: np.ndarray, page_size: int, target_items: int,
             min_split_pages: int) -> tuple[np.ndarray, np.ndarray]:
    """Items for each request's ``tokens`` past its shared part, on its ``pages`` (concatenated
    in request order), into slots from ``first_slots[i]`` on, and each request's slot count.
    Long runs (a request outside groups, or far past its group's prefix) split into about
    equal runs of whole pages, sized so the batch makes about ``target_items`` items, at most
    ``MAX_OWN_SPLITS`` a request: one long run per CTA would leave the GPU waiting on it."""
    per = max(cdiv(cdiv(sum(tokens), page_size), max(target_items, 1)), min_split_pages)
    items, counts = [], []
    entry = 0
    for i, (n, count) in enumerate(zip(tokens, pages)):
        k = min(max(count // per, 1), MAX_OWN_SPLITS)  # runs of about ``per`` pages, none much shorter
        run = cdiv(count, k)
        k = cdiv(count, run)
        items += [(i, 1, entry + s * run, min(run * page_size, n - s * run * page_size), first_slots[i] + s)
                  for s in range(k)]
        counts.append(k)
        entry += count
    return np.array(items, dtype=np.int32).reshape(-1, 5), np.array(counts, dtype=np.int32)


class _Level:
    """One launch of the kernel: its work list and page list (fixed buffers under graphs)."""

    def __init__(self, device: torch.device, launch: dict, graph_programs: int):
        self.device, self.launch, self.graph_programs = device, launch, graph_programs

    def init_cuda_graph(self, max_items: int, max_indices: int) -> None:
        self._work = torch.zeros(max_items, 5, dtype=torch.int32, device=self.device)
        self._n_work = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._indices = torch.zeros(max_indices, dtype=torch.int32, device=self.device)

    def plan(self, work: np.ndarray, indices: torch.Tensor, graph: bool) -> None:
        if not graph:
            self.programs, self.indices = len(work), indices
            self.work = torch.from_numpy(work).to(self.device, non_blocking=True)
            self.n_work = torch.tensor([len(work)], dtype=torch.int32).to(self.device, non_blocking=True)
            return
        if len(work) > len(self._work) or len(indices) > len(self._indices):
            raise ValueError(f"{len(work)} work items on {len(indices)} pages; the graph holds "
                             f"{len(self._work)} on {len(self._indices)}")
        self._indices[: len(indices)].copy_(indices, non_blocking=True)
        self._work[: len(work)].copy_(torch.from_numpy(work), non_blocking=True)
        self._n_work.copy_(torch.tensor([len(work)], dtype=torch.int32), non_blocking=True)
        self.programs = min(self.graph_programs, len(self._work))
        self.indices, self.work, self.n_work = self._indices, self._work, self._n_work

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, part_o: torch.Tensor,
            part_lse: torch.Tensor, scale: float) -> None:
        from minisgl.kernels.partial_attention import partial_attention

        partial_attention(q, k_cache, v_cache, self.indices, self.work, self.n_work, part_o, part_lse,
                          self.programs, scale, **self.launch)


class TritonCascade:
    """Plans and runs the cascade's levels for a backend whose caches are [pages, page_size, Hk, D].
    ``own_level``: run the own level here too (else the caller runs it and passes its state to
    ``combine``)."""

    def __init__(
        self, num_qo_heads: int, num_kv_heads: int, head_dim: int, device: torch.device,
        items_per_sm: int = 2, min_split_tokens: int = 256, block_m: int = 64, block_n: int = 64, programs_per_sm: int = 4,
        num_warps: int = 4, num_stages: int = 2, own_level: bool = True, own_block_n: int = 64,
        own_stages: int = 2, own_items_per_sm: int = 4,
    ):
        self.heads = (num_qo_heads, num_kv_heads, head_dim)
        self.device = device
        gqa = num_qo_heads // num_kv_heads
        self.members_per_tile = max(block_m // gqa, 1)
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
        # The shared level aims at ``items_per_sm`` CTAs per SM (each item runs once per KV head).
        self.target_items = max(1, items_per_sm * sms // num_kv_heads)
        self.min_split_tokens = min_split_tokens
        self.own_target_items = max(1, own_items_per_sm * sms // num_kv_heads)
        programs = max(1, programs_per_sm * sms // num_kv_heads)
        self.shared = _Level(device, dict(block_m=block_m, block_n=block_n, num_warps=num_warps,
                                          num_stages=num_stages), programs)
        from triton import next_power_of_2

        own_m = max(16, next_power_of_2(gqa))
        self.own = _Level(device, dict(block_m=own_m, block_n=own_block_n, num_warps=4, num_stages=own_stages),
                          programs) if own_level else None

    def max_items(self, batch_size: int) -> int:
        return MAX_SPLITS * (graph_groups(batch_size) + batch_size // self.members_per_tile + 1)

    def init_cuda_graph(self, max_bs: int, max_pages_per_req: int) -> None:
        hq, _, dim = self.heads
        self.shared.init_cuda_graph(self.max_items(max_bs), graph_groups(max_bs) * max_pages_per_req)
        if self.own is not None:
            self.own.init_cuda_graph(max_bs * MAX_OWN_SPLITS, max_bs * max_pages_per_req)
        self._splits = torch.zeros(max_bs, dtype=torch.int32, device=self.device)
        depth = MAX_SPLITS + (MAX_OWN_SPLITS if self.own is not None else 0)
        self._part_o = torch.zeros(depth, max_bs, hq, dim, dtype=torch.float32, device=self.device)
        self._part_lse = torch.zeros(depth, max_bs, hq, dtype=torch.float32, device=self.device)

    def plan(
        self, sizes: list[int], pages: list[int], page_size: int, shared_indices: torch.Tensor,
        own: tuple[list[int], list[int], torch.Tensor] | None, graph_batch_size: int | None,
    ) -> None:
        """``shared_indices``: the groups' shared pages in group order, on the device. ``own``
        (with the own level here): per request of the batch (graph padding included) its tokens
        and page count past the shared part, and those pages concatenated, on the device."""
        hq, _, dim = self.heads
        graph = graph_batch_size is not None
        work, splits = shared_work(sizes, pages, page_size, self.members_per_tile, self.target_items,
                                   max(self.min_split_tokens // page_size, 1))
        self.shared.plan(work, shared_indices, graph)
        rows = graph_batch_size if graph else (len(own[0]) if own is not None else len(splits))
        counts = np.zeros(rows, dtype=np.int32)
        counts[: len(splits)] = splits
        if self.own is not None:
            tokens, own_pages, own_indices = own
            work, own_counts = own_work(tokens, own_pages, counts, page_size, self.own_target_items,
                                        max(self.min_split_tokens // page_size, 1))
            self.own.plan(work, own_indices, graph)
            counts += own_counts
        if graph:
            self._splits[:rows].copy_(torch.from_numpy(counts), non_blocking=True)
            self.splits, self.part_o, self.part_lse = self._splits[:rows], self._part_o, self._part_lse
        else:
            self.splits = torch.from_numpy(counts).to(self.device, non_blocking=True)
            depth = int(counts.max())
            self.part_o = torch.empty(depth, rows, hq, dim, dtype=torch.float32, device=self.device)
            self.part_lse = torch.empty(depth, rows, hq, dtype=torch.float32, device=self.device)

    def run_shared(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> None:
        self.shared.run(q, k_cache, v_cache, self.part_o, self.part_lse, scale)

    def run_own(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> None:
        self.own.run(q, k_cache, v_cache, self.part_o, self.part_lse, scale)

    def combine(self, out: torch.Tensor, lse: torch.Tensor | None = None) -> None:
        """Merge each row's partial states into ``out`` (and the state in (out, lse) if given)."""
        from minisgl.kernels.partial_attention import combine

        rows = len(self.splits)
        combine(out[:rows], None if lse is None else lse[:rows], self.part_o, self.part_lse, self.splits)
