"""store_kv: scatter the new tokens' K and V into their cache slots."""

from __future__ import annotations

import torch

from minisgl.kernels.jit import load_module


def store_kv_torch(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out_loc: torch.Tensor
) -> None:
    """Reference path: caches are [pages, page_size, H, D] views, out_loc holds slot ids."""
    page_size = k_cache.shape[1]
    loc = out_loc.long()
    pages, offsets = loc // page_size, loc % page_size
    k_cache[pages, offsets] = k
    v_cache[pages, offsets] = v


def store_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out_loc: torch.Tensor
) -> None:
    """CUDA tensors go through the JIT kernel (one token's row per warp); CPU uses torch indexing."""
    if k_cache.device.type != "cuda":
        store_kv_torch(k_cache, v_cache, k, v, out_loc)
        return
    load_module("store_kv").store_kv(
        k_cache, v_cache, k, v, out_loc, torch.cuda.current_stream().cuda_stream
    )
