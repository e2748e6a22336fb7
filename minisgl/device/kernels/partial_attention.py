"""Decode attention as resumable partial states, in Triton: the kernel under our decode steps.

A work item is (first query row, members, first page entry, tokens, slot, flags): the queries of
up to ``BLOCK_M // GQA`` consecutive requests, GQA heads packed as rows, attend to a run of keys,
each key tile read once for all of them. Its rows start from nothing or, with ``RESUME``, from
the state another item left in their slot; they end by writing the state back to the slot
(unnormalized accumulator, running maximum and sum, as held in registers) or, with ``FINAL``,
the normalized output. ``combine`` folds the states of rows that end in several slots, in order.

Why resumable: a cascade step must return exactly what the plain step returns (in bf16 one
flipped rounding in 0.01% of layer 0's outputs grew into logit differences of ~0.5 by SmolLM2's
last layer; benchmarks/results/gpu_2026-11-22.md). The running-state update is not
associative in floating point, so the states of a prefix and a suffix cannot be merged into the
bits of one pass. Instead the shared level runs the first part of each member's pass and stops,
and the member's own item continues from the registers' very contents. Every row then sees the
same tiles (runs start at multiples of ``BLOCK_N``) and the same arithmetic in the same order as
in one pass, whatever tile of query rows it sits in: row maxima are exact in any order, row sums
run through the tensor cores like the PV product (a reduction across lanes and warps would add
in an order set by the tile's layout), and every product is an mma.sync (for 64 rows Triton
would pick the H100's wgmma, which rounds differently). Long rows split for parallelism at fixed
segment boundaries chosen from the batch alone (``attention.cascade_triton``), with or without
groups alike.

Programs loop over the work list, whose length is read on the device, so one launch shape
serves every step of a CUDA graph.
"""

from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
RESUME = 1  # flags: start from the slot's state
FINAL = 2  # flags: write the normalized output, not a state
WORK_COLUMNS = 6


@triton.jit
def _widen(x):
    """e4m3 to fp16 in registers, four at a time (two cvt.f16x2 per 32-bit word): Triton's own
    cast keeps fp8 in shared memory and widens each mma operand as it loads it, with byte-wise
    loads and shuffles; widened here, tiles reach shared memory as fp16 and load with ldmatrix
    (8B cascade step 0.186 -> 0.171 ms a layer with two stages; the same bits)."""
    return tl.inline_asm_elementwise(
        asm="{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
        constraints="=r,=r,r",
        args=[x.to(tl.uint8, bitcast=True)],
        dtype=tl.float16,
        is_pure=True,
        pack=4,
    )


