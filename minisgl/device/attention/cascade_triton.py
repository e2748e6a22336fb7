"""Decode steps on our Triton kernel (``minisgl.device.kernels.partial_attention``): planning.

Every step on the kernel, plain or cascade, cuts each request's keys into segments at the same
fixed boundaries, chosen from the batch's sequence lengths alone (``segment_tokens``), so a step
cuts alike with or without groups: long requests split for parallelism, short ones stay whole.
A request with one segment gets its output straight from the item that finishes it; one with
several leaves a state per segment, which ``combine`` folds in order.

A cascade step moves the start of each grouped request's pass into its group's shared level:
for each run of members (up to ``shared_rows`` query rows), items over the group's shared tokens
(whole ``BLOCK_N`` tiles), one per segment they touch, read those pages once for all the run's
members and leave their states;
each member's own items resume them where a segment goes on past the shared part. A request's
every segment thus ends with the bits a plain step's item would give it (the kernel's docstring
says why that matters and how it holds).

Under CUDA graphs the work lists, page lists, state offsets and counts live in fixed buffers and
the launch shapes are fixed, so one captured graph serves any grouping: everything a captured
launch reads is copied into those buffers at each plan. The number of states and items a step
needs is bounded by the batch size and the items target, so the buffers always hold them.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from minisgl.device.attention import base
from minisgl.device.attention.base import graph_groups
from minisgl.device.distributed import get_tp_info
from minisgl.utils import cdiv

MIN_SEGMENT_TOKENS = 256  # shortest segment worth its own item and state


def header_size(rows: int, items: int) -> int:
    """int32 entries of a step's uploaded header with room for ``rows`` rows and ``items`` items
    a level: the two levels' item counts, each row's first state and fold count, two work lists."""
    return 2 + 2 * rows + 12 * items


def _expand(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For owners with ``counts`` children each: every child's owner and its index among siblings."""
    owner = np.repeat(np.arange(len(counts)), counts)
    return owner, np.arange(len(owner)) - np.repeat(np.cumsum(counts) - counts, counts)


def segment_tokens(lens: np.ndarray | list[int], unit: int, target_items: int, min_tokens: int) -> int:
    """Segment length (a multiple of ``unit``) for a batch of requests ``lens`` tokens long: the
    longest request splits into about as many parts as it holds shares of the batch's tokens
    divided among ``target_items`` items, none shorter than ``min_tokens``."""
    total, longest = (int(lens.sum()), int(lens.max())) if isinstance(lens, np.ndarray) else (sum(lens), max(lens))
    per_item = total / max(target_items, 1)
    parts = max(1, round(longest / per_item))
    return max(cdiv(cdiv(longest, parts), unit), cdiv(min_tokens, unit)) * unit


def _work(rows, members, entries, tokens, slots, flags) -> np.ndarray:
    """A work list in the kernel's layout (``partial_attention``'s ``work``)."""
    return np.stack([rows, members, entries, tokens, slots, flags], axis=1).astype(np.int32).reshape(-1, 6)


