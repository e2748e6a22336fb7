"""Token-to-expert alignment for the fused MoE GEMMs (Triton): a step's (token, expert) pairs
sorted by expert into blocks of BM rows, each expert's run padded to whole blocks (padding
marked with the pair id P), so that one GEMM program multiplies one block by one expert's
weights. Static shapes (the capacity depends on the token count alone), so it replays inside
CUDA graphs; one launch up to 1024 pairs, two past that."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl


@triton.jit
def _scatter(ids_ptr, sorted_ptr, cursor_ptr, offs, P):
    """Place pairs ``offs`` at their experts' next free rows (an atomic cursor per expert: the
    order within an expert changes no result)."""
    e = tl.load(ids_ptr + offs, mask=offs < P, other=0)
    row = tl.atomic_add(cursor_ptr + e, 1, mask=offs < P)
    tl.store(sorted_ptr + row, offs, mask=offs < P)


@triton.jit
def _histogram(ids_ptr, offs, P, E_BINS: tl.constexpr):
    """Pairs per expert among ``offs`` (those past P not counted)."""
    return tl.histogram(tl.load(ids_ptr + offs, mask=offs < P, other=0), E_BINS, mask=offs < P)


@triton.jit
def _padded_starts(counts, BM: tl.constexpr):
    """Each expert's rows padded to whole BM blocks, and its first row."""
    padded = (counts + BM - 1) // BM * BM
    return padded, tl.cumsum(padded, 0) - padded