@triton.jit
def _partial_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    indices_ptr,
    work_ptr,
    n_work_ptr,
    row_base_ptr,
    acc_ptr,
    m_ptr,
    l_ptr,
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_kp,
    stride_kt,
    stride_kh,
    stride_as,
    stride_ah,
    stride_ms,
    scale_log2,
    v_scale,
    PAGE: tl.constexpr,
    GQA: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WIDE: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    # The grid is (KV heads, programs): the CTAs of one item's heads launch together and read the
    # same tokens' rows (2.5% faster than programs first on 256 plain rows of 2304 tokens).
    kv_head = tl.program_id(0)
    program = tl.program_id(1)
    n_programs = tl.num_programs(1)
    rows = tl.arange(0, BLOCK_M)
    member = rows // GQA
    head = kv_head * GQA + rows % GQA
    dim = tl.arange(0, HEAD_DIM)
    # The row sums run through the tensor cores too (p times a column of ones, 16 wide, the
    # narrowest tile): a reduction across lanes and warps would add in an order set by the tile's
    # layout, which differs between the levels' tile shapes.
    n_work = tl.load(n_work_ptr)
    for item in tl.range(program, n_work, n_programs):
        at = work_ptr + item * 6
        first_row = tl.load(at)
        members = tl.load(at + 1)
        first_index = tl.load(at + 2)
        n_tokens = tl.load(at + 3)
        slot = tl.load(at + 4)
        flags = tl.load(at + 5)
        live = (member < members) & (rows < BLOCK_M // GQA * GQA)
        q_row = (first_row + member).to(tl.int64)
        state = (tl.load(row_base_ptr + q_row, mask=live, other=0) + slot).to(tl.int64)
        at_acc = acc_ptr + state[:, None] * stride_as + head[:, None] * stride_ah + dim[None, :]
        at_ml = state * stride_ms + head
        q = tl.load(
            q_ptr + q_row[:, None] * stride_qb + head[:, None] * stride_qh + dim[None, :], mask=live[:, None], other=0.0
        )
        if KV_FP8:  # products in fp16, to which e4m3 widens in one instruction (bf16 takes three)
            q = q.to(tl.float16)
        ones = tl.full([BLOCK_N, 16], 1.0, q.dtype)
        if (flags & 1) != 0:  # RESUME
            m_i = tl.load(m_ptr + at_ml, mask=live, other=float("-inf"))
            l_i = tl.load(l_ptr + at_ml, mask=live, other=0.0)[:, None] + tl.zeros([BLOCK_M, 16], tl.float32)
            acc = tl.load(at_acc, mask=live[:, None], other=0.0)
        else:
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M, 16], tl.float32)
            acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        for start in tl.range(0, n_tokens, BLOCK_N):
            tok = start + tl.arange(0, BLOCK_N)
            ok = tok < n_tokens
            page = tl.load(indices_ptr + first_index + tok // PAGE, mask=ok, other=0)
            if WIDE:  # a cache of 2**31 elements or more; 32-bit offsets save registers (242 -> 210)
                page = page.to(tl.int64)
            offset = page * stride_kp + (tok % PAGE) * stride_kt + kv_head * stride_kh
            k = tl.load(k_ptr + offset[:, None] + dim[None, :], mask=ok[:, None], other=0.0)
            if KV_FP8:  # K / k_scale: the scale is in scale_log2
                k = _widen(k)
            s = tl.dot(q, tl.trans(k)) * scale_log2
            s = tl.where(ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))  # a maximum is exact in any order
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None]).to(q.dtype)
            v = tl.load(v_ptr + offset[:, None] + dim[None, :], mask=ok[:, None], other=0.0)
            if KV_FP8:  # V / v_scale: the scale is applied to the output
                v = _widen(v)
            l_i = l_i * alpha[:, None] + tl.dot(p, ones)
            acc = acc * alpha[:, None] + tl.dot(p, v)
            m_i = m_new
        l_row = tl.max(l_i, 1)  # its 16 columns are equal
        if (flags & 2) != 0:  # FINAL
            result = acc / l_row[:, None]
            if KV_FP8:
                result = result * v_scale
            tl.store(
                out_ptr + q_row[:, None] * stride_ob + head[:, None] * stride_oh + dim[None, :],
                result.to(out_ptr.dtype.element_ty),
                mask=live[:, None],
            )
        else:
            tl.store(at_acc, acc, mask=live[:, None])
            tl.store(m_ptr + at_ml, m_i, mask=live)
            tl.store(l_ptr + at_ml, l_row, mask=live)


