"""LoRA on the GPU (Triton): the adapters' two products of one linear layer in two launches.

``LoraWeights.add`` on the CPU (the reference) multiplies every row by every slot's A and masks
the columns of the slots the row does not use: four to six small kernels per layer, ~2.6 ms a
decode step on the 8B at batch 1 (benchmarks/results/lora_h200_2026-11-28.md). Here the step's
rows are taken in the order of their slots (``LoraRows.order``, a stable sort on the device), so
a tile of BT rows holds one adapter or a few, and each tile multiplies only the slots its rows
use, one rank-R chunk at a time:

- ``shrink``: u[row, part p, slot s] = x[row] A[p, s]^T for the rows of each used slot s, in
  float32, an fp8 x (a quantized activation) scaled as it is loaded (grid: row tiles x (part,
  slot) x K splits; a decode step's one row tile needs the splits, added up by atomics into a
  zeroed u, to keep the SMs busy); chunks of unused slots are never read;
- ``expand``: y[row, cols] += u[row, part of cols, s] B[cols, s]^T over the same used slots (grid:
  row tiles x column tiles; a column tile lies within one part).

Static shapes throughout: they replay in the decode CUDA graphs and the piecewise prefill graphs.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

BT = 16  # rows a program takes (tl.dot's smallest M)


@triton.jit
def _shrink_kernel(
    x_ptr, scale_ptr, a_ptr, order_ptr, slot_ptr, u_ptr, T, K, stride_x, stride_scale, GROUP, S, P, KS,
    R: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, IEEE: tl.constexpr, SCALED: tl.constexpr,
):  # fmt: skip
    """One tile of rows in slot order, one (part, slot), one K split: u[rows, p, s, :] +=
    x[rows, split] @ A[p, s, :, split]^T for the tile's rows of slot s, if it has any. With
    ``SCALED`` x is fp8 and each value is first multiplied by its row's scale for its GROUP of
    columns (K: one scale a row)."""
    tile, ps, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    s = ps % S
    idx = tile * BT + tl.arange(0, BT)
    live = idx < T
    own = tl.load(slot_ptr + idx, mask=live, other=-1) == s
    if tl.max(own.to(tl.int32), 0) > 0:
        rows = tl.load(order_ptr + idx, mask=own, other=0).to(tl.int64)
        r = tl.arange(0, R)
        acc = tl.zeros((BT, R), dtype=tl.float32)
        a_base = a_ptr + (ps * R + r[None, :]).to(tl.int64) * K
        chunk = tl.cdiv(tl.cdiv(K, KS), BK) * BK
        for k0 in range(split * chunk, tl.minimum(K, (split + 1) * chunk), BK):
            ks = k0 + tl.arange(0, BK)
            keep = own[:, None] & (ks[None, :] < K)
            x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=keep, other=0.0)
            if SCALED:
                scale = tl.load(scale_ptr + rows[:, None] * stride_scale + ks[None, :] // GROUP, mask=keep, other=0.0)
                x = (x.to(tl.float32) * scale).to(a_ptr.dtype.element_ty)
            a = tl.load(a_base + ks[:, None], mask=ks[:, None] < K, other=0.0)  # [BK, R]
            acc = tl.dot(x, a, acc, input_precision="ieee" if IEEE else "tf32")
        out = u_ptr + rows[:, None] * (P * S * R) + ps * R + r[None, :]
        if KS > 1:
            tl.atomic_add(out, acc, mask=own[:, None])
        else:
            tl.store(out, acc, mask=own[:, None])


@triton.jit
def _expand_kernel(
    u_ptr, b_ptr, order_ptr, slot_ptr, y_ptr, T, N, stride_y, S, P, o1, o2,
    R: tl.constexpr, BN: tl.constexpr, BT: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """One tile of rows in slot order, one column tile (within part p): y[rows, cols] += the
    sum over the slots s its rows use of u[rows, p, s, :] @ B[cols, s]^T."""
    tile, n0 = tl.program_id(0), tl.program_id(1) * BN
    idx = tile * BT + tl.arange(0, BT)
    live = idx < T
    slots = tl.load(slot_ptr + idx, mask=live, other=-1)
    rows = tl.load(order_ptr + idx, mask=live, other=0).to(tl.int64)
    cols = n0 + tl.arange(0, BN)
    p = (n0 >= o1).to(tl.int32) + (n0 >= o2).to(tl.int32)
    r = tl.arange(0, R)
    width = S * R
    acc = tl.zeros((BT, BN), dtype=tl.float32)
    for s in range(S):
        own = slots == s
        if tl.max(own.to(tl.int32), 0) > 0:
            u = tl.load(
                u_ptr + rows[:, None] * (P * width) + (p * S + s) * R + r[None, :], mask=own[:, None], other=0.0
            )
            b = tl.load(
                b_ptr + cols[None, :].to(tl.int64) * width + s * R + r[:, None], mask=cols[None, :] < N, other=0.0
            )
            acc = tl.dot(u.to(b_ptr.dtype.element_ty), b, acc, input_precision="ieee" if IEEE else "tf32")
    y = y_ptr + rows[:, None] * stride_y + cols[None, :]
    keep = live[:, None] & (cols[None, :] < N)
    tl.store(y, (tl.load(y, mask=keep, other=0.0).to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=keep)


@functools.cache
def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def k_splits(T: int, K: int, parts: int, device: torch.device) -> int:
    """How many programs share one (row tile, part, slot)'s K: enough for twice the SMs when
    each tile uses one slot (a decode step's few rows would otherwise leave most SMs idle
    while a handful of programs walk all of K), each split at least 256 columns."""
    programs = triton.cdiv(T, BT) * parts
    return max(1, min(triton.cdiv(K, 256), triton.cdiv(2 * _sms(device), programs)))


def column_tile(part_sizes: list[int]) -> int:
    """The widest column tile (16 to 64) that no part boundary cuts."""
    bn = 64
    while bn > 16 and any(size % bn for size in part_sizes):
        bn //= 2
    return bn


def lora_add(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    order: torch.Tensor,
    sorted_slots: torch.Tensor,
    part_sizes: list[int],
    rank: int,
    scale: torch.Tensor | None = None,
    block: int | None = None,
) -> torch.Tensor:
    """y += each row's adapter's x A^T B^T, in place (``layers.lora.LoraWeights`` holds a, b;
    ``order``: the rows by slot, ``sorted_slots`` their slots, -1 for none: ``LoraRows``). An fp8
    x comes with its ``scale`` ([T, 1], or [T, K / block] per ``block`` columns) and is read
    dequantized, in the adapters' dtype (no dequantized copy is written)."""
    T, K = x.shape
    P = len(part_sizes)
    S = a.shape[0] // (P * rank)
    tiles = triton.cdiv(T, BT)
    ks = k_splits(T, K, P, x.device)
    u = (torch.zeros if ks > 1 else torch.empty)(T, P * S * rank, dtype=torch.float32, device=x.device)
    ieee = a.dtype == torch.float32
    scaled = scale is not None
    group = (block or K) if scaled else K
    _shrink_kernel[(tiles, P * S, ks)](
        x, scale if scaled else x, a, order, sorted_slots, u, T, K, x.stride(0), scale.stride(0) if scaled else 0,
        group, S, P, ks, R=rank, BK=128, BT=BT, IEEE=ieee, SCALED=scaled,
    )  # fmt: skip
    N = y.shape[1]
    bn = column_tile(part_sizes)
    offsets = [sum(part_sizes[:i]) for i in range(1, 3)] + [N] * (3 - P)
    _expand_kernel[(tiles, triton.cdiv(N, bn))](
        u, b, order, sorted_slots, y, T, N, y.stride(0), S, P, offsets[0], offsets[1], R=rank, BN=bn, BT=BT, IEEE=ieee
    )
    return y
