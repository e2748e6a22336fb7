"""MHAKVCache: one tensor for the whole run, layer-first.

Layout ``[2, num_layers, num_pages, page_size, kv_heads, head_dim]``: each layer's K and V are
dense paged tensors. The page-first layout of the design (``[2, num_pages, num_layers, ...]``,
one page holding every layer's K and V, for moving whole pages) spreads a layer's pages a
megabyte apart on the 8B's 32 layers, and decode attention paid for it: 0.187 against 0.175 ms
per layer at 256 requests in 16 groups on the H100 (benchmarks/results/gpu_2026-11-22.md).
The hierarchical cache's host pool is page-first (``host_pool.py``); copies move
one block per page and layer.
"""

from __future__ import annotations

import torch

from minisgl.device.kvcache.kv_storage import BaseKVCache


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
            (2, num_layers, num_pages, page_size, num_kv_heads, head_dim), dtype=dtype, device=device
        )
        self.scales = [(1.0, 1.0)] * num_layers
        # Set for one step whose host-tier copies it must wait for: layer i's copies are done
        # when layer_events[i] is (see HostKVPool.transfer).
        self.layer_events: list[torch.cuda.Event] = []

    def wait_layer(self, layer_id: int) -> None:
        if self.layer_events:
            torch.cuda.current_stream().wait_event(self.layer_events[layer_id])

    @staticmethod
    def bytes_per_page(page_size: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * page_size * num_layers * num_kv_heads * head_dim * dtype.itemsize

    def k_cache(self, layer_id: int) -> torch.Tensor:
        return self.buffer[0, layer_id]

    def v_cache(self, layer_id: int) -> torch.Tensor:
        return self.buffer[1, layer_id]
