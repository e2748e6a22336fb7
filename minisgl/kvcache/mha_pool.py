"""MHAKVCache: one tensor for the whole run in page-first layout.

Layout ``[2, num_pages, num_layers, page_size, kv_heads, head_dim]``: a page holds the K and V
of its tokens for every layer in two contiguous blocks, so moving a page (offload, transfer)
is two memcpys, while attention sees an ordinary paged layer view with a larger page stride.
"""

from __future__ import annotations

import torch

from minisgl.kvcache.base import BaseKVCache


class MHAKVCache(BaseKVCache):
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        if page_size < 1 or num_pages < 1:
            raise ValueError(f"need page_size >= 1 and num_pages >= 1, got {page_size}, {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_layers = num_layers
        self.buffer = torch.zeros(
            (2, num_pages, num_layers, page_size, num_kv_heads, head_dim), dtype=dtype, device=device
        )

    @staticmethod
    def bytes_per_page(page_size: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * page_size * num_layers * num_kv_heads * head_dim * dtype.itemsize

    def k_cache(self, layer_id: int) -> torch.Tensor:
        return self.buffer[0, :, layer_id]

    def v_cache(self, layer_id: int) -> torch.Tensor:
        return self.buffer[1, :, layer_id]
