"""Fused elementwise kernels: FlashInfer's on CUDA for 16-bit tensors, torch everywhere else.

A decode step of a Llama layer runs a dozen tiny elementwise ops (norms, residual adds,
SiLU-and-mul); each is a separate launch that reads and writes the activations. FlashInfer
fuses each group into one kernel. The torch versions are the reference (CPU, fp32, tests).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minisgl.device.layers.fp8_scheme import Fp8Scheme
from minisgl.device.layers.quantization import Fp8Act, quantize
from minisgl.device.layers.quantization import fused as fp8_fused
from minisgl.utils import has_module


def _fused(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and has_module("flashinfer")


def rmsnorm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if _fused(x) and x.dim() == 2 and x.is_contiguous():
        import flashinfer

        return flashinfer.norm.rmsnorm(x, weight, eps)
    return rmsnorm_torch(x, weight, eps)


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual), x + residual). The fused path works in place on both inputs."""
    if _fused(x) and x.dim() == 2 and x.is_contiguous() and residual.is_contiguous():
        import flashinfer

        flashinfer.norm.fused_add_rmsnorm(x, residual, weight, eps)
        return x, residual
    residual = x + residual
    return rmsnorm_torch(residual, weight, eps), residual


def silu_and_mul(x: torch.Tensor, quant: Fp8Scheme | None = None) -> torch.Tensor | Fp8Act:
    """x holds [gate | up] along the last dim; returns silu(gate) * up, quantized for an fp8
    layer under ``quant`` (one Triton kernel on CUDA)."""
    if quant is not None:
        if fp8_fused(x) and x.dim() == 2:
            from minisgl.device.kernels.fp8 import quantize_rows

            return Fp8Act(*quantize_rows(x, quant.block, silu=True), x.dtype)
        return quantize(silu_and_mul(x), quant.block)
    if _fused(x) and x.is_contiguous():
        import flashinfer

        return flashinfer.activation.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
