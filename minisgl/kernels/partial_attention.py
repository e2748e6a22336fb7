"""Decode attention as partial states, in Triton: the kernel under the cascade's two levels.

A work item is (first query row, members, a run of pages, tokens, split slot): the queries of
up to ``BLOCK_M // GQA`` consecutive requests, GQA heads packed as rows, attend once to the
run's keys and write a normalized partial output and base-2 log-sum-exp (FlashInfer's
convention) into the split slot of their rows. The shared level gives each group's members one
item per tile and split of the shared pages (so a group reads its prefix once); the own level
gives each request one item over its pages past its group's. ``combine`` merges a row's slots.
Programs loop over the work list, whose length is read on the device, so one launch shape
serves every step of a CUDA graph.

Why not FlashInfer's paged prefill for the shared level: it ran at ~54 TFLOP/s on the H100 (one
CTA per group and KV head walking 2048 keys on FA2's mma.sync path), 0.079 ms per layer at 256
requests in 16 groups on 2048 tokens against 0.055 here (benchmarks/decode_bench.py part 3).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _partial_attention_kernel(
    q_ptr, k_ptr, v_ptr, indices_ptr, work_ptr, n_work_ptr, part_o_ptr, part_lse_ptr,
    stride_qb, stride_qh, stride_kp, stride_kt, stride_kh, stride_os, stride_ob, stride_oh, stride_ls, stride_lb,
    scale_log2,
    PAGE: tl.constexpr, GQA: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
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
        split = tl.load(work_ptr + item * 5 + 4)
        live = member < members
        q_row = (first_row + member).to(tl.int64)
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
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + offset[:, None] + dim[None, :], mask=ok[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        out = acc / l_i[:, None]
        o_row = split * stride_os + q_row * stride_ob + head * stride_oh
        tl.store(part_o_ptr + o_row[:, None] + dim[None, :], out, mask=live[:, None])
        tl.store(part_lse_ptr + split * stride_ls + q_row * stride_lb + head, m_i + tl.log2(l_i), mask=live)


@triton.jit
def _combine_kernel(
    out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, splits_ptr,
    stride_b, stride_h, stride_lb, stride_os, stride_ob, stride_oh, stride_ls, stride_plb,
    HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_BASE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    splits = tl.load(splits_ptr + row)
    if splits > 0:
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
        for i in tl.range(0, splits):
            po = tl.load(part_o_ptr + i * stride_os + row * stride_ob + head[:, None] * stride_oh + dim[None, :],
                         mask=hm[:, None], other=0.0)
            ps = tl.load(part_lse_ptr + i * stride_ls + row * stride_plb + head, mask=hm, other=0.0)
            m = tl.maximum(s, ps)  # ps is finite: every partial covers at least one key
            wa = tl.exp2(s - m)
            wb = tl.exp2(ps - m)
            o = (o * wa[:, None] + po * wb[:, None]) / (wa + wb)[:, None]
            s = m + tl.log2(wa + wb)
        tl.store(out_ptr + at, o.to(out_ptr.dtype.element_ty), mask=hm[:, None])


def partial_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, indices: torch.Tensor, work: torch.Tensor,
    n_work: torch.Tensor, part_o: torch.Tensor, part_lse: torch.Tensor, programs: int, scale: float,
    block_m: int = 64, block_n: int = 64, num_warps: int = 4, num_stages: int = 2,
) -> None:
    """q [B, Hq, D]; caches [pages, page_size, Hk, D]; ``work`` int32 [items, 5] rows of (first
    query row, members, first entry of ``indices``, tokens from the first page on, split); ``n_work`` int32 [1] how many
    rows of ``work`` are live. Writes part_o [splits, B, Hq, D] fp32 and part_lse [splits, B, Hq]
    for the rows the items cover, with ``programs`` programs per KV head."""
    page_size, kv_heads, head_dim = k_cache.shape[1:]
    gqa = q.shape[1] // kv_heads
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1 and q.stride(2) == 1
    _partial_attention_kernel[(programs, kv_heads)](
        q, k_cache, v_cache, indices, work, n_work, part_o, part_lse,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
        scale * LOG2E, PAGE=page_size, GQA=gqa, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=num_warps, num_stages=num_stages,
    )


def combine(
    out: torch.Tensor, lse: torch.Tensor | None, part_o: torch.Tensor, part_lse: torch.Tensor, splits: torch.Tensor
) -> None:
    """Row r of ``out`` becomes the merge of its first ``splits[r]`` partial states, and of the
    state already in (out, lse base 2) when ``lse`` is given; rows with 0 splits are left as
    they are. ``lse`` is not updated."""
    rows, heads, head_dim = out.shape
    _combine_kernel[(rows,)](
        out, out if lse is None else lse, part_o, part_lse, splits, out.stride(0), out.stride(1),
        0 if lse is None else lse.stride(0),
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
        HEADS=heads, BLOCK_H=triton.next_power_of_2(heads), HEAD_DIM=head_dim, HAS_BASE=lse is not None, num_warps=4,
    )
