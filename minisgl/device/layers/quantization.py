"""FP8 (e4m3) weights and activations: the quantizers and the fp8 linear op (the scheme a model
asks for is ``layers.fp8_scheme``'s, which GEMM runs a product ``layers.fp8_gemm``'s).

A linear layer under ``Fp8Scheme`` keeps its weight in float8_e4m3fn with float32 scales held
per output row: one per row (``block`` None: per output channel, as ``--quantization fp8`` makes
at load and compressed-tensors "FP8-dynamic" checkpoints ship), or one per row and group of
``block`` input columns (block-wise checkpoints, e.g. Qwen3's ``-FP8``, whose 128 x 128 weight
blocks are stored here repeated over their rows, so fused and sharded layers cut scales exactly
as they cut weights). Activations are quantized as they arrive, per token (or per token and
group of ``block`` columns) with scale amax / 448.

On CUDA in 16-bit models the quantizers are fused Triton kernels (``kernels.fp8``: with the
RMSNorm or SiLU-and-mul that produces a GEMM's input, so quantizing costs no extra pass) and the
GEMM is ``torch._scaled_mm`` (per channel, ``scaled_mm``) or our Triton kernel. Everywhere else
the torch functions here are the reference: the same rounding, dequantized products in float32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from minisgl.device.layers import tuned_tables
from minisgl.device.layers.fp8_gemm import (
    LOGITS_TRITON_ROWS,
    SMALL_GEMM_CONFIG,
    SMALL_GEMM_ROWS,
    SMALL_GEMM_WEIGHTS,
    scaled_mm,
    tuned_gemm,
)
from minisgl.utils import has_module

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_SCALE = 1e-12  # an all-zero row (padding) still gets a finite scale


class Fp8Act(NamedTuple):
    """An activation already quantized by the op that produced it: ``data`` fp8 [T, K], ``scale``
    float32 [T, 1] or [T, K / block]; ``dtype`` the model dtype the GEMM returns."""

    data: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype


# ---- reference quantizers (CPU, float32 models, tests) ------------------------------------------


def to_fp8(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """x / scale in e4m3, saturated to its range (a plain cast overflows to NaN on some builds)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def _grouped(x: torch.Tensor, block: int | None) -> torch.Tensor:
    """x [R, K] as float32 [R, groups, width], zero-padded to whole groups."""
    x = x.float()
    if block is None:
        return x.unsqueeze(1)
    pad = -x.shape[-1] % block
    return F.pad(x, (0, pad)).view(x.shape[0], -1, block)