def shared_work(
    sizes: list[int], shared_tokens: list[int] | np.ndarray, page_size: int, segment: int, members_per_item: int
) -> np.ndarray:
    """Items for groups of ``sizes`` rows (consecutive, from row 0) sharing ``shared_tokens``
    tokens each (whole pages), their pages concatenated in group order: per run of up to
    ``members_per_item`` members, one item per segment the shared tokens touch, into the slot of
    that segment."""
    sizes, shared = np.asarray(sizes, dtype=np.int64), np.asarray(shared_tokens, dtype=np.int64)
    group, run = _expand(-(-sizes // members_per_item))
    first_row = (np.cumsum(sizes) - sizes)[group] + run * members_per_item
    members = np.minimum(members_per_item, sizes[group] - run * members_per_item)
    group_entry = np.cumsum(shared // page_size) - shared // page_size
    t, seg = _expand(-(-shared[group] // segment))
    start = seg * segment
    g = group[t]
    return _work(
        first_row[t],
        members[t],
        group_entry[g] + start // page_size,
        np.minimum(segment, shared[g] - start),
        seg,
        np.zeros_like(seg),
    )


def own_work(
    lens: np.ndarray, shared: np.ndarray, page_size: int, segment: int, page_lens: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Items for each request of ``lens`` tokens past its first ``shared`` (a group's shared level
    reads those), on its pages past the shared ones (concatenated in request order; pages for
    ``page_lens`` tokens where a request may grow), one per segment, resuming the shared level's
    state inside a segment it started; and each request's segment count (its state slots)."""
    from minisgl.device.kernels.partial_attention import FINAL, RESUME

    segments = -(-lens // segment)
    row, k = _expand(segments - shared // segment)
    seg = shared[row] // segment + k
    seg_start = seg * segment
    start = np.maximum(seg_start, shared[row])
    end = np.minimum(seg_start + segment, lens[row])
    own_pages = -(-(lens if page_lens is None else page_lens) // page_size) - shared // page_size
    entry = (np.cumsum(own_pages) - own_pages)[row] + (start - shared[row]) // page_size
    flags = RESUME * (start > seg_start) + FINAL * (segments[row] == 1)
    return _work(row, np.ones_like(row), entry, end - start, seg, flags), segments


def fp8_page_options(num_qo_heads: int, num_kv_heads: int) -> dict:
    """``TritonCascade`` options the engine uses on an fp8 (e4m3) cache, measured on the H100."""
    if num_qo_heads < 4 * num_kv_heads:
        # With two query heads per KV head (Qwen3-0.6B) 64-key tiles, five stages: faster on
        # every shape measured (256 x 2304: 0.532 against 0.546 ms a layer; 256 x 512: 0.150 /
        # 0.169; cascade 0.185 / 0.198; decode_kernels_qwen3-0.6b_{fp8,bf16}_knobs_h100.json).
        # Cascade steps' own level capped at 128 registers (two live rows per item; more CTAs per
        # SM): 256 in 16 groups sharing 2048 + 257 own tokens 0.163 -> 0.147 ms a layer (bf16
        # pages 0.155), 64 groups sharing 512 0.141 -> 0.124. Plain steps in two warps (their items
        # are whole rows of two query heads): 256 x 2305 0.531 -> 0.447
        # (decode_kernels_qwen3-0.6b_s22_h100.json).
        return dict(cascade_own_maxnreg=128, plain_num_warps=2)
    # Four or more: 128-key tiles (8B, 256 x 2304 keys: 0.48 against 0.54 ms a layer with 64; 16
    # groups of 16 sharing 2048: 0.185 against 0.184; decode_kernels_fp8_knobs_*.json). Cascade
    # steps (short own items, a shared level that widens every tile) in two stages: 8B, 16 groups
    # of 16 sharing 2048 + 257 own tokens: 0.174 against 0.184 with five; plain steps keep five
    # (256 x 2305: 0.496 against 0.505 with two; decode_fp8_asm_stages_h100.json). Their own level
    # capped at 128 registers a thread runs four CTAs per SM instead of two (24 registers spill):
    # 0.157 against 0.174; the shared level capped loses (0.087 against 0.073), and so do plain
    # steps (decode_fp8_maxnreg_h100.json).
    return dict(block_n=128, cascade_num_stages=2, cascade_own_maxnreg=128)


class _Level:
    """One launch of the kernel: its work list and page list (fixed buffers under graphs)."""

    def __init__(self, device: torch.device, launch: dict, graph_programs: int):
        self.device, self.launch, self.graph_programs = device, launch, graph_programs
        self._indices: torch.Tensor | None = None

    def set_work(
        self, work: torch.Tensor, n_work: torch.Tensor, items: int, indices: torch.Tensor, graph: bool
    ) -> None:
        """This step's work list (a view of the uploaded header), its live count on the device
        and host, and its page list (host or device: copied into the fixed buffer under graphs)."""
        self.work, self.n_work = work, n_work
        if not graph:
            self.programs, self.indices = items, indices.to(self.device, non_blocking=True)
            return
        if len(indices) > len(self._indices):
            raise ValueError(f"{len(indices)} pages; the graph holds {len(self._indices)}")
        self._indices[: len(indices)].copy_(indices, non_blocking=True)
        self.programs = min(self.graph_programs, len(work))
        self.indices = self._indices


def small_work(
    sizes: list[int],
    group_tokens: list[int],
    lens: list[int],
    shared: list[int],
    page_size: int,
    segment: int,
    members: int,
    page_lens: list[int] | None = None,
) -> tuple[list[int], int, list[int]]:
    """``shared_work`` then ``own_work`` for a few rows, in Python, flattened, with the number of
    shared items and each row's segment count: the same lists without numpy's microseconds a
    call (planning a step of one request made ~100 of them: ~0.6 ms of the H100 host's time a
    step under cProfile, ~0.2 ms this way)."""
    from minisgl.device.kernels.partial_attention import FINAL, RESUME

    flat: list[int] = []
    first_row = entry = 0
    for size, tokens in zip(sizes, group_tokens):
        for run in range(0, size, members):
            for seg in range(-(-tokens // segment)):
                start = seg * segment
                flat += (first_row + run, min(members, size - run), entry + start // page_size)
                flat += (min(segment, tokens - start), seg, 0)
        first_row += size
        entry += tokens // page_size
    n_shared = len(flat) // 6
    counts: list[int] = []
    entry = 0
    for row, (length, before) in enumerate(zip(lens, shared)):
        segments = -(-length // segment)
        counts.append(segments)
        final = FINAL if segments == 1 else 0
        for seg in range(before // segment, segments):
            seg_start = seg * segment
            start = max(seg_start, before)
            flags = (RESUME if start > seg_start else 0) | final
            flat += (
                row,
                1,
                entry + (start - before) // page_size,
                min(seg_start + segment, length) - start,
                seg,
                flags,
            )
        entry += -(-(length if page_lens is None else page_lens[row]) // page_size) - before // page_size
    return flat, n_shared, counts


def default_shared_rows(num_kv_heads: int, gqa: int) -> int:
    """Query rows of a shared item: eight members per item, in 16 to 32 rows (a power of two).

    Qwen3-0.6B's pairs of heads (GQA 2) in 16 rows took 0.062 ms a layer against 32 rows' 0.076
    (fp8 pages; bf16 0.053 / 0.066), the 8B's fours in 32 rows 0.076 against 16 rows' 0.103
    (decode_kernels_*_h100.json). Four members on a rank with fewer than 8 KV heads (tensor
    parallelism): each shared item walks its group's keys alone, so the level lasts one item's
    walk once too few items fill the SMs; the 8B's 4 heads a rank at tp=2, 256 in 16 groups
    sharing 2048, fp8 pages: 0.120 -> 0.102 ms a layer, bf16 0.118 -> 0.108
    (tp2_h200_2026-11-27.md)."""
    members = 8 if num_kv_heads >= 8 else 4
    return min(32, max(16, 1 << (members * gqa - 1).bit_length()))


def target_items(items_per_sm: int, sms: int, num_kv_heads: int) -> int:
    """Work items a level is cut into: about ``items_per_sm`` per SM, counting each item once per
    KV head of the whole model. Under tensor parallelism every rank cuts keys where one GPU
    would, so each head's output keeps its bits at any tp size, and a rank's half of the heads
    runs items as long as one GPU's (at tp=2 twice the items over half the heads read KV at
    2.6 TB/s against 3.1; benchmarks/tp_check.py step)."""
    return max(1, items_per_sm * sms // (num_kv_heads * get_tp_info().size))


class TritonCascade:
    """Plans and runs decode steps (plain or cascade) on our kernel for a backend whose caches are
    [pages, page_size, Hk, D]. A shared item packs ``shared_rows`` query rows (whole members),
    reading each page once for all; an own item is one request's query heads."""

    def __init__(
        self,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device,
        block_n: int = 64,
        num_warps: int = 4,
        num_stages: int = 5,
        items_per_sm: int = 8,
        programs_per_sm: int = 8,
        min_segment_tokens: int = MIN_SEGMENT_TOKENS,
        shared_rows: int | None = None,
        own_num_warps: int | None = None,
        own_num_stages: int | None = None,
        cascade_num_stages: int | None = None,
        cascade_own_maxnreg: int | None = None,
        plain_num_warps: int | None = None,
    ):
        """Launch defaults from benchmarks/decode_bench.py part 3 on the H100 (gpu_2026-11-22.md): from
        5 stages Triton double-buffers the K/V tiles behind the page-index load (with 3 or 4 every
        tile waited for its loads); 64-key tiles keep two buffers in 72 KB."""
        self.heads = (num_qo_heads, num_kv_heads, head_dim)
        self.device = device
        gqa = num_qo_heads // num_kv_heads
        own_m = max(16, 1 << (gqa - 1).bit_length())  # one request's query heads, at least an mma.sync tile
        shared_m = max(shared_rows or default_shared_rows(num_kv_heads, gqa), own_m)
        self.members_per_item = shared_m // gqa
        self.block_n = block_n
        launch = dict(block_n=block_n, num_warps=num_warps, num_stages=num_stages)
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
        self.target_items = target_items(items_per_sm, sms, num_kv_heads)
        self.min_segment_tokens = min_segment_tokens
        programs = max(1, programs_per_sm * sms // num_kv_heads)
        # The own level may launch otherwise (its items are short runs of one request's keys); the
        # tiles stay the same, so a row's arithmetic does too. So may both levels of cascade steps
        # (``cascade_num_stages``, and ``cascade_own_maxnreg`` registers per thread for the own
        # level) and plain steps (``plain_num_warps``): plain and cascade steps replay graphs of
        # their own.
        own_launch = dict(
            launch, block_m=own_m, num_warps=own_num_warps or num_warps, num_stages=own_num_stages or num_stages
        )
        cascade_stages = dict(num_stages=cascade_num_stages) if cascade_num_stages else {}
        self.shared = _Level(device, dict(launch, block_m=shared_m, **cascade_stages), programs)
        self.own = _Level(device, own_launch, programs)
        cascade_own = dict(own_launch, **cascade_stages)
        if cascade_own_maxnreg:
            cascade_own["maxnreg"] = cascade_own_maxnreg
        plain = dict(own_launch, num_warps=plain_num_warps) if plain_num_warps else own_launch
        self.own_launches = {False: plain, True: cascade_own}  # by cascade step

    def unit(self, page_size: int) -> int:
        """Tokens that segment and shared-part boundaries are multiples of: whole pages and tiles."""
        return math.lcm(self.block_n, page_size)

    def shared_pages(self, pages: int, page_size: int) -> int:
        """The leading pages of a group's ``pages`` shared ones that its shared level reads: whole
        tiles' worth (the rest stays with each member's own items)."""
        unit_pages = self.unit(page_size) // page_size
        return pages // unit_pages * unit_pages

    def growing_shared_pages(self, pages: list[int], sizes: list[int], lens: np.ndarray, page_size: int) -> list[int]:
        """``pages`` (each group's, from ``shared_pages``) cut so that every member of ``lens``
        tokens keeps a key past them: a request that may grow on the device (``gain``) needs an
        item of its own to lengthen, and a member read whole at the shared level has none."""
        firsts = np.cumsum([0] + sizes[:-1])
        shortest = np.minimum.reduceat(np.asarray(lens[: sum(sizes)], dtype=np.int64), firsts) if sizes else []
        return [self.shared_pages(min(p, (int(n) - 1) // page_size), page_size) for p, n in zip(pages, shortest)]

    def max_states(self, batch_size: int) -> int:
        """At most states (and items per level) a step of ``batch_size`` requests needs: every
        request has at most one segment more than its share of ``target_items``, and the
        rounding in ``segment_tokens`` adds at most half a segment per request."""
        return 2 * batch_size + self.target_items

    def init_cuda_graph(self, max_bs: int, max_pages_per_req: int) -> None:
        hq, _, dim = self.heads
        states = self.max_states(max_bs)
        self._header = torch.zeros(header_size(max_bs, states), dtype=torch.int32, device=self.device)
        self.shared._indices = torch.zeros(
            graph_groups(max_bs) * max_pages_per_req, dtype=torch.int32, device=self.device
        )
        self.own._indices = torch.zeros(max_bs * max_pages_per_req, dtype=torch.int32, device=self.device)
        self._acc = torch.zeros(states, hq, dim, dtype=torch.float32, device=self.device)
        self._m = torch.zeros(states, hq, dtype=torch.float32, device=self.device)
        self._l = torch.zeros(states, hq, dtype=torch.float32, device=self.device)

    def plan(
        self,
        sizes: list[int],
        pages: list[int],
        page_size: int,
        shared_indices: torch.Tensor,
        own_tokens: list[int] | np.ndarray,
        own_indices: torch.Tensor,
        graph_batch_size: int | None,
        extra: np.ndarray | None = None,
    ) -> None:
        """``sizes`` and ``pages``: the groups (their rows first, in order) and the shared pages
        each reads, as ``shared_pages`` gives them; ``shared_indices``: those pages in group order.
        ``own_tokens``: per request of the batch (graph padding included) its tokens past the
        shared part, on its pages ``own_indices`` (concatenated). Page lists int32, on the host or
        the device. The work lists and per-row counts go up in one copy (a header). ``extra``:
        tokens each request may gain on the device (``gain``); its pages cover them."""
        hq, _, dim = self.heads
        graph = graph_batch_size is not None
        rows = len(own_tokens)
        unit = self.unit(page_size)
        if rows <= base.FEW_ROWS:  # (work lists in Python: ``small_work``)
            group_tokens = [p * page_size for p in pages]
            shared = [t for t, n in zip(group_tokens, sizes) for _ in range(n)]
            shared += [0] * (rows - len(shared))
            lens = [int(o) + s for o, s in zip(own_tokens, shared)]
            # Segments from the batch's real requests: graph padding rows hold one token, a
            # decoding request at least two; so a step splits alike padded or not.
            segment = segment_tokens(
                [n for n in lens if n > 1] or lens, unit, self.target_items, self.min_segment_tokens
            )
            page_lens = None if extra is None else [n + int(e) for n, e in zip(lens, extra)]
            flat, n_shared, counts = small_work(
                sizes, group_tokens, lens, shared, page_size, segment, self.members_per_item, page_lens
            )
            shared_items, own_items = np.asarray(flat[: 6 * n_shared]), np.asarray(flat[6 * n_shared :])
            counts = np.asarray(counts, dtype=np.int64)
        else:
            group_tokens = np.asarray(pages, dtype=np.int64) * page_size
            shared = np.zeros(rows, dtype=np.int64)
            shared[: sum(sizes)] = np.repeat(group_tokens, sizes)
            lens = np.asarray(own_tokens, dtype=np.int64) + shared
            real = lens[lens > 1] if (lens > 1).any() else lens
            segment = segment_tokens(real, unit, self.target_items, self.min_segment_tokens)
            shared_items = shared_work(sizes, group_tokens, page_size, segment, self.members_per_item).ravel()
            own_items, counts = own_work(lens, shared, page_size, segment, None if extra is None else lens + extra)
            own_items = own_items.ravel()
        n_shared, n_own = len(shared_items) // 6, len(own_items) // 6
        total = int(counts.sum())
        # Under graphs the header is laid out for the captured size (its rows and the states a
        # step of that size may need), so capture and replay agree and a small step copies a
        # small header, not one laid out for --cuda-graph-max-bs.
        caps = (graph_batch_size, self.max_states(graph_batch_size)) if graph else (rows, max(n_shared, n_own))
        if graph and (rows > caps[0] or max(n_shared, n_own, total) > caps[1]):
            raise ValueError(f"{rows} rows, {max(n_shared, n_own)} items, {total} states; the graph holds {caps}")
        # [items of each level] [row bases] [fold counts] [own work] [shared work]: a plain step's
        # copy ends at its own work.
        folds_at, own_at, shared_at = 2 + caps[0], 2 + 2 * caps[0], 2 + 2 * caps[0] + 6 * caps[1]
        used = shared_at + len(shared_items) if n_shared else own_at + len(own_items)
        host = np.zeros(used, dtype=np.int32)
        host[:2] = n_shared, n_own
        host[2 : 2 + rows] = np.cumsum(counts) - counts
        host[folds_at : folds_at + rows] = np.where(counts > 1, counts, 0)  # one segment: its item writes the row
        host[own_at : own_at + len(own_items)] = own_items
        host[shared_at : shared_at + len(shared_items)] = shared_items
        if graph:
            header = self._header
            header[:used].copy_(torch.from_numpy(host), non_blocking=True)
        else:
            header = torch.from_numpy(host).to(self.device, non_blocking=True)
        for level, at, count, n, indices in (
            (self.shared, shared_at, header[0:1], n_shared, shared_indices),
            (self.own, own_at, header[1:2], n_own, own_indices),
        ):
            room = caps[1] if graph else n  # (under graphs the launch covers the whole buffer)
            level.set_work(header[at : at + 6 * room].view(-1, 6), count, n, indices, graph)
        self.own.launch = self.own_launches[bool(sizes)]
        self.row_base, self.counts = header[2 : 2 + rows], header[folds_at : folds_at + rows]
        if extra is not None:  # each request's last own item (items come in request order)
            self._last_items = np.cumsum(counts - np.asarray(shared, dtype=np.int64) // segment) - 1
        if graph:
            self.acc, self.m, self.l = self._acc, self._m, self._l
        else:
            self.acc = torch.empty(total, hq, dim, dtype=torch.float32, device=self.device)
            self.m = torch.empty(total, hq, dtype=torch.float32, device=self.device)
            self.l = torch.empty(total, hq, dtype=torch.float32, device=self.device)

    def gain(self, rows: np.ndarray, tokens: torch.Tensor) -> None:
        """Lengthen requests ``rows`` of the planned step (planned with ``extra``) by ``tokens``
        (on the device, each at most its ``extra``): their last items read that many keys more,
        on pages the plan already lists. Queued on the stream: the host never waits for them."""
        items = torch.from_numpy(self._last_items[rows]).to(self.device, non_blocking=True)
        self.own.work[:, 3].index_add_(0, items, tokens.to(torch.int32))  # (items are distinct)

    def _run(
        self,
        level: _Level,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
        scale: float,
        kv_scales: tuple[float, float],
    ) -> None:
        from minisgl.device.kernels.partial_attention import partial_attention

        if level.programs:
            partial_attention(
                q,
                k_cache,
                v_cache,
                out,
                level.indices,
                level.work,
                level.n_work,
                self.row_base,
                self.acc,
                self.m,
                self.l,
                level.programs,
                scale,
                kv_scales=kv_scales,
                **level.launch,
            )

    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        levels: tuple[str, ...] = ("shared", "own", "combine"),
        kv_scales: tuple[float, float] = (1.0, 1.0),
    ) -> torch.Tensor:
        """The planned step's attention output for q [B, Hq, D]; ``levels`` runs only some parts
        (benchmarks time them alone); ``kv_scales`` of an fp8 cache."""
        out = torch.empty_like(q)
        if "shared" in levels:
            self._run(self.shared, q, k_cache, v_cache, out, scale, kv_scales)
        if "own" in levels:
            self._run(self.own, q, k_cache, v_cache, out, scale, kv_scales)
        if "combine" in levels:
            from minisgl.device.kernels.partial_attention import combine

            rows = len(self.counts)
            combine(out[:rows], self.acc, self.m, self.l, self.row_base, self.counts, v_scale=kv_scales[1])
        return out
