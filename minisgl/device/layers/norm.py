"""RMSNorm in float32 like the reference implementation, optionally fused with the residual add
(one FlashInfer kernel on CUDA, see kernels/fused.py) and with the all-reduce of a row-parallel
layer before it (tensor parallelism, see minisgl.device.distributed). Before an fp8 linear layer it
returns the normalized activation already quantized (``Fp8Act``), fused on CUDA."""

from __future__ import annotations

import torch
from torch import nn

from minisgl.device.distributed import all_reduce_add_rmsnorm
from minisgl.device.kernels.fused import add_rmsnorm, rmsnorm
from minisgl.device.layers.fp8_scheme import Fp8Scheme
from minisgl.device.layers.quantization import Fp8Act, fused, quantize


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, quant: Fp8Scheme | None = None):
        """``quant``: the scheme of the fp8 layer that reads this norm's output, if any."""
        super().__init__()
        self.eps = eps
        self.quant = quant
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, reduce: bool = False
    ) -> torch.Tensor | Fp8Act | tuple[torch.Tensor | Fp8Act, torch.Tensor]:
        """Without ``residual``: norm(x). With it: (norm(x + residual), x + residual), where
        with ``reduce`` x is first summed over the tensor-parallel ranks."""
        if self.quant is not None and not reduce and fused(x):
            from minisgl.device.kernels.fp8 import rmsnorm_quant

            if residual is None:
                return Fp8Act(*rmsnorm_quant(x, None, self.weight, self.eps, self.quant.block), x.dtype)
            residual = residual.contiguous()
            return Fp8Act(*rmsnorm_quant(x, residual, self.weight, self.eps, self.quant.block), x.dtype), residual
        if residual is None:
            out = rmsnorm(x, self.weight, self.eps)
        elif reduce:
            out, residual = all_reduce_add_rmsnorm(x, residual, self.weight, self.eps)
        else:
            out, residual = add_rmsnorm(x, residual, self.weight, self.eps)
        if self.quant is not None:
            out = quantize(out, self.quant.block)
        return out if residual is None else (out, residual)
