"""Where K and V live: the storage interface the attention backends read and write."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class BaseKVCache(ABC):
    """Paged K/V storage. A token's slot id is ``page * page_size + offset_in_page``.

    An fp8 cache holds K / k_scale and V / v_scale; ``scales[layer]`` = (k_scale, v_scale), 1.0
    unless the checkpoint has them (and 1.0, unused, for a cache in the model dtype)."""

    num_pages: int
    page_size: int
    scales: list[tuple[float, float]]

    def wait_layer(self, layer_id: int) -> None:
        """Hold the current stream until copies into this layer's pages are done (none here)."""

    @abstractmethod
    def k_cache(self, layer_id: int) -> torch.Tensor:
        """Layer view of K: [num_pages, page_size, kv_heads, head_dim] (page stride may be large)."""

    @abstractmethod
    def v_cache(self, layer_id: int) -> torch.Tensor:
        """Layer view of V, same shape and strides as ``k_cache``."""
