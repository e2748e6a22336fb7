"""Decode attention as partial states, in Triton: the kernel under every Triton decode step.

A work item is (first query row, members, first page entry, tokens, first slot): the queries of
up to ``BLOCK_M // GQA`` consecutive requests, GQA heads packed as rows, attend once to a run of
keys and write normalized partial outputs and base-2 log-sum-exps (FlashInfer's convention)
into state slots of their rows: one for the run, or, with ``CHUNK``, one per chunk of ``CHUNK``
keys at fixed positions (runs then start on chunk boundaries). ``combine`` folds each row's
states left to right. The cascade's shared level gives each group's members items over the
group's prefix (read once for all of them); the own level gives each request items over its
keys past those; a plain decode step on this kernel is the own level alone.

Why chunks: with them a row's result is bit for bit the same whichever items computed it.
Within a chunk the tiles start at its first key and every item runs the same code; the running
maximum subtracted before exponentiating is rounded up to a whole number (base 2) in every mode,
so a probability is 2^(s - m) with m an integer and rounds to the same bf16 mantissa for the PV
product wherever the maximum came from; and the fold's order is fixed. So a cascade step returns
exactly what a plain step on this kernel returns. Close is not enough: in bf16, one flipped
rounding in 0.01% of layer 0's attention outputs grew into logit differences of ~0.5 by
SmolLM2's last layer (benchmarks/results/gpu_2026-11-22.md, session 10).

Programs loop over the work list, whose length is read on the device, so one launch shape
serves every step of a CUDA graph. Why not FlashInfer's paged prefill for the shared level: it
ran at ~54 TFLOP/s on the H100 (one CTA per group and KV head walking 2048 keys on FA2's
mma.sync path), 0.079 ms per layer at 256 requests in 16 groups on 2048 tokens against 0.055
here (benchmarks/decode_bench.py part 3).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _partial_attention_kernel(
    q_ptr, k_ptr, v_ptr, indices_ptr, work_ptr, n_work_ptr, row_base_ptr, part_o_ptr, part_lse_ptr,
    stride_qb, stride_qh, stride_kp, stride_kt, stride_kh, stride_os, stride_oh, stride_ls,
    scale_log2,
    PAGE: tl.constexpr, GQA: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CHUNK: tl.constexpr,
):
    kv_head = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    member = rows // GQA
    head = kv_head * GQA + rows % GQA
    dim = tl.arange(0, HEAD_DIM)
    n_work = tl.load(n_work_ptr)
    for item in tl.range(tl.program_id(0), n_work, tl.num_programs(0)):
        first_row = tl.load(work_ptr + item * 5)
        members = tl.load(work_ptr + item * 5 + 1)
        first_index = tl.load(work_ptr + item * 5 + 2)
        n_tokens = tl.load(work_ptr + item * 5 + 3)
        first_chunk = tl.load(work_ptr + item * 5 + 4)
        live = member < members
        q_row = (first_row + member).to(tl.int64)
        base = tl.load(row_base_ptr + q_row, mask=live, other=0).to(tl.int64)
        q = tl.load(q_ptr + q_row[:, None] * stride_qb + head[:, None] * stride_qh + dim[None, :],
                    mask=live[:, None], other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        for start in tl.range(0, n_tokens, BLOCK_N):
            tok = start + tl.arange(0, BLOCK_N)
            ok = tok < n_tokens
            page = tl.load(indices_ptr + first_index + tok // PAGE, mask=ok, other=0).to(tl.int64)
            offset = page * stride_kp + (tok % PAGE) * stride_kt + kv_head * stride_kh
            k = tl.load(k_ptr + offset[:, None] + dim[None, :], mask=ok[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * scale_log2
            s = tl.where(ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.ceil(tl.max(s, 1)))  # whole numbers: see the module docstring
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + offset[:, None] + dim[None, :], mask=ok[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
            if (start + BLOCK_N) % CHUNK == 0 or start + BLOCK_N >= n_tokens:  # a chunk or the run ends: state out
                state = base + first_chunk + start // CHUNK
                tl.store(part_o_ptr + state[:, None] * stride_os + head[:, None] * stride_oh + dim[None, :],
                         acc / l_i[:, None], mask=live[:, None])
                tl.store(part_lse_ptr + state * stride_ls + head, m_i + tl.log2(l_i), mask=live)
                m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
                l_i = tl.zeros([BLOCK_M], tl.float32)
                acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)


@triton.jit
def _combine_kernel(
    out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, row_base_ptr, chunks_ptr,
    stride_b, stride_h, stride_lb, stride_os, stride_oh, stride_ls,
    HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_BASE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunks = tl.load(chunks_ptr + row)
    if chunks > 0:
        first = tl.load(row_base_ptr + row).to(tl.int64)
        head = tl.arange(0, BLOCK_H)
        dim = tl.arange(0, HEAD_DIM)
        hm = head < HEADS
        at = row * stride_b + head[:, None] * stride_h + dim[None, :]
        if HAS_BASE:
            o = tl.load(out_ptr + at, mask=hm[:, None], other=0.0).to(tl.float32)
            s = tl.load(lse_ptr + row * stride_lb + head, mask=hm, other=0.0)
        else:
            o = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
            s = tl.full([BLOCK_H], float("-inf"), tl.float32)
        for i in tl.range(0, chunks):
            po = tl.load(part_o_ptr + (first + i) * stride_os + head[:, None] * stride_oh + dim[None, :],
                         mask=hm[:, None], other=0.0)
            ps = tl.load(part_lse_ptr + (first + i) * stride_ls + head, mask=hm, other=0.0)
            m = tl.maximum(s, ps)  # ps is finite: every chunk state covers at least one key
            wa = tl.exp2(s - m)
            wb = tl.exp2(ps - m)
            o = (o * wa[:, None] + po * wb[:, None]) / (wa + wb)[:, None]
            s = m + tl.log2(wa + wb)
        tl.store(out_ptr + at, o.to(out_ptr.dtype.element_ty), mask=hm[:, None])


def partial_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, indices: torch.Tensor, work: torch.Tensor,
    n_work: torch.Tensor, row_base: torch.Tensor, part_o: torch.Tensor, part_lse: torch.Tensor, programs: int,
    scale: float, chunk: int | None, block_m: int = 64, block_n: int = 64, num_warps: int = 4, num_stages: int = 2,
) -> None:
    """q [B, Hq, D]; caches [pages, page_size, Hk, D]; ``work`` int32 [items, 5] rows of (first
    query row, members, first entry of ``indices``, tokens from the first page on, first slot);
    ``n_work`` int32 [1] how many rows of ``work`` are live; ``row_base`` int32 [B] where each
    row's state slots start. With ``chunk`` (tokens, a multiple of ``block_n`` and of the page
    size) an item starts on a chunk boundary and writes a state per chunk into consecutive slots;
    without, one state for its whole run. Writes part_o [states, Hq, D] fp32 and part_lse
    [states, Hq] at ``row_base[row] + slot``, with ``programs`` programs per KV head."""
    page_size, kv_heads, head_dim = k_cache.shape[1:]
    gqa = q.shape[1] // kv_heads
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1 and q.stride(2) == 1
    assert chunk is None or (chunk % block_n == 0 and chunk % page_size == 0), (chunk, block_n, page_size)
    _partial_attention_kernel[(programs, kv_heads)](
        q, k_cache, v_cache, indices, work, n_work, row_base, part_o, part_lse,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        part_o.stride(0), part_o.stride(1), part_lse.stride(0),
        scale * LOG2E, PAGE=page_size, GQA=gqa, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, CHUNK=chunk or 1 << 30,
        num_warps=num_warps, num_stages=num_stages,
    )


def combine(
    out: torch.Tensor, lse: torch.Tensor | None, part_o: torch.Tensor, part_lse: torch.Tensor,
    row_base: torch.Tensor, chunks: torch.Tensor,
) -> None:
    """Row r of ``out`` becomes the left-to-right fold of its ``chunks[r]`` states from
    ``row_base[r]`` on, after the state already in (out, lse base 2) when ``lse`` is given; rows
    with none are left as they are. ``lse`` is not updated."""
    rows, heads, head_dim = out.shape
    _combine_kernel[(rows,)](
        out, out if lse is None else lse, part_o, part_lse, row_base, chunks, out.stride(0), out.stride(1),
        0 if lse is None else lse.stride(0), part_o.stride(0), part_o.stride(1), part_lse.stride(0),
        HEADS=heads, BLOCK_H=triton.next_power_of_2(heads), HEAD_DIM=head_dim, HAS_BASE=lse is not None, num_warps=4,
    )
