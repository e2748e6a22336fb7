"""Triton decode steps on our kernel (``minisgl.kernels.partial_attention``): planning.

A cascade step turns the groups into a shared work list (items over a tile of members and a run
of the group's shared pages, read once for all of them) and an own work list (items over each
request's pages past its group's); a plain step on the kernel is an own work list alone. Each
item writes partial states into its rows' state slots and ``combine`` folds each row's slots in
order. Two ways to split the work:

- free (the default cascade): runs of whole pages sized to fill the GPU, one state per item;
  the fewest states, but a row's rounding depends on where its runs were cut;
- ``chunk_tokens`` (``--decode-attention-backend triton``): runs of whole chunks at fixed
  positions, one state per chunk, both levels on one query-row tile, so a row's bits do not
  depend on the grouping and a cascade step returns exactly what a plain step does.

Under CUDA graphs the work lists, page lists, state offsets and counts live in fixed buffers and
the launch shapes are fixed, so one captured graph serves any grouping that fits: everything a
captured launch reads is copied into those buffers at each plan.
"""

from __future__ import annotations

import numpy as np
import torch

from minisgl.attention.base import graph_groups
from minisgl.utils import cdiv

CHUNK_TOKENS = 256  # keys per chunk state when chunked
MIN_SPLIT_TOKENS = 256  # shortest run worth its own item
MAX_SPLITS = 8  # most items over one tile's shared pages
MAX_OWN_SPLITS = 8  # most items over one request's own pages
GRAPH_STATES_PER_ROW = MAX_SPLITS + MAX_OWN_SPLITS  # states the CUDA-graph buffers hold per row on average


