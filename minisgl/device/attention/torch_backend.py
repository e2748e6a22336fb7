"""Plain torch paged attention, written to be read: the numerical reference and the CPU path.
Prefill goes one request at a time; decode steps go at once, padded, through SDPA.

Cascade decode steps run the same math in two levels: each group's queries attend to the
group's shared pages once, each request attends to its own remaining pages, and the two
partial results merge by their log-sum-exp. Tests compare it with the single-level path.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.nn.functional as F

from minisgl.device import batch_invariant
from minisgl.device.attention.base import AttentionBackend, AttentionMetadata
from minisgl.device.kernels.rope_store import from_cache, rope_rows, rope_store_torch
from minisgl.utils import cdiv, into


def merge_partials(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over keys A and B together, from attention over each ([q, h, d], lse [q, h])."""
    lse = torch.logaddexp(lse_a, lse_b)
    out = out_a * (lse_a - lse).exp()[..., None] + out_b * (lse_b - lse).exp()[..., None]
    return out, lse


class TorchBackend(AttentionBackend):
    def plan(self, meta: AttentionMetadata, graph_batch_size: int | None = None) -> None:
        """Also work out once what every layer of the step shares: a decode step's pages and
        padding mask, and the rotary rows of its positions (per layer, they were a tenth of a
        CPU decode step of SmolLM2)."""
        if meta.gains is not None:  # the reference reads its rows' gains back (the host waits)
            cached = list(meta.cached_lens)
            for row, tokens in zip(meta.gains.rows.tolist(), meta.gains.tokens.tolist()):
                cached[row] += tokens
            meta = dataclasses.replace(meta, cached_lens=cached, gains=None)
        super().plan(meta, graph_batch_size)
        self._rows: tuple[torch.Tensor, torch.Tensor] | None = None
        # The batch's page-table rows, in request order (a copy: the runner edits its table).
        cols = cdiv(int(meta.seq_lens.max(initial=0)), self.kv_cache.page_size)
        rows = meta.page_table_host[np.asarray(meta.slots, dtype=np.int64), :cols]
        self._pages = torch.from_numpy(rows).to(self.kv_cache.buffer.device).long()
        self._decode = self._plan_decode(meta) if meta.is_decode and not meta.cascade else None

    def plans_gains(self, cascade: bool) -> bool:
        return True

    def _plan_decode(self, meta: AttentionMetadata) -> tuple[torch.Tensor, int, torch.Tensor | None]:
        """Each request's pages [B, P], the longest length, and the mask [B, 1, 1, L] that hides
        the shorter ones' padding (None when there is none)."""
        lens = meta.seq_lens
        longest = max(lens)
        pages = self._pages[:, : cdiv(longest, self.kv_cache.page_size)]
        if min(lens) == longest:
            return pages, longest, None
        device = pages.device
        seen = torch.arange(longest, device=device)[None, :] < torch.tensor(lens, device=device)[:, None]
        return pages, longest, seen[:, None, None, :]

    def rope_store(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        layer_id: int,
        cos_sin: torch.Tensor,
        norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if qkv.is_cuda:  # the CUDA kernel, as on the other backends
            return super().rope_store(qkv, positions, layer_id, cos_sin, norm, out)
        if self._rows is None:
            self._rows = rope_rows(cos_sin, positions, qkv.dtype)
        return into(
            rope_store_torch(
                qkv,
                self.num_qo_heads,
                positions,
                cos_sin,
                self.kv_cache.k_cache(layer_id),
                self.kv_cache.v_cache(layer_id),
                self.out_loc,
                norm,
                self._rows,
                self.kv_cache.scales[layer_id],
            ),
            out,
        )

    def _gather(self, layer_id: int, req: int, first_page: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of tokens [first_page * page_size, end) of the batch's request ``req``, GQA-expanded."""
        page_size = self.kv_cache.page_size
        group = self.num_qo_heads // self.num_kv_heads
        pages = self._pages[req, first_page : cdiv(end, page_size)]
        count = end - first_page * page_size
        k_scale, v_scale = self.kv_cache.scales[layer_id]
        keys = self.kv_cache.k_cache(layer_id)[pages].flatten(0, 1)[:count].repeat_interleave(group, dim=1)
        values = self.kv_cache.v_cache(layer_id)[pages].flatten(0, 1)[:count].repeat_interleave(group, dim=1)
        return from_cache(keys, k_scale), from_cache(values, v_scale)

    def _attend(
        self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Softmax attention of query [q, h, d] over keys/values [k, h, d]; mask [q, k] is True
        where a key is hidden. Returns (out [q, h, d] float32, lse [q, h])."""
        scores = torch.einsum("qhd,khd->hqk", query.float(), keys) * self.scale
        if mask is not None:
            scores.masked_fill_(mask, float("-inf"))
        lse = scores.logsumexp(dim=-1)
        out = torch.einsum("hqk,khd->qhd", (scores - lse[..., None]).exp(), values)
        return out, lse.transpose(0, 1)

    def attend(self, q: torch.Tensor, layer_id: int, out: torch.Tensor | None = None) -> torch.Tensor:
        if batch_invariant.enabled():
            return self._forward_each(q, layer_id, out, per_query=True)
        if self._decode is not None:
            return into(self._forward_decode(q, layer_id), out)
        if self.meta.cascade:
            return into(self._forward_cascade(q, layer_id), out)
        return self._forward_each(q, layer_id, out)

    def _forward_each(
        self, q: torch.Tensor, layer_id: int, out: torch.Tensor | None = None, per_query: bool = False
    ) -> torch.Tensor:
        """One request at a time, causal within its new tokens. ``per_query`` (batch-invariant
        mode): one query at a time over exactly the keys it sees, so its bits depend on nothing
        but those keys: not on the batch, the chunk it came in, or whether its prefix was cached
        or decoded."""
        meta = self.meta
        out = torch.empty_like(q) if out is None else out
        start = 0
        for i, (cached, new) in enumerate(zip(meta.cached_lens, meta.new_lens)):
            total = cached + new
            keys, values = self._gather(layer_id, i, 0, total)
            # New token j sits at position cached + j and sees keys 0..cached + j.
            if per_query:
                for j in range(new):
                    seen = cached + j + 1
                    got, _ = self._attend(q[start + j : start + j + 1], keys[:seen], values[:seen], None)
                    out[start + j] = got[0].to(q.dtype)
            else:
                q_pos = torch.arange(cached, total, device=q.device)[:, None]
                k_pos = torch.arange(total, device=q.device)[None, :]
                got, _ = self._attend(q[start : start + new], keys, values, k_pos > q_pos)
                out[start : start + new] = got.to(q.dtype)
            start += new
        return out

    def _forward_decode(self, q: torch.Tensor, layer_id: int) -> torch.Tensor:
        """A decode batch at once (a Python loop per request per layer took two thirds of a
        batch-8 CPU step): keys padded to the longest request, the padding masked. Batch 1 too:
        there the einsum path's softmax cost SmolLM2 8% of its CPU decode speed (14.2 vs 15.4
        tok/s, interleaved runs in one process)."""
        pages, longest, mask = self._decode
        k_scale, v_scale = self.kv_cache.scales[layer_id]
        keys = from_cache(self.kv_cache.k_cache(layer_id)[pages].flatten(1, 2)[:, :longest], k_scale)  # [B, L, kv, d]
        values = from_cache(self.kv_cache.v_cache(layer_id)[pages].flatten(1, 2)[:, :longest], v_scale)
        batch, heads, dim = q.shape
        # SDPA's fused CPU kernel (query head h reads kv head h // group, as GQA packs them): 2.3x
        # faster than two einsums and a softmax in SmolLM2's shape at batch 8, 200 keys (0.19 vs
        # 0.44 ms a layer), equal within 5e-7.
        out = F.scaled_dot_product_attention(
            q.float().view(batch, heads, 1, dim),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=mask,
            scale=self.scale,
            enable_gqa=True,
        )
        return out.view(batch, heads, dim).to(q.dtype)

    def _forward_cascade(self, q: torch.Tensor, layer_id: int) -> torch.Tensor:
        """Decode only (one query per request): every key a query sees precedes it, so no mask."""
        meta = self.meta
        skip = meta.skip_pages()
        own = [
            self._attend(q[i : i + 1], *self._gather(layer_id, i, skip[i], total), None)
            for i, total in enumerate(meta.seq_lens)
        ]
        out = torch.cat([o for o, _ in own])
        lse = torch.cat([s for _, s in own])
        start = 0
        for size, pages in zip(meta.group_sizes, meta.group_pages):
            rows = slice(start, start + size)
            keys, values = self._gather(layer_id, start, 0, pages * self.kv_cache.page_size)
            shared, shared_lse = self._attend(q[rows], keys, values, None)
            out[rows], lse[rows] = merge_partials(shared, shared_lse, out[rows], lse[rows])
            start += size
        return out.to(q.dtype)
