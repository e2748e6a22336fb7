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
def _race_kernel(logits, stride, inv_temp, row_hash, out, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    scale = tl.load(inv_temp + row)
    base = tl.load(row_hash + row)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_id = tl.zeros([BLOCK], tl.int32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        live = cols < vocab
        x = tl.load(logits + row.to(tl.int64) * stride + cols, mask=live, other=float("-inf")).to(tl.float32)
        bits = _mix32((base + cols.to(tl.int64) * 0x632BE5AB) & 0xFFFFFFFF) >> 9  # 23 random bits
        uniform = (bits.to(tl.float32) + 0.5) * (1.0 / (1 << 23))
        score = x * scale - tl.log(-tl.log(uniform))
        score = tl.where(live, score, float("-inf"))
        better = score > best  # per lane: the first column of each lane's maximum
        best = tl.where(better, score, best)
        best_id = tl.where(better, cols, best_id)
    top = tl.max(best, axis=0)
    first = tl.min(tl.where(best == top, best_id, vocab), axis=0)  # ties: the lowest token id
    tl.store(out + row, first.to(tl.int64))


def race_sample(logits: torch.Tensor, temperature: torch.Tensor, row_hash: torch.Tensor) -> torch.Tensor:
    """Token ids [B]: argmax over each row of logits / temperature - log(noise), the noise drawn
    from ``row_hash`` (int64 [B], ``sampling.sampler.row_hash``) and the token id."""
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        inv_temp = (1.0 / temperature).float().contiguous()
        _race_kernel[(rows,)](logits, logits.stride(0), inv_temp, row_hash.contiguous(), out, vocab, BLOCK=BLOCK)
    return out
