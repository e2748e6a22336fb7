"""MHAKVCache layout and the store_kv reference path."""

from __future__ import annotations

import pytest
import torch

from minisgl.device.kernels import store_kv_torch
from minisgl.device.kvcache.mha_pool import MHAKVCache


def make_cache(page_size: int, pages: int = 12, layers: int = 3, heads: int = 2, dim: int = 8) -> MHAKVCache:
    return MHAKVCache(pages, page_size, layers, heads, dim, torch.float32, torch.device("cpu"))


def test_layer_first_layout():
    cache = make_cache(page_size=4)
    assert cache.buffer.shape == (2, 3, 12, 4, 2, 8)
    k = cache.k_cache(1)
    assert k.shape == (12, 4, 2, 8)
    assert k.is_contiguous()  # a layer's pages are dense
    assert k.data_ptr() == cache.buffer[0, 1, 0].data_ptr()
    assert MHAKVCache.bytes_per_page(4, 3, 2, 8, torch.float32) == 2 * 4 * 3 * 2 * 8 * 4


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_store_kv_writes_each_slot(page_size, index_dtype):
    cache = make_cache(page_size)
    total = cache.num_pages * page_size
    slots = torch.randperm(total)[:10].to(index_dtype)
    # k/v as strided views of a fused projection, like the model produces.
    fused = torch.randn(10, 3, 2, 8)
    k, v = fused[:, 1], fused[:, 2]
    store_kv_torch(cache.k_cache(2), cache.v_cache(2), k, v, slots)
    for i, slot in enumerate(slots.tolist()):
        page, off = divmod(slot, page_size)
        assert torch.equal(cache.buffer[0, 2, page, off], k[i])
        assert torch.equal(cache.buffer[1, 2, page, off], v[i])
    written = torch.zeros(cache.num_pages, page_size, dtype=torch.bool)
    written.view(-1)[slots.long()] = True
    assert (cache.buffer[:, 2][:, ~written] == 0).all()  # no other slot of the layer touched
    assert (cache.buffer[:, [0, 1]] == 0).all()  # nor any other layer


def test_store_kv_torch_matches_manual_index():
    k_cache = torch.zeros(5, 2, 1, 4)
    v_cache = torch.zeros(5, 2, 1, 4)
    k, v = torch.ones(2, 1, 4), torch.full((2, 1, 4), 2.0)
    store_kv_torch(k_cache, v_cache, k, v, torch.tensor([3, 8]))
    assert k_cache[1, 1].sum() == 4 and k_cache[4, 0].sum() == 4 and v_cache[4, 0].sum() == 8
    assert k_cache.sum() == 8


def test_invalid_cache_shape():
    with pytest.raises(ValueError, match="page_size"):
        make_cache(page_size=0)
