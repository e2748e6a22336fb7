"""FlashInfer paged attention on CUDA.

One plan per step (prefill or decode wrapper), reused by every layer. Prefill attends to the
request's cached prefix plus its new tokens with a causal mask aligned to the sequence end;
decode batches (one new token each) use the decode wrapper on its tensor-core path. CUDA-graph
decode steps use one wrapper per captured batch size, all planning into shared fixed buffers.
"""

from __future__ import annotations

import torch

from minisgl.attention.base import AttentionBackend, AttentionMetadata
from minisgl.kvcache import BaseKVCache

WORKSPACE_BYTES = 256 * 1024 * 1024


class FlashInferBackend(AttentionBackend):
    supports_cuda_graph = True

    def __init__(self, kv_cache: BaseKVCache, num_qo_heads: int, num_kv_heads: int, head_dim: int):
        import flashinfer

        super().__init__(kv_cache, num_qo_heads, num_kv_heads, head_dim)
        self._graph_wrappers: dict[int, flashinfer.BatchDecodeWithPagedKVCacheWrapper] = {}
        device = kv_cache.k_cache(0).device
        self.dtype = kv_cache.k_cache(0).dtype
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=True
        )
        self.wrapper = self.prefill

    def init_cuda_graph(self, max_bs: int, max_pages_per_req: int) -> None:
        device = self.workspace.device
        self._g_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=device)
        self._g_indices = torch.zeros(max_bs * max_pages_per_req, dtype=torch.int32, device=device)
        self._g_last_page_len = torch.zeros(max_bs, dtype=torch.int32, device=device)

    def _graph_wrapper(self, size: int):
        import flashinfer

        if size not in self._graph_wrappers:
            self._graph_wrappers[size] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True,
                paged_kv_indptr_buffer=self._g_indptr[: size + 1], paged_kv_indices_buffer=self._g_indices,
                paged_kv_last_page_len_buffer=self._g_last_page_len[:size],
            )
        return self._graph_wrappers[size]

    def _page_indices(self, meta: AttentionMetadata, num_pages: list[int], total: int) -> torch.Tensor:
        """Flatten each request's used page-table prefix into one index list, without a host sync."""
        device = meta.page_table.device
        counts = torch.tensor(num_pages, dtype=torch.int64).to(device, non_blocking=True)
        req = torch.repeat_interleave(torch.arange(len(num_pages), device=device), counts, output_size=total)
        starts = torch.cumsum(counts, 0) - counts
        cols = torch.arange(total, device=device) - starts[req]
        return meta.page_table[meta.slots_t[req], cols]

    def prepare(self, meta: AttentionMetadata, graph_batch_size: int | None = None) -> None:
        super().prepare(meta)
        page_size = self.kv_cache.page_size
        seq_lens = meta.seq_lens
        num_pages = [(s + page_size - 1) // page_size for s in seq_lens]
        kv_indptr = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
        kv_indptr[1:] = torch.tensor(num_pages, dtype=torch.int32).cumsum(0)
        last_page_len = torch.tensor(
            [s - (n - 1) * page_size for s, n in zip(seq_lens, num_pages)], dtype=torch.int32
        )
        indices = self._page_indices(meta, num_pages, int(kv_indptr[-1]))
        common = dict(q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=self.scale)
        heads = (self.num_qo_heads, self.num_kv_heads, self.head_dim, page_size)
        if meta.is_decode:
            self.wrapper = self.decode if graph_batch_size is None else self._graph_wrapper(graph_batch_size)
            self.wrapper.plan(kv_indptr, indices, last_page_len, *heads, **common)
        else:
            self.wrapper = self.prefill
            qo_indptr = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
            qo_indptr[1:] = torch.tensor(meta.new_lens, dtype=torch.int32).cumsum(0)
            self.prefill.plan(qo_indptr, kv_indptr, indices, last_page_len, *heads, causal=True, **common)

    def forward(self, q: torch.Tensor, layer_id: int) -> torch.Tensor:
        cache = (self.kv_cache.k_cache(layer_id), self.kv_cache.v_cache(layer_id))
        return self.wrapper.run(q, cache)