def quantize_torch(x: torch.Tensor, block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of x [R, K] to fp8 with one scale per row ([R, 1]) or per row and ``block`` columns
    ([R, ceil(K / block)]): scale = amax / 448, q = x / scale."""
    g = _grouped(x, block)
    scale = (g.abs().amax(-1) / FP8_MAX).clamp(min=MIN_SCALE)
    q = to_fp8(g, scale.unsqueeze(-1))
    return q.flatten(1)[:, : x.shape[1]].contiguous(), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """float32 values of ``quantize_torch``'s output; ``scale`` [R], [R, 1] or [R, groups]."""
    scale = scale.float().reshape(q.shape[0], -1)
    if block is not None:
        scale = scale.repeat_interleave(block, dim=1)[:, : q.shape[1]]
    return q.float() * scale


def quantize_blocks(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [N, K] in ``block`` x ``block`` tiles, one scale each ([ceil(N/b), ceil(K/b)]), as
    block-wise checkpoints store them (the scale named ``weight_scale_inv``, a multiplier)."""
    n, k = w.shape
    tiles = F.pad(w.float(), (0, -k % block, 0, -n % block))
    tiles = tiles.view(tiles.shape[0] // block, block, -1, block)
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=MIN_SCALE)
    q = to_fp8(tiles, scale[:, None, :, None])
    return q.flatten(2).flatten(0, 1)[:n, :k].contiguous(), scale


def row_scales(scale: torch.Tensor, rows: int, block: int | None) -> torch.Tensor:
    """A checkpoint's weight scale as our per-row form: [rows] per channel (from [rows, 1],
    [rows] or one per-tensor value), or [rows, groups] (from [ceil(rows / block), groups] tiles)."""
    scale = scale.float()
    if block is not None:
        return scale.repeat_interleave(block, dim=0)[:rows]
    if scale.numel() == 1:
        return scale.reshape(1).expand(rows).clone()
    return scale.reshape(rows)


def quantize_weight(w: torch.Tensor, block: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [N, K] as (fp8, per-row scales) in the layer's form: per output channel,
    or in ``block`` x ``block`` tiles repeated over their rows."""
    if block is None:
        q, scale = quantize_torch(w)
        return q, scale.view(-1)
    q, tiles = quantize_blocks(w, block)
    return q, row_scales(tiles, w.shape[0], block)


# ---- dispatch -----------------------------------------------------------------------------------


def fused(x: torch.Tensor) -> bool:
    """Whether x takes the CUDA kernels: 16-bit activations on a GPU with Triton."""
    return x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and has_module("triton")


def quantize(x: torch.Tensor, block: int | None) -> Fp8Act:
    """An activation [T, K] quantized per token (or token and group)."""
    if fused(x):
        from minisgl.device.kernels.fp8 import quantize_rows

        q, scale = quantize_rows(x, block)
    else:
        q, scale = quantize_torch(x, block)
    return Fp8Act(q, scale, x.dtype)


def fp8_logits(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x W^T in float32 for an fp8 ``weight`` [V, K] with per-row ``scale`` [V] (the LM head):
    x quantized per token, the product kept in the GEMM's float32 accumulator."""
    x2 = x.reshape(-1, x.shape[-1])
    act = quantize(x2, None)
    if fused(x2) and x2.shape[0] > 0:
        if x2.shape[0] < LOGITS_TRITON_ROWS or weight.shape[0] % 16:  # cuBLAS wants whole 16-row groups
            from minisgl.device.kernels.fp8 import block_matmul

            out = block_matmul(act.data, act.scale, weight, scale, None, torch.float32)
        else:
            out = scaled_mm(act.data, act.scale, weight, scale, torch.float32)
    else:
        out = dequantize(act.data, act.scale) @ dequantize(weight, scale).t()
    return out.view(*x.shape[:-1], weight.shape[0])


def fp8_linear(
    x: torch.Tensor | Fp8Act,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    block: int | None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x W^T + b for an fp8 ``weight`` [N, K] with per-row ``scale`` ([N] or [N, K / block]),
    in ``out_dtype`` (default: the activation's; float32 keeps the GEMM's accumulator)."""
    act = x if isinstance(x, Fp8Act) else quantize(x.reshape(-1, x.shape[-1]), block)
    lead = x.shape[:-1] if isinstance(x, torch.Tensor) else act.data.shape[:-1]
    if act.data.is_cuda and act.dtype in (torch.float16, torch.bfloat16) and act.data.shape[0] > 0:
        from minisgl.device.kernels.fp8 import block_matmul

        if block is not None or out_dtype is not None:
            out = block_matmul(act.data, act.scale, weight, scale, block, out_dtype or act.dtype)
        else:
            rows = act.data.shape[0]
            tuned, config = tuned_gemm(rows, *weight.shape, *tuned_tables.gpu(act.data.device.index))
            if not tuned and rows <= SMALL_GEMM_ROWS and weight.numel() <= SMALL_GEMM_WEIGHTS:
                config = SMALL_GEMM_CONFIG
            if config is not None:
                out = block_matmul(act.data, act.scale, weight, scale, None, act.dtype, config)
            else:
                # Row-wise scaling writes bf16 (or float32, as fp8_logits asks), not fp16: fp16 models take one cast.
                out = scaled_mm(act.data, act.scale, weight, scale, torch.bfloat16)
                if act.dtype != torch.bfloat16:
                    out = out.to(act.dtype)
    else:
        out = (dequantize(act.data, act.scale, block) @ dequantize(weight, scale, block).t()).to(out_dtype or act.dtype)
    if bias is not None:
        out = out + bias
    return out if len(lead) == 1 else out.view(*lead, weight.shape[0])
