"""FlashInfer paged attention on CUDA for prefill, our Triton kernel for decode.

One plan per step, reused by every layer. Prefill attends to the request's cached prefix plus
its new tokens with FlashInfer's paged prefill, a causal mask aligned to the sequence end. On an
fp8 cache FlashInfer's prefill reads fp8 pages only on its fa2 kernels (fa3 wants an fp8 query
too), twice as slow as fa3 on bf16 pages: chunks with enough new tokens per request instead widen
the distinct pages they read into a scratch in the model dtype (exact) and run the 16-bit kernels
(``WIDE_MIN_NEW_TOKENS``; benchmarks/fp8_prefill_bench.py).

Decode steps (one new token each) run on our kernel (``attention.cascade_triton``): cascade
steps (groups of requests sharing a cached prefix, see ``ForwardBatch``), whose shared level
reads each group's shared pages once for all its members and whose own level continues each
member's pass past them; and plain steps, the own level alone, so that a cascade step returns
exactly what the plain step would. With ``decode_backend="flashinfer"`` plain steps use
FlashInfer's decode wrapper on its tensor-core path instead (one wrapper per captured batch
size under CUDA graphs, all planning into shared fixed buffers).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

from minisgl.device.attention import base
from minisgl.device.attention.base import AttentionBackend, AttentionMetadata
from minisgl.device.kvcache.mha_pool import BaseKVCache
from minisgl.utils import into

# Split-KV scratch of the prefill and decode wrappers.
WORKSPACE_BYTES = 256 * 1024 * 1024
# fp8 prefill through widened pages, measured on the H100 (8B heads, ms per layer: fa2 on fp8 pages
# against widening + fa3): one 8192-token prompt 2.12 / 1.00, 8192 on 24k cached 13.65 / 6.73, 64
# requests x 128 new on 2048 shared 1.06 / 0.58; but 256 x 32 new on 2048: 1.13 / 2.14 (fa3's
# 128-row query tiles), and small chunks gain nothing (fp8_prefill_*_h100.json). Hence: at least
# this many new tokens per request and in all, and at most WIDE_MAX_BYTES of scratch (else the fp8
# pages as they are).
WIDE_MIN_NEW_TOKENS = 128
WIDE_MIN_CHUNK_TOKENS = 2048
WIDE_MAX_BYTES = 256 << 20


def plan_decode(
    wrapper,
    indptr: torch.Tensor,
    indices: torch.Tensor,
    last_page_len: torch.Tensor,
    kv_lens: np.ndarray,
    heads: tuple[int, int, int, int],
    **common,
) -> None:
    """``wrapper.plan`` for a tensor-core decode step, trimmed on the host for CUDA-graph wrappers.

    FlashInfer's plan re-derives each request's KV length from the page counts and takes their
    maximum by iterating a tensor in Python: at tp=2, batch 64, that was ~0.6 ms of a 5.8 ms step
    in which the host was busy ~85% of the time (py-spy, benchmarks/results/gpu_2026-11-22.md).
    We hold the lengths already. After a graph wrapper's first full plan (which picks and loads
    the kernel module), later steps fill its buffers and call the module's planner directly with
    the arguments FlashInfer 0.6's fa2 path passes; anything else takes the full plan."""
    hq, hk, head_dim, page_size = heads
    lens = torch.from_numpy(np.asarray(kv_lens, dtype=np.int32))
    if not (
        wrapper.is_cuda_graph_enabled
        and getattr(wrapper, "_backend", None) == "fa2"
        and getattr(wrapper, "_cached_module", None) is not None
        and _fast_plan_supported()
    ):
        wrapper.plan(indptr, indices, last_page_len, *heads, seq_lens=lens, **common)
        return
    batch = len(kv_lens)
    wrapper._paged_kv_indptr_buf.copy_(indptr, non_blocking=True)
    wrapper._paged_kv_last_page_len_buf.copy_(last_page_len, non_blocking=True)
    wrapper._paged_kv_indices_buf[: len(indices)].copy_(indices, non_blocking=True)
    wrapper._max_kv_len = int(np.max(kv_lens))
    # (after the lengths: batch twice, heads, page size, graph mode, qk/vo head dims, not causal,
    # no sliding window, fa2's defaults: no fixed split size, split-kv allowed, no colocated CTAs)
    wrapper._plan_info = wrapper._cached_module.plan(
        wrapper._float_workspace_buffer, wrapper._int_workspace_buffer, wrapper._pin_memory_int_workspace_buffer,
        torch.arange(batch + 1, dtype=torch.int32), indptr, lens,
        batch, batch, hq, hk, page_size, True, head_dim, head_dim, False, -1, -1, False, 0,
    )  # fmt: skip


@functools.cache
def _fast_plan_supported() -> bool:
    import flashinfer

    return flashinfer.__version__.startswith("0.6.")


