"""Fused elementwise kernels: FlashInfer's on CUDA for 16-bit tensors, torch everywhere else.

A decode step of a Llama layer runs a dozen tiny elementwise ops (norms, residual adds,
SiLU-and-mul); each is a separate launch that reads and writes the activations. FlashInfer
fuses each group into one kernel. The torch versions are the reference (CPU, fp32, tests).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


@functools.cache
def _flashinfer_available() -> bool:
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True


def _fused(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and _flashinfer_available()


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


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x holds [gate | up] along the last dim; returns silu(gate) * up."""
    if _fused(x) and x.is_contiguous():
        import flashinfer

        return flashinfer.activation.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
