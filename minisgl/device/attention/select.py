"""Picks the attention backend for a device: the torch reference or FlashInfer."""

from __future__ import annotations

import torch

from minisgl.device.attention.base import AttentionBackend
from minisgl.device.attention.torch_backend import TorchBackend
from minisgl.device.kvcache.kv_storage import BaseKVCache


def create_backend(
    name: str,
    kv_cache: BaseKVCache,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    decode_backend: str = "triton",
    dtype: torch.dtype | None = None,
) -> AttentionBackend:
    """'auto' means FlashInfer for 16-bit models on CUDA and the torch reference otherwise.
    ``decode_backend`` picks the FlashInfer backend's plain decode kernel (the torch backend has one).
    ``dtype``: the model's (queries'), when the cache holds another (fp8); default the cache's."""
    view = kv_cache.k_cache(0)
    dtype = dtype or view.dtype
    if name == "auto":
        half = dtype in (torch.float16, torch.bfloat16)
        name = "flashinfer" if view.device.type == "cuda" and half else "torch"
    if name == "torch":
        return TorchBackend(kv_cache, num_qo_heads, num_kv_heads, head_dim)
    if name == "flashinfer":
        from minisgl.device.attention.flashinfer_backend import FlashInferBackend

        return FlashInferBackend(
            kv_cache, num_qo_heads, num_kv_heads, head_dim, decode_backend=decode_backend, dtype=dtype
        )
    raise ValueError(f"unknown attention backend {name!r} (auto, torch, flashinfer)")
