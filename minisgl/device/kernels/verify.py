"""A verify step's kept tokens in one launch, in Triton (CUDA only).

After a verify step samples every row, each run (a drafting request's rows: its last token, then
its draft) keeps its rows up to the first whose sample differs from the next row's input; that
row's sample is the request's last token, and the rows after it were rejected. The torch version
(``worker.model_runner.last_verified_torch``, the CPU path and this kernel's reference) takes about ten small
launches a step, which on a host-bound model cost more host time than their GPU work.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _last_verified_kernel(tokens, runs_info, n_rows, n_runs, last_token, rejected, BLOCK: tl.constexpr):
    run = tl.program_id(0)
    start = tl.load(runs_info + n_rows + run)
    end = tl.load(runs_info + n_rows + n_runs + run)
    slot = tl.load(runs_info + n_rows + 2 * n_runs + run)
    row = start + tl.arange(0, BLOCK)
    live = row < end
    sampled = tl.load(tokens + row, mask=live, other=-1)
    following = tl.load(runs_info + row, mask=live, other=-1)  # the next row's input (-1 past the run)
    differs = live & ((sampled != following) | (row == end - 1))
    first = tl.min(tl.where(differs, row, end - 1), axis=0)
    tl.store(last_token + slot, tl.load(tokens + first))
    tl.store(rejected + slot, end - 1 - first)


def last_verified(
    tokens: torch.Tensor,
    runs_info: torch.Tensor,
    runs: int,
    longest: int,
    last_token: torch.Tensor,
    rejected: torch.Tensor,
) -> None:
    """``tokens`` [rows] sampled; ``runs_info`` int64 on the device: each row's following input
    (-1 at a run's last row) [rows], then each run's first row, end and slot [runs] each. Writes
    ``last_token[slot]`` (the run's first differing row's sample) and ``rejected[slot]`` (its rows
    after that one). ``longest``: the most rows a run has."""
    rows = tokens.shape[0]
    if runs:
        block = max(16, triton.next_power_of_2(longest))
        _last_verified_kernel[(runs,)](tokens, runs_info, rows, runs, last_token, rejected, BLOCK=block)