@triton.jit
def _layout(
    counts,
    padded,
    starts,
    sorted_ptr,
    block_expert_ptr,
    num_padded_ptr,
    P,
    BM: tl.constexpr,
    E_BINS: tl.constexpr,
    JB: tl.constexpr,
):
    """Given the pairs per expert (``counts`` [E_BINS], zero past the experts) and their runs
    padded to whole BM blocks and first rows (``_padded_starts``): write the padding rows (the
    id P), name each used block's expert (JB blocks of every expert at a time) and store the
    rows in use."""
    tl.store(num_padded_ptr, tl.sum(padded, 0))
    pad = tl.arange(0, BM)
    tl.store(
        sorted_ptr + (starts + counts)[:, None] + pad[None, :],
        tl.zeros([E_BINS, BM], tl.int32) + P,
        mask=pad[None, :] < (padded - counts)[:, None],
    )
    experts = tl.arange(0, E_BINS)
    blocks = padded // BM
    for j0 in range(0, tl.max(blocks, 0), JB):
        j = j0 + tl.arange(0, JB)
        tl.store(
            block_expert_ptr + (starts // BM)[:, None] + j[None, :],
            tl.zeros([E_BINS, JB], tl.int32) + experts[:, None],
            mask=j[None, :] < blocks[:, None],
        )


# Pair counts change with every prefill: a compile per value of their divisibility (Triton's
# default) stalled prefill steps for ~0.4 s each time one came up.
@triton.jit(do_not_specialize=["P"])
def _align_kernel(
    ids_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_padded_ptr,
    cursor_ptr,
    P,
    BM: tl.constexpr,
    E_BINS: tl.constexpr,
    CHUNK: tl.constexpr,
    JB: tl.constexpr,
):
    """One program, P <= CHUNK: count the pairs per expert, lay out the blocks, place the pairs."""
    bins = tl.arange(0, E_BINS)
    counts = _histogram(ids_ptr, tl.arange(0, CHUNK), P, E_BINS)
    padded, starts = _padded_starts(counts, BM)
    _layout(counts, padded, starts, sorted_ptr, block_expert_ptr, num_padded_ptr, P, BM, E_BINS, JB)
    tl.store(cursor_ptr + bins, starts)
    tl.debug_barrier()
    _scatter(ids_ptr, sorted_ptr, cursor_ptr, tl.arange(0, CHUNK), P)


@triton.jit(do_not_specialize=["P"])
def _chunk_count_kernel(ids_ptr, chunk_counts_ptr, P, E_BINS: tl.constexpr, CHUNK: tl.constexpr):
    """A program per chunk of pairs: its pairs per expert, in its own row (no atomics, no zeroing)."""
    c = tl.program_id(0)
    hist = _histogram(ids_ptr, c * CHUNK + tl.arange(0, CHUNK), P, E_BINS)
    tl.store(chunk_counts_ptr + c * E_BINS + tl.arange(0, E_BINS), hist)


@triton.jit(do_not_specialize=["P", "num_chunks"])
def _place_kernel(
    ids_ptr,
    chunk_counts_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_padded_ptr,
    cursor_ptr,
    P,
    num_chunks,
    BM: tl.constexpr,
    E_BINS: tl.constexpr,
    CHUNK: tl.constexpr,
    CHUNKS: tl.constexpr,
    JB: tl.constexpr,
):
    """A program per chunk: from every chunk's counts, each expert's first row plus the pairs of
    the chunks before this one; then it places its own pairs (atomics on its own cursors only).
    Program 0 also lays out the blocks."""
    c = tl.program_id(0)
    bins = tl.arange(0, E_BINS)
    chunks = tl.arange(0, CHUNKS)
    per_chunk = tl.load(
        chunk_counts_ptr + chunks[:, None] * E_BINS + bins[None, :], mask=chunks[:, None] < num_chunks, other=0
    )
    counts = tl.sum(per_chunk, 0)
    before = tl.sum(tl.where(chunks[:, None] < c, per_chunk, 0), 0)
    padded, starts = _padded_starts(counts, BM)
    if c == 0:
        _layout(counts, padded, starts, sorted_ptr, block_expert_ptr, num_padded_ptr, P, BM, E_BINS, JB)
    cursor = cursor_ptr + c * E_BINS
    tl.store(cursor + bins, starts + before)
    tl.debug_barrier()
    _scatter(ids_ptr, sorted_ptr, cursor, c * CHUNK + tl.arange(0, CHUNK), P)


class Alignment(NamedTuple):
    """Pairs sorted by expert in BM-row blocks: ``sorted_ids`` [capacity] pair ids (P for
    padding), ``block_expert`` [capacity / BM], ``num_padded`` [1] rows in use."""

    sorted_ids: torch.Tensor
    block_expert: torch.Tensor
    num_padded: torch.Tensor
    bm: int


def align(topk_ids: torch.Tensor, num_experts: int, bm: int) -> Alignment:
    """``topk_ids`` [T, k] int32 in BM-row blocks per expert; the capacity is the most rows any
    routing can need (every expert used pads at most BM - 1 rows), a function of T alone. Rows
    and blocks past ``num_padded`` are left unwritten: the GEMMs never read them."""
    P = topk_ids.numel()
    capacity = triton.cdiv(P + min(num_experts, P) * (bm - 1), bm) * bm
    dev = topk_ids.device
    sorted_ids = torch.empty(capacity, dtype=torch.int32, device=dev)
    block_expert = torch.empty(capacity // bm, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    e_bins, chunk, jb = triton.next_power_of_2(num_experts), 1024, 4
    if P <= chunk:  # one launch
        cursor = torch.empty(e_bins, dtype=torch.int32, device=dev)
        _align_kernel[(1,)](
            topk_ids, sorted_ids, block_expert, num_padded, cursor, P,
            BM=bm, E_BINS=e_bins, CHUNK=chunk, JB=jb, num_warps=4,
        )  # fmt: skip
        return Alignment(sorted_ids, block_expert, num_padded, bm)
    # Past a chunk, two launches of a program per chunk (one program's atomics on a few cursors
    # serialize): count each chunk, then place each chunk's pairs after the chunks before it.
    num_chunks = triton.cdiv(P, chunk)
    chunk_counts = torch.empty(num_chunks, e_bins, dtype=torch.int32, device=dev)
    cursor = torch.empty(num_chunks, e_bins, dtype=torch.int32, device=dev)
    _chunk_count_kernel[(num_chunks,)](topk_ids, chunk_counts, P, E_BINS=e_bins, CHUNK=chunk, num_warps=4)
    _place_kernel[(num_chunks,)](
        topk_ids, chunk_counts, sorted_ids, block_expert, num_padded, cursor, P, num_chunks,
        BM=bm, E_BINS=e_bins, CHUNK=chunk, CHUNKS=triton.next_power_of_2(num_chunks), JB=jb, num_warps=8,
    )  # fmt: skip
    return Alignment(sorted_ids, block_expert, num_padded, bm)
