"""FlashInfer paged attention on CUDA.

One plan per step (prefill or decode wrapper), reused by every layer. Prefill attends to the
request's cached prefix plus its new tokens with a causal mask aligned to the sequence end;
decode batches (one new token each) use the decode wrapper on its tensor-core path. CUDA-graph
decode steps use one wrapper per captured batch size, all planning into shared fixed buffers.

Cascade decode steps (groups of requests sharing a cached prefix, see ``ForwardBatch``) run two
levels. Shared: the paged prefill kernel, non-causal, with each group as one request whose
queries are its members' (GQA heads packed), reads each shared page once. Own: the decode
wrapper over each request's pages past its group's prefix. Both return their log-sum-exp and
``merge_state_in_place`` folds the shared result into the own one. The shared level (compute-
bound) runs on a high-priority side stream while the own level (memory-bound) runs on the main
one: 0.188 against 0.200 ms per layer one after the other (benchmarks/decode_bench.py part 3,
H100, 256 requests in 16 groups). It has a workspace of its own. Under CUDA graphs the shared
level has a fixed number of group slots (empty ones have no queries), a last slot that takes the
rows outside groups (against one page; the merge's row mask discards them), and the merge a row
mask. FlashInfer sizes a graph's query tile from its rows and slots: the slot count is chosen
so that the tile is ``SHARED_TILE`` rows.
"""

from __future__ import annotations

import numpy as np
import torch

from minisgl.attention.base import AttentionBackend, AttentionMetadata, graph_groups
from minisgl.kvcache import BaseKVCache
from minisgl.utils import cdiv

# Split-KV scratch of the prefill and decode (own level) wrappers.
WORKSPACE_BYTES = 256 * 1024 * 1024
# The shared level's, allocated at its first cascade step: a graph's shared level plans for its
# worst case (e.g. 268 MB at batch 256, 32 query heads, tile 64).
SHARED_WORKSPACE_BYTES = 512 * 1024 * 1024
# The shared level: our Triton kernel ("triton", 0.173 against FlashInfer fa2's 0.188 ms per
# layer at 256 requests in 16 groups on 2048 tokens) or FlashInfer's paged prefill ("fa2",
# "fa3"); benchmarks/decode_bench.py part 3 on the H100.
SHARED_LEVEL_BACKEND = "triton"
SHARED_TILE = 64  # rows of packed queries per tile of the shared level (64 or 128)