@triton.jit
def _combine_kernel(
    out_ptr,
    acc_ptr,
    m_ptr,
    l_ptr,
    row_base_ptr,
    counts_ptr,
    stride_b,
    stride_h,
    stride_as,
    stride_ah,
    stride_ms,
    v_scale,
    HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    count = tl.load(counts_ptr + row)
    if count > 0:
        first = tl.load(row_base_ptr + row).to(tl.int64)
        head = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        dim = tl.arange(0, HEAD_DIM)
        hm = head < HEADS
        at_acc = acc_ptr + head[:, None] * stride_ah + dim[None, :]
        acc = tl.load(at_acc + first * stride_as, mask=hm[:, None], other=0.0)
        m = tl.load(m_ptr + first * stride_ms + head, mask=hm, other=0.0)
        l = tl.load(l_ptr + first * stride_ms + head, mask=hm, other=1.0)
        for i in tl.range(1, count):
            state = first + i
            acc_b = tl.load(at_acc + state * stride_as, mask=hm[:, None], other=0.0)
            m_b = tl.load(m_ptr + state * stride_ms + head, mask=hm, other=0.0)
            l_b = tl.load(l_ptr + state * stride_ms + head, mask=hm, other=1.0)
            m_new = tl.maximum(m, m_b)  # both finite: every state covers at least one key
            wa = tl.exp2(m - m_new)
            wb = tl.exp2(m_b - m_new)
            acc = acc * wa[:, None] + acc_b * wb[:, None]
            l = l * wa + l_b * wb
            m = m_new
        tl.store(
            out_ptr + row * stride_b + head[:, None] * stride_h + dim[None, :],
            (acc / l[:, None] * v_scale).to(out_ptr.dtype.element_ty),
            mask=hm[:, None],
        )


@contextlib.contextmanager
def _mma_sync():
    """Triton compiles what launches inside on mma.sync, never wgmma (it reads the variable when
    it compiles, and keys its caches on it): from 64 query rows on the H100 it would pick wgmma,
    whose sums round differently from the 16-row tiles' mma.sync."""
    before = os.environ.get("DISABLE_MMA_V3")
    os.environ["DISABLE_MMA_V3"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["DISABLE_MMA_V3"]
        else:
            os.environ["DISABLE_MMA_V3"] = before


def partial_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    indices: torch.Tensor,
    work: torch.Tensor,
    n_work: torch.Tensor,
    row_base: torch.Tensor,
    acc: torch.Tensor,
    m: torch.Tensor,
    l: torch.Tensor,
    programs: int,
    scale: float,
    block_m: int,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 5,
    kv_scales: tuple[float, float] = (1.0, 1.0),
    maxnreg: int | None = None,
) -> None:
    """q, out [B, Hq, D]; caches [pages, page_size, Hk, D]; ``work`` int32 [items, 6] rows of
    (first query row, members, first entry of ``indices``, tokens from the first page on, slot,
    flags); ``n_work`` int32 [1] how many rows of ``work`` are live; ``row_base`` int32 [B] where
    each row's slots start in the states acc [states, Hq, D], m and l [states, Hq] (fp32, base 2).
    ``programs`` programs per KV head, each item up to ``block_m // GQA`` requests. An item's first
    token must be the start of a page, and, when its rows' results must not depend on which items
    computed them, of a ``block_n`` tile of the row's keys. An fp8 (e4m3) cache holds K / k_scale
    and V / v_scale (``kv_scales``): its tiles widen to fp16 as they load (q too), k_scale joins
    the softmax scale and v_scale multiplies the output (``combine`` takes it too). ``maxnreg``
    caps registers per thread (more CTAs per SM, some spilled; a row's arithmetic is the same)."""
    page_size, kv_heads, head_dim = k_cache.shape[1:]
    gqa = q.shape[1] // kv_heads
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1 and q.stride(2) == 1
    assert out.stride(2) == 1 and acc.stride(2) == 1 and m.stride() == l.stride()
    wide = sum((n - 1) * st for n, st in zip(k_cache.shape, k_cache.stride())) >= 2**31
    with _mma_sync():
        _partial_attention_kernel[(kv_heads, programs)](
            q,
            k_cache,
            v_cache,
            out,
            indices,
            work,
            n_work,
            row_base,
            acc,
            m,
            l,
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            acc.stride(0),
            acc.stride(1),
            m.stride(0),
            scale * LOG2E * kv_scales[0],
            kv_scales[1],
            PAGE=page_size,
            GQA=gqa,
            HEAD_DIM=head_dim,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            WIDE=wide,
            KV_FP8=k_cache.dtype == torch.float8_e4m3fn,
            num_warps=num_warps,
            num_stages=num_stages,
            **({"maxnreg": maxnreg} if maxnreg else {}),
        )


def combine(
    out: torch.Tensor,
    acc: torch.Tensor,
    m: torch.Tensor,
    l: torch.Tensor,
    row_base: torch.Tensor,
    counts: torch.Tensor,
    block_h: int = 32,
    v_scale: float = 1.0,
) -> None:
    """Row r of ``out`` becomes the fold of its ``counts[r]`` states from ``row_base[r]`` on, in
    slot order, times ``v_scale`` (an fp8 cache's); rows with none are left as they are. A program
    takes ``block_h`` heads of a row (all
    of them for most models), so a row with nothing to fold costs one program that returns at once."""
    rows, heads, head_dim = out.shape
    block_h = min(block_h, triton.next_power_of_2(heads))
    _combine_kernel[(rows, triton.cdiv(heads, block_h))](
        out,
        acc,
        m,
        l,
        row_base,
        counts,
        out.stride(0),
        out.stride(1),
        acc.stride(0),
        acc.stride(1),
        m.stride(0),
        v_scale,
        HEADS=heads,
        BLOCK_H=block_h,
        HEAD_DIM=head_dim,
        num_warps=4,
    )