def shared_work(sizes: list[int], units: list[int], unit_pages: int, unit_tokens: int, members_per_tile: int,
                target_items: int, min_split_units: int, chunked: bool) -> tuple[np.ndarray, np.ndarray]:
    """Items (first row, members, first page entry, tokens, first slot) for groups of ``sizes``
    rows (consecutive, from row 0) sharing ``units`` whole units (pages, or chunks of
    ``unit_pages`` pages) each, their pages concatenated in group order; and each grouped row's
    state count. A group's units split evenly until there are about ``target_items`` items (at
    most ``MAX_SPLITS`` runs a tile, none under ``min_split_units``): few groups need splits to
    fill the GPU, many groups only pay for them in states. An item's first slot is its split
    (free) or its first chunk (``chunked``: a state per chunk)."""
    tiles = sum(cdiv(size, members_per_tile) for size in sizes)
    want = min(max(target_items // max(tiles, 1), 1), MAX_SPLITS)
    items, states = [], []
    row = entry = 0
    for size, count in zip(sizes, units):
        per = max(cdiv(count, want), min(min_split_units, count), cdiv(count, MAX_SPLITS), 1)
        starts = range(0, count, per)
        for tile in range(0, size, members_per_tile):
            items += [(row + tile, min(members_per_tile, size - tile), entry + first * unit_pages,
                       min(per, count - first) * unit_tokens, first if chunked else split)
                      for split, first in enumerate(starts)]
        states += [count if chunked else len(starts)] * size
        row += size
        entry += count * unit_pages
    return np.array(items, dtype=np.int32).reshape(-1, 5), np.array(states, dtype=np.int32)


def own_work(tokens: list[int], pages: list[int], first_slots: list[int], unit_pages: int, unit_tokens: int,
             target_items: int, min_split_units: int, chunked: bool) -> tuple[np.ndarray, np.ndarray]:
    """Items for each request's ``tokens`` past its shared part, on its ``pages`` (concatenated
    in request order), into slots from ``first_slots[i]`` on, and each request's state count.
    Long runs (a request outside groups, or far past its group's prefix) split into about equal
    runs of whole units, sized so the batch makes about ``target_items`` items, at most
    ``MAX_OWN_SPLITS`` a request: one long run per CTA would leave the GPU waiting on it."""
    units = [cdiv(n, unit_tokens) for n in tokens]
    per = max(cdiv(sum(units), max(target_items, 1)), min_split_units)
    items, states = [], []
    entry = 0
    for i, (n, count, num_pages) in enumerate(zip(tokens, units, pages)):
        run = cdiv(count, min(max(count // per, 1), MAX_OWN_SPLITS))  # about ``per`` units, none much shorter
        starts = range(0, count, run)
        items += [(i, 1, entry + first * unit_pages, min(run * unit_tokens, n - first * unit_tokens),
                   first_slots[i] + (first if chunked else split)) for split, first in enumerate(starts)]
        states.append(count if chunked else len(starts))
        entry += num_pages
    return np.array(items, dtype=np.int32).reshape(-1, 5), np.array(states, dtype=np.int32)


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

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, row_base: torch.Tensor,
            part_o: torch.Tensor, part_lse: torch.Tensor, scale: float, chunk: int | None) -> None:
        from minisgl.kernels.partial_attention import partial_attention

        if self.programs:
            partial_attention(q, k_cache, v_cache, self.indices, self.work, self.n_work, row_base, part_o, part_lse,
                              self.programs, scale, chunk, **self.launch)


class TritonCascade:
    """Plans and runs Triton decode steps (cascade or plain) for a backend whose caches are
    [pages, page_size, Hk, D]. ``own_level``: run the own level here too (else the caller runs it
    and passes its state to ``combine``). ``chunk_tokens``: split by chunks at fixed positions
    (a multiple of the page size and of both block sizes), else freely."""

    def __init__(
        self, num_qo_heads: int, num_kv_heads: int, head_dim: int, device: torch.device,
        items_per_sm: int = 2, block_m: int = 64, block_n: int = 64, programs_per_sm: int = 4,
        num_warps: int = 4, num_stages: int = 2, own_level: bool = True, own_block_n: int = 64,
        own_stages: int = 2, own_items_per_sm: int = 4, own_warps: int = 4, chunk_tokens: int | None = None,
    ):
        self.heads = (num_qo_heads, num_kv_heads, head_dim)
        self.device = device
        self.chunk = chunk_tokens
        gqa = num_qo_heads // num_kv_heads
        own_m = max(16, 1 << (gqa - 1).bit_length())  # one request's query heads
        # Chunked, both levels tile query rows alike: the tensor cores sum a product in an order
        # that depends on the tile (wgmma from 64 rows on the H100, mma.sync below), and a row
        # must get the same bits from either level. The own level's tile is the cheaper one.
        block_m = own_m if chunk_tokens else max(block_m, own_m)
        self.members_per_tile = block_m // gqa
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
        # The shared level aims at ``items_per_sm`` CTAs per SM (each item runs once per KV head).
        self.target_items = max(1, items_per_sm * sms // num_kv_heads)
        self.own_target_items = max(1, own_items_per_sm * sms // num_kv_heads)
        programs = max(1, programs_per_sm * sms // num_kv_heads)
        self.shared = _Level(device, dict(block_m=block_m, block_n=block_n, num_warps=num_warps,
                                          num_stages=num_stages), programs)
        self.own = _Level(device, dict(block_m=own_m, block_n=own_block_n, num_warps=own_warps,
                                       num_stages=own_stages), programs) if own_level else None

    def max_items(self, batch_size: int) -> int:
        return MAX_SPLITS * (graph_groups(batch_size) + batch_size // self.members_per_tile + 1)

    def shared_pages(self, pages: int, page_size: int) -> int:
        """The leading pages of a group's ``pages`` shared ones that its shared level reads: all,
        or whole chunks only (the chunk a prefix ends in then stays with each member's own level)."""
        return pages * page_size // self.chunk * self.chunk // page_size if self.chunk else pages

    def graph_fits(self, cached_lens: list[int], size: int) -> bool:
        """Whether a decode step's states (``cached_lens`` + 1 tokens a request, padding rows of one)
        fit the CUDA-graph buffers; free splits always do."""
        if not self.chunk:
            return True
        return sum(cdiv(n + 1, self.chunk) for n in cached_lens) + size - len(cached_lens) <= self.max_states

    def init_cuda_graph(self, max_bs: int, max_pages_per_req: int) -> None:
        hq, _, dim = self.heads
        self.shared.init_cuda_graph(self.max_items(max_bs), graph_groups(max_bs) * max_pages_per_req)
        if self.own is not None:
            self.own.init_cuda_graph(max_bs * MAX_OWN_SPLITS, max_bs * max_pages_per_req)
        self.max_states = max_bs * GRAPH_STATES_PER_ROW
        self._row_base = torch.zeros(max_bs, dtype=torch.int32, device=self.device)
        self._states = torch.zeros(max_bs, dtype=torch.int32, device=self.device)
        self._part_o = torch.zeros(self.max_states, hq, dim, dtype=torch.float32, device=self.device)
        self._part_lse = torch.zeros(self.max_states, hq, dtype=torch.float32, device=self.device)

    def plan(
        self, sizes: list[int], pages: list[int], page_size: int, shared_indices: torch.Tensor,
        own: tuple[list[int], list[int], torch.Tensor] | None, graph_batch_size: int | None,
    ) -> None:
        """``pages``: each group's shared pages as ``shared_pages`` gives them; ``shared_indices``:
        those pages in group order, on the device. ``own`` (with the own level here): per request
        of the batch (graph padding included) its tokens and page count past the shared part, and
        those pages concatenated, on the device."""
        hq, _, dim = self.heads
        graph = graph_batch_size is not None
        unit_pages = self.chunk // page_size if self.chunk else 1
        unit_tokens = unit_pages * page_size
        min_units = max(MIN_SPLIT_TOKENS // unit_tokens, 1)
        chunked = bool(self.chunk)
        work, grouped = shared_work(sizes, [p // unit_pages for p in pages], unit_pages, unit_tokens,
                                    self.members_per_tile, self.target_items, min_units, chunked)
        self.shared.plan(work, shared_indices, graph)
        rows = graph_batch_size if graph else (len(own[0]) if own is not None else len(grouped))
        counts = np.zeros(rows, dtype=np.int32)
        counts[: len(grouped)] = grouped
        if self.own is not None:
            tokens, own_pages, own_indices = own
            work, own_counts = own_work(tokens, own_pages, counts.tolist(), unit_pages, unit_tokens,
                                        self.own_target_items, min_units, chunked)
            self.own.plan(work, own_indices, graph)
            counts += own_counts
        base = (np.cumsum(counts) - counts).astype(np.int32)
        total = int(counts.sum())
        if graph:
            if total > self.max_states:
                raise ValueError(f"{total} partial states; the graph holds {self.max_states}")
            host = torch.from_numpy(np.stack([base, counts]))
            self._row_base[:rows].copy_(host[0], non_blocking=True)
            self._states[:rows].copy_(host[1], non_blocking=True)
            self.row_base, self.states = self._row_base[:rows], self._states[:rows]
            self.part_o, self.part_lse = self._part_o, self._part_lse
        else:
            self.row_base, self.states = torch.from_numpy(np.stack([base, counts])).to(self.device, non_blocking=True)
            self.part_o = torch.empty(total, hq, dim, dtype=torch.float32, device=self.device)
            self.part_lse = torch.empty(total, hq, dtype=torch.float32, device=self.device)

    def _run(self, level: _Level, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> None:
        level.run(q, k_cache, v_cache, self.row_base, self.part_o, self.part_lse, scale, self.chunk)

    def run_shared(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> None:
        self._run(self.shared, q, k_cache, v_cache, scale)

    def run_own(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> None:
        self._run(self.own, q, k_cache, v_cache, scale)

    def combine(self, out: torch.Tensor, lse: torch.Tensor | None = None) -> None:
        """Fold each row's states into ``out`` (after the state in (out, lse) if given)."""
        from minisgl.kernels.partial_attention import combine

        rows = len(self.states)
        combine(out[:rows], None if lse is None else lse[:rows], self.part_o, self.part_lse, self.row_base, self.states)
