"""RMSNorm in float32 like the reference implementation, optionally fused with the residual add
(one FlashInfer kernel on CUDA, see kernels/fused.py) and with the all-reduce of a row-parallel
layer before it (tensor parallelism, see minisgl.distributed)."""

from __future__ import annotations

import torch
from torch import nn

from minisgl.distributed import all_reduce_add_rmsnorm
from minisgl.kernels.fused import add_rmsnorm, rmsnorm


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, reduce: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without ``residual``: norm(x). With it: (norm(x + residual), x + residual), where
        with ``reduce`` x is first summed over the tensor-parallel ranks."""
        if residual is None:
            return rmsnorm(x, self.weight, self.eps)
        if reduce:
            return all_reduce_add_rmsnorm(x, residual, self.weight, self.eps)
        return add_rmsnorm(x, residual, self.weight, self.eps)
