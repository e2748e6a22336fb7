"""Batch-invariant arithmetic for ``--enable-deterministic-inference``.

A request's bits change with what shares its batch wherever a kernel's reduction order follows
the batch's shape: a GEMM picks its blocking by the row count (on the CPU's BLAS a 1-row product
runs as a matrix-vector kernel, 2-3 rows another way again), a softmax over a long row is split
across threads only when it is the only row, and attention reduces a query's keys in an order
set by the padded batch. Here every such reduction is done at a shape that depends on the
request alone: products in fixed tiles of ``TILE`` rows (each tile the same GEMM call, so a
row's result does not depend on the rows beside it), softmaxes one row at a time, and
attention one query at a time over exactly the keys it sees (``TorchBackend``). The engine
calls these only while the mode is on; with it off nothing changes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

TILE = 16  # rows a GEMM call computes (a partial tile is padded with zero rows)

_enabled = False


def enable(on: bool) -> None:
    global _enabled
    _enabled = on


def enabled() -> bool:
    return _enabled


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; in the mode, computed in tiles of ``TILE`` rows."""
    if not _enabled:
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    padded = F.pad(rows, (0, 0, 0, -n % TILE))
    out = torch.cat([F.linear(tile, weight) for tile in padded.split(TILE)])[:n]
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


def rowwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn`` (a reduction along the last dimension) of x [M, V]; in the mode, of each row on its own."""
    if not _enabled or x.shape[0] <= 1:
        return fn(x)
    return torch.cat([fn(row) for row in x.split(1)])


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    return rowwise(lambda r: torch.log_softmax(r, dim=-1), x)


def softmax(x: torch.Tensor) -> torch.Tensor:
    return rowwise(lambda r: torch.softmax(r, dim=-1), x)