class FlashInferBackend(AttentionBackend):
    supports_cuda_graph = True

    def __init__(
        self, kv_cache: BaseKVCache, num_qo_heads: int, num_kv_heads: int, head_dim: int,
        shared_backend: str = SHARED_LEVEL_BACKEND, shared_tile: int = SHARED_TILE, own_tensor_cores: bool = True,
        overlap_levels: bool = True, triton_options: dict | None = None,
    ):
        import flashinfer

        super().__init__(kv_cache, num_qo_heads, num_kv_heads, head_dim)
        self._graph_wrappers: dict[int, flashinfer.BatchDecodeWithPagedKVCacheWrapper] = {}
        self._graph_shared: dict[int, flashinfer.BatchPrefillWithPagedKVCacheWrapper] = {}
        device = kv_cache.k_cache(0).device
        self.dtype = kv_cache.k_cache(0).dtype
        self.shared_backend = shared_backend
        self.shared_tile = shared_tile
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=own_tensor_cores
        )
        # The shared level runs on this stream (None: the main one); its wrapper is made at need.
        self.level_stream = torch.cuda.Stream(device, priority=-1) if overlap_levels else None
        self._shared_workspace: torch.Tensor | None = None
        self._shared_eager = None
        self.triton_shared = None
        if shared_backend == "triton":
            from minisgl.attention.cascade_triton import TritonSharedLevel

            self.triton_shared = TritonSharedLevel(num_qo_heads, num_kv_heads, head_dim, device, **(triton_options or {}))
        self.wrapper = self.prefill
        self.shared_level = None  # the wrapper running this step's shared level; None: single level
        self.shared_rows = 0  # queries in groups this step (they come first)
        self.graph_size: int | None = None

    def init_cuda_graph(self, max_bs: int, max_pages_per_req: int) -> None:
        device = self.workspace.device
        self._g_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=device)
        self._g_indices = torch.zeros(max_bs * max_pages_per_req, dtype=torch.int32, device=device)
        self._g_last_page_len = torch.zeros(max_bs, dtype=torch.int32, device=device)
        slots = max(self._shared_slots(s) for s in range(1, max_bs + 1))
        self._s_qo_indptr = torch.zeros(slots + 1, dtype=torch.int32, device=device)
        self._s_kv_indptr = torch.zeros(slots + 1, dtype=torch.int32, device=device)
        self._s_last_page_len = torch.zeros(slots, dtype=torch.int32, device=device)
        self._s_indices = torch.zeros(graph_groups(max_bs) * max_pages_per_req + 1, dtype=torch.int32, device=device)
        self._s_mask = torch.zeros(max_bs, dtype=torch.bool, device=device)
        self._s_out = torch.zeros(max_bs, self.num_qo_heads, self.head_dim, dtype=self.dtype, device=device)
        self._s_lse = torch.zeros(max_bs, self.num_qo_heads, dtype=torch.float32, device=device)
        if self.triton_shared is not None:
            self.triton_shared.init_cuda_graph(max_bs, max_pages_per_req)

    def shared_workspace(self) -> torch.Tensor:
        """The shared level's scratch, allocated at the first cascade step."""
        if self._shared_workspace is None:
            self._shared_workspace = torch.empty(SHARED_WORKSPACE_BYTES, dtype=torch.uint8, device=self.workspace.device)
        return self._shared_workspace

    def _graph_wrapper(self, size: int):
        import flashinfer

        if size not in self._graph_wrappers:
            self._graph_wrappers[size] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True,
                paged_kv_indptr_buffer=self._g_indptr[: size + 1], paged_kv_indices_buffer=self._g_indices,
                paged_kv_last_page_len_buffer=self._g_last_page_len[:size],
            )
        return self._graph_wrappers[size]

    def _shared_slots(self, size: int) -> int:
        """Request slots of the shared level in the graph of ``size`` rows: room for every group
        plus the catch-all, and enough that FlashInfer's graph tile, sized for the longest
        query run the slots allow ((size - slots + 1) rows), is ``shared_tile`` packed rows."""
        gqa = self.num_qo_heads // self.num_kv_heads
        groups = graph_groups(size)
        if self.shared_tile <= 64:
            groups = max(groups, size - max(64 // gqa, 1))
        return groups + 1

    def _eager_shared_wrapper(self):
        import flashinfer

        if self._shared_eager is None:
            self._shared_eager = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                self.shared_workspace(), "NHD", backend=self.shared_backend)
        return self._shared_eager

    def _graph_shared_wrapper(self, size: int):
        import flashinfer

        if size not in self._graph_shared:
            slots = self._shared_slots(size)
            self._graph_shared[size] = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                self.shared_workspace(), "NHD", use_cuda_graph=True, backend=self.shared_backend,
                qo_indptr_buf=self._s_qo_indptr[: slots + 1], paged_kv_indptr_buf=self._s_kv_indptr[: slots + 1],
                paged_kv_indices_buf=self._s_indices, paged_kv_last_page_len_buf=self._s_last_page_len[:slots],
            )
        return self._graph_shared[size]

    @staticmethod
    def _page_indices(
        page_table: torch.Tensor, rows: torch.Tensor, first: list[int], counts: list[int], total: int
    ) -> torch.Tensor:
        """Concatenate ``page_table[rows[i], first[i] : first[i] + counts[i]]`` over i, without a
        host sync."""
        device = page_table.device
        counts_t, first_t = torch.tensor([counts, first], dtype=torch.int64).to(device, non_blocking=True)
        req = torch.repeat_interleave(torch.arange(len(counts), device=device), counts_t, output_size=total)
        starts = torch.cumsum(counts_t, 0) - counts_t
        cols = torch.arange(total, device=device) - starts[req] + first_t[req]
        return page_table[rows[req], cols]

    def prepare(self, meta: AttentionMetadata, graph_batch_size: int | None = None) -> None:
        super().prepare(meta)
        page_size = self.kv_cache.page_size
        seq_lens = meta.seq_lens
        skip = meta.skip_pages() if meta.cascade else [0] * meta.num_reqs
        num_pages = [cdiv(s, page_size) - k for s, k in zip(seq_lens, skip)]
        kv_indptr = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
        kv_indptr[1:] = torch.tensor(num_pages, dtype=torch.int32).cumsum(0)
        last_page_len = torch.tensor([s - (cdiv(s, page_size) - 1) * page_size for s in seq_lens], dtype=torch.int32)
        indices = self._page_indices(meta.page_table, meta.slots_t, skip, num_pages, int(kv_indptr[-1]))
        common = dict(q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=self.scale)
        heads = (self.num_qo_heads, self.num_kv_heads, self.head_dim, page_size)
        self.graph_size = graph_batch_size
        self.shared_level = None
        if meta.is_decode:
            self.wrapper = self.decode if graph_batch_size is None else self._graph_wrapper(graph_batch_size)
            self.wrapper.plan(kv_indptr, indices, last_page_len, *heads, **common)
            if meta.cascade:
                self._plan_shared(meta, graph_batch_size, heads, common)
        else:
            self.wrapper = self.prefill
            qo_indptr = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
            qo_indptr[1:] = torch.tensor(meta.new_lens, dtype=torch.int32).cumsum(0)
            self.prefill.plan(qo_indptr, kv_indptr, indices, last_page_len, *heads, causal=True, **common)

    def _plan_shared(self, meta: AttentionMetadata, graph_batch_size: int | None, heads: tuple, common: dict) -> None:
        """Plan the shared level: group g's queries against its first ``group_pages[g]`` pages."""
        sizes, pages = list(meta.group_sizes), list(meta.group_pages)
        page_size = heads[3]
        last_page_len = [page_size] * len(pages)
        leaders = list(np.cumsum([0] + sizes[:-1]))
        self.shared_rows = sum(sizes)
        device = meta.page_table.device
        if self.triton_shared is not None:
            rows = meta.slots_t[torch.tensor(leaders, dtype=torch.int64).to(device, non_blocking=True)]
            indices = self._page_indices(meta.page_table, rows, [0] * len(pages), pages, sum(pages))
            self.triton_shared.plan(sizes, pages, page_size, indices, graph_batch_size)
            self.shared_level = self.triton_shared
            return
        if graph_batch_size is None:
            self.shared_level = self._eager_shared_wrapper()
        else:
            free = self._shared_slots(graph_batch_size) - 1 - len(sizes)
            if free < 0:
                raise ValueError(f"{len(sizes)} cascade groups; the graph of {graph_batch_size} holds {free + len(sizes)}")
            # Empty slots, then the catch-all: the other rows against one page of the first request.
            sizes += [0] * free + [graph_batch_size - self.shared_rows]
            pages += [0] * free + [1]
            last_page_len += [0] * free + [1]
            leaders.append(0)
            self.shared_level = self._graph_shared_wrapper(graph_batch_size)
            mask = torch.arange(graph_batch_size) < self.shared_rows
            self._s_mask[:graph_batch_size].copy_(mask, non_blocking=True)
        real = [p for p in pages if p]
        rows = meta.slots_t[torch.tensor(leaders, dtype=torch.int64).to(device, non_blocking=True)]
        indices = self._page_indices(meta.page_table, rows, [0] * len(real), real, sum(real))
        qo_indptr = torch.tensor([0, *np.cumsum(sizes)], dtype=torch.int32)
        kv_indptr = torch.tensor([0, *np.cumsum(pages)], dtype=torch.int32)
        self.shared_level.plan(qo_indptr, kv_indptr, indices, torch.tensor(last_page_len, dtype=torch.int32),
                               *heads, causal=False, **common)

    def forward(self, q: torch.Tensor, layer_id: int) -> torch.Tensor:
        cache = (self.kv_cache.k_cache(layer_id), self.kv_cache.v_cache(layer_id))
        if self.shared_level is None:
            return self.wrapper.run(q, cache)
        from flashinfer import merge_state_in_place

        main = torch.cuda.current_stream()
        side = self.level_stream or main
        side.wait_stream(main)
        if self.shared_level is self.triton_shared:
            with torch.cuda.stream(side):
                self.triton_shared.run(q, *cache, self.scale)
            out, lse = self.wrapper.run(q, cache, return_lse=True)
            main.wait_stream(side)
            self.triton_shared.combine(out, lse)
            return out
        if self.graph_size is None:
            rows = self.shared_rows
            shared = torch.empty_like(q[:rows])
            shared_lse = torch.empty(rows, q.shape[1], dtype=torch.float32, device=q.device)
            mask, own_rows = None, slice(0, rows)
        else:
            rows = self.graph_size
            shared, shared_lse = self._s_out[:rows], self._s_lse[:rows]
            mask, own_rows = self._s_mask[:rows], slice(None)
        with torch.cuda.stream(side):
            self.shared_level.run(q[:rows], cache, out=shared, lse=shared_lse, return_lse=True)
        out, lse = self.wrapper.run(q, cache, return_lse=True)
        main.wait_stream(side)
        merge_state_in_place(out[own_rows], lse[own_rows], shared, shared_lse, mask=mask)
        return out