class FlashInferBackend(AttentionBackend):
    supports_cuda_graph = True

    def __init__(
        self,
        kv_cache: BaseKVCache,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        decode_backend: str = "triton",
        cascade_options: dict | None = None,
        dtype: torch.dtype | None = None,
    ):
        import flashinfer

        from minisgl.device.attention.cascade_triton import TritonCascade, fp8_page_options

        super().__init__(kv_cache, num_qo_heads, num_kv_heads, head_dim)
        self._graph_wrappers: dict[int, flashinfer.BatchDecodeWithPagedKVCacheWrapper] = {}
        device = kv_cache.k_cache(0).device
        self.kv_dtype = kv_cache.k_cache(0).dtype
        self.q_dtype = dtype or self.kv_dtype  # an fp8 cache is read with q in the model dtype
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        fp8 = self.kv_dtype == torch.float8_e4m3fn and self.q_dtype in (torch.bfloat16, torch.float16)
        self.prefill_wide = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD") if fp8 else None
        self.wide_pages: torch.Tensor | None = None  # this step's pool pages for the scratch, if widening
        self._wide: tuple[torch.Tensor, torch.Tensor] | None = None  # the scratch (K, V), shared by the step's layers
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", use_tensor_cores=True)
        if decode_backend not in ("flashinfer", "triton"):
            raise ValueError(f"unknown decode attention backend {decode_backend!r} (flashinfer, triton)")
        self.triton_decode = decode_backend == "triton"  # plain decode steps on our kernel too
        options = dict(cascade_options or {})
        if self.kv_dtype == torch.float8_e4m3fn:
            options = {**fp8_page_options(num_qo_heads, num_kv_heads), **options}
        self.cascade = TritonCascade(num_qo_heads, num_kv_heads, head_dim, device, **options)
        self.wrapper = self.prefill
        self.step = "flashinfer"  # this step's attention: "flashinfer", "cascade" or "triton" (own items only)

    def init_cuda_graph(self, max_bs: int, max_pages_per_req: int) -> None:
        device = self.workspace.device
        self._graph_wrappers = {}  # (graphs captured again: wrappers bind the new buffers)
        self._g_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=device)
        self._g_indices = torch.zeros(max_bs * max_pages_per_req, dtype=torch.int32, device=device)
        self._g_last_page_len = torch.zeros(max_bs, dtype=torch.int32, device=device)
        self.cascade.init_cuda_graph(max_bs, max_pages_per_req)

    def _graph_wrapper(self, size: int):
        import flashinfer

        if size not in self._graph_wrappers:
            self._graph_wrappers[size] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=True,
                paged_kv_indptr_buffer=self._g_indptr[: size + 1],
                paged_kv_indices_buffer=self._g_indices,
                paged_kv_last_page_len_buffer=self._g_last_page_len[:size],
            )
        return self._graph_wrappers[size]

    @staticmethod
    def _page_indices(
        table: np.ndarray, rows: Sequence[int], first: Sequence[int], counts: Sequence[int]
    ) -> np.ndarray:
        """``table[rows[i], first[i] : first[i] + counts[i]]`` concatenated over i, on the host:
        cut by kernels it took ~20 small launches a decode step (~0.1 ms of an 8B step at 256
        requests on the H100, with the gaps between them), before the step's graph could run.
        Each entry is its run's start in the flattened table plus its place in the output, less
        the run's first place: 256 runs of 152 pages ~0.1 ms, 4096 of 128 ~1 ms (this VM)."""
        if len(rows) <= base.FEW_ROWS:  # a few rows: slices (numpy calls cost more than the work)
            parts = [table[r, f : f + c] for r, f, c in zip(rows, first, counts)]
            return np.concatenate(parts) if parts else table[:0, 0].copy()
        counts = np.asarray(counts, dtype=np.int64)
        ends = np.cumsum(counts)
        starts = np.asarray(rows, dtype=np.int64) * table.shape[1] + np.asarray(first, dtype=np.int64) - (ends - counts)
        flat = np.repeat(starts, counts)
        flat += np.arange(len(flat))
        return table.ravel().take(flat)

    def decode_part(self) -> FlashInferBackend:
        """On our kernel whatever ``decode_backend`` says: FlashInfer's decode plan would share
        the workspace the prefill part's plan lives in."""
        part = super().decode_part()
        part.triton_decode = True
        return part

    def plan(self, meta: AttentionMetadata, graph_batch_size: int | None = None) -> None:
        super().plan(meta)
        self.wide_pages = None
        self._wide = None
        page_size = self.kv_cache.page_size
        seq_lens = meta.seq_lens
        # A group's shared level reads whole tiles of its prefix; each member reads the rest.
        group_pages = [self.cascade.shared_pages(p, page_size) for p in meta.group_pages]
        gains, extra = meta.gains, None
        if gains is not None:  # rows that may grow on the device: their page lists cover it
            extra = np.zeros(meta.num_reqs, dtype=np.int64)
            extra[gains.rows] = gains.most
            group_pages = self.cascade.growing_shared_pages(group_pages, meta.group_sizes, seq_lens, page_size)
        skip = meta.skip_pages(group_pages)
        num_pages = -(-(seq_lens if extra is None else seq_lens + extra) // page_size) - skip
        kv_lens = seq_lens - skip * page_size  # past the skipped shared pages
        host_indices = self._page_indices(meta.page_table_host, meta.slots, skip, num_pages)
        indices = torch.from_numpy(host_indices)
        if meta.is_decode and (meta.cascade or self.triton_decode):  # our kernel, none of FlashInfer's inputs
            self.step = "cascade" if meta.cascade else "triton"
            sizes, pages = list(meta.group_sizes), group_pages
            leaders = np.asarray(meta.slots)[np.cumsum([0] + sizes[:-1])] if sizes else []
            shared = torch.from_numpy(self._page_indices(meta.page_table_host, leaders, [0] * len(pages), pages))
            self.cascade.plan(sizes, pages, page_size, shared, kv_lens, indices, graph_batch_size, extra)
            if gains is not None:
                self.cascade.gain(gains.rows, gains.tokens)
            return
        assert gains is None, "FlashInfer plans lengths on the host (plans_gains)"
        self.step = "flashinfer"
        kv_indptr = torch.from_numpy(np.concatenate([[0], np.cumsum(num_pages)]).astype(np.int32))
        last_page_len = torch.from_numpy((seq_lens - (-(-seq_lens // page_size) - 1) * page_size).astype(np.int32))
        common = dict(q_data_type=self.q_dtype, kv_data_type=self.kv_dtype, sm_scale=self.scale)
        heads = (self.num_qo_heads, self.num_kv_heads, self.head_dim, page_size)
        if meta.is_decode:
            self.wrapper = self.decode if graph_batch_size is None else self._graph_wrapper(graph_batch_size)
            plan_decode(self.wrapper, kv_indptr, indices, last_page_len, kv_lens, heads, **common)
        else:
            qo_indptr = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
            qo_indptr[1:] = torch.tensor(meta.new_lens, dtype=torch.int32).cumsum(0)
            self.wrapper = self.prefill
            wide = self._wide_indices(meta, host_indices)
            if wide is not None:
                self.wrapper, (self.wide_pages, indices) = self.prefill_wide, wide
                common["kv_data_type"] = self.q_dtype
            self.wrapper.plan(qo_indptr, kv_indptr, indices, last_page_len, *heads, causal=True, **common)

    def plans_gains(self, cascade: bool) -> bool:
        """Decode steps on our kernel: its work lists are lengthened on the device (``gain``)."""
        return cascade or self.triton_decode

    def _wide_indices(self, meta: AttentionMetadata, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For a prefill chunk on an fp8 cache that pays for widening: the distinct pool pages of
        its page list ``indices`` (host) and the list as positions among them, both on the device
        (pages int64); else None."""
        new = np.asarray(meta.new_lens)
        if self.prefill_wide is None or new.sum() < WIDE_MIN_CHUNK_TOKENS or new.sum() < WIDE_MIN_NEW_TOKENS * len(new):
            return None
        pages, positions = np.unique(indices, return_inverse=True)
        page_bytes = self.kv_cache.k_cache(0)[0].numel() * torch.finfo(self.q_dtype).bits // 8
        if 2 * len(pages) * page_bytes > WIDE_MAX_BYTES:
            return None
        device = self.workspace.device
        return (
            torch.from_numpy(pages.astype(np.int64)).to(device, non_blocking=True),
            torch.from_numpy(positions.astype(np.int32)).to(device, non_blocking=True),
        )

    def attend(self, q: torch.Tensor, layer_id: int, out: torch.Tensor | None = None) -> torch.Tensor:
        cache = (self.kv_cache.k_cache(layer_id), self.kv_cache.v_cache(layer_id))
        k_scale, v_scale = self.kv_cache.scales[layer_id]
        if self.step == "flashinfer":
            # Every row is written: without ``out`` FlashInfer zero-fills a fresh one (an 8B
            # layer's 8192-token chunk: 22 us of 67 MB of writes).
            if out is None:
                out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            if self.wide_pages is not None:
                from minisgl.device.kernels.fp8 import widen_pages

                if self._wide is None:
                    shape = (len(self.wide_pages), *cache[0].shape[1:])
                    self._wide = (
                        torch.empty(shape, dtype=q.dtype, device=q.device),
                        torch.empty(shape, dtype=q.dtype, device=q.device),
                    )
                widen_pages(*cache, self.wide_pages, *self._wide)
                return self.wrapper.run(q, self._wide, k_scale=k_scale, v_scale=v_scale, out=out)
            if self.kv_dtype != q.dtype:
                return self.wrapper.run(q, cache, k_scale=k_scale, v_scale=v_scale, out=out)
            return self.wrapper.run(q, cache, out=out)
        levels = ("shared", "own", "combine") if self.step == "cascade" else ("own", "combine")
        return into(self.cascade.forward(q, *cache, self.scale, levels, (k_scale, v_scale)), out)
