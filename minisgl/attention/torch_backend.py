"""Plain torch paged attention: one request at a time, written to be read. The numerical reference."""

from __future__ import annotations

import torch

from minisgl.attention.base import AttentionBackend
from minisgl.utils import cdiv


class TorchBackend(AttentionBackend):
    def forward(self, q: torch.Tensor, layer_id: int) -> torch.Tensor:
        meta = self.meta
        k_cache, v_cache = self.kv_cache.k_cache(layer_id), self.kv_cache.v_cache(layer_id)
        page_size = self.kv_cache.page_size
        group = self.num_qo_heads // self.num_kv_heads
        out = torch.empty_like(q)
        start = 0
        for slot, cached, new in zip(meta.slots, meta.cached_lens, meta.new_lens):
            total = cached + new
            pages = meta.page_table[slot, : cdiv(total, page_size)].long()
            # Gather this request's whole sequence (prefix + new tokens) from its pages.
            keys = k_cache[pages].flatten(0, 1)[:total].repeat_interleave(group, dim=1)
            values = v_cache[pages].flatten(0, 1)[:total].repeat_interleave(group, dim=1)
            query = q[start : start + new]
            scores = torch.einsum("qhd,khd->hqk", query.float(), keys.float()) * self.scale
            # New token j sits at position cached + j and sees keys 0..cached + j.
            q_pos = torch.arange(cached, total, device=q.device)[:, None]
            k_pos = torch.arange(total, device=q.device)[None, :]
            scores.masked_fill_(k_pos > q_pos, float("-inf"))
            probs = scores.softmax(dim=-1)
            out[start : start + new] = torch.einsum("hqk,khd->qhd", probs, values.float()).to(q.dtype)
            start += new
        return out
