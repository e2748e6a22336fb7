"""Temperature sampling in one pass over the logits, in Triton (CUDA only).

The sampler draws from softmax(logits / T) with the exponential race: argmax(p / noise), where
``noise`` is Exp(1) from a hash of (seed, position, token id) (``sampling.sampler``). Taking
logs, that is argmax(logits / T - log(noise)): no softmax, no normalization, one read of each
row. In torch the same step is about ten passes over [B, vocab] float32 tensors (softmax, the
int64 hash, the division, the argmax): at 1024 rows of a 128k vocabulary that was most of a
decode step of a 1B model. Rows that truncate (top-k, top-p, min-p) keep the torch path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048  # vocabulary entries per loop iteration of a row's program


@triton.jit
def _mix32(x):
    """``sampling.sampler._mix32``, step for step on int64 holding values below 2**32."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF  # the product may wrap: its low 32 bits are right
    return x ^ (x >> 16)


@triton.jit
def _race_kernel(
    logits,
    stride,
    rows,
    n_rows,
    shift,
    temperature,
    temperature_stride,
    seed,
    seed_stride,
    greedy,
    greedy_stride,
    out,
    vocab,
    HAS_SHIFT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    slot = tl.load(rows + row)
    position = tl.load(rows + n_rows + row)
    if HAS_SHIFT:
        position += tl.load(shift + row)
    is_greedy = tl.load(greedy + slot * greedy_stride) != 0
    scale = tl.math.div_rn(1.0, tl.load(temperature + slot * temperature_stride).to(tl.float32))
    s = tl.load(seed + slot * seed_stride)
    # sampling.sampler.row_hash: the row's hash of (seed, position)
    base = _mix32((s & 0xFFFFFFFF) ^ _mix32(((s >> 32) + position * 0x9E3779B1) & 0xFFFFFFFF))
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_id = tl.zeros([BLOCK], tl.int32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        live = cols < vocab
        x = tl.load(logits + row.to(tl.int64) * stride + cols, mask=live, other=float("-inf")).to(tl.float32)
        bits = _mix32((base + cols.to(tl.int64) * 0x632BE5AB) & 0xFFFFFFFF) >> 9  # 23 random bits
        uniform = (bits.to(tl.float32) + 0.5) * (1.0 / (1 << 23))
        score = tl.where(is_greedy, x, x * scale - tl.log(-tl.log(uniform)))
        score = tl.where(live, score, float("-inf"))
        better = score > best  # per lane: the first column of each lane's maximum
        best = tl.where(better, score, best)
        best_id = tl.where(better, cols, best_id)
    top = tl.max(best, axis=0)
    first = tl.min(tl.where(best == top, best_id, vocab), axis=0)  # ties: the lowest token id
    tl.store(out + row, first.to(tl.int64))


def race_sample(
    logits: torch.Tensor,
    rows: torch.Tensor,
    shift: torch.Tensor | None,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    greedy: torch.Tensor,
) -> torch.Tensor:
    """Token ids [B] for logits [B, vocab]: row i belongs to slot ``rows[0, i]`` at position
    ``rows[1, i]`` (+ ``shift[i]``) (int64 [2, B], one upload a step), and takes the argmax of
    its logits / temperature - log(noise), the noise drawn from ``sampling.sampler.row_hash`` of
    its slot's seed and its position and the token id; a greedy slot takes the argmax of its
    logits. ``temperature``, ``seed`` and ``greedy`` are per-slot tables (1-D, any stride): the
    whole draw is one launch, where gathering each parameter, hashing and choosing in torch
    were ~30 small launches (~0.6 ms of host time a step on the H100's host)."""
    n, vocab = logits.shape
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n:
        assert logits.stride(1) == 1 and rows.is_contiguous()
        _race_kernel[(n,)](
            logits,
            logits.stride(0),
            rows,
            n,
            rows if shift is None else shift,
            temperature,
            temperature.stride(0),
            seed,
            seed.stride(0),
            greedy,
            greedy.stride(0),
            out,
            vocab,
            HAS_SHIFT=shift is not None,
            BLOCK=BLOCK,
        )
    return out
