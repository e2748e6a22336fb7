"""FP8 (e4m3) weights and activations: the scheme, the quantizers and the GEMM.

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

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from minisgl.args import KV_CACHE_DTYPES, QUANTIZATIONS
from minisgl.utils import has_module

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_SCALE = 1e-12  # an all-zero row (padding) still gets a finite scale


# Per-channel GEMMs on a GPU and shape that the tuned table below lacks: small weights at decode
# sizes take our Triton kernel in 64 x 64 tiles: cuBLAS picks one 128 x 128 row-scaled kernel for
# every shape, slower than bf16 on Qwen3-0.6B's layer (qkv + o + gate_up + down: 29.8 / 30.2 /
# 31.6 us at batch 16 / 64 / 256, against bf16's 20.8 / 24.9 / 34.5 and Triton's 18.7 / 18.7 /
# 24.9). On the 8B's large weights cuBLAS is as fast or faster (134 against 159 us at 256).
# fp8_layer_triton_*_h100.json.
SMALL_GEMM_ROWS = 512
SMALL_GEMM_WEIGHTS = 8 << 20
SMALL_GEMM_CONFIG = (64, 64, 4, 4)  # BM, BN, warps, stages
# Per-channel GEMMs at decode sizes pick their kernel from a table tuned per GPU
# (benchmarks/fp8_gemm_tune.py): for weights [N, K] and the smallest bucket holding the rows, a
# Triton tile (BM, BN, warps, stages) or null for cuBLAS; larger batches are cuBLAS's. On the
# H100 the 8B's four GEMMs at 64 rows take 103.5 us against cuBLAS's 117, at 256 129.7 against
# 134; offline 8B random with fp8 weights + KV went from 12.06 to 11.67 s (fp8_2026-11-24.md).
GEMM_CONFIGS_PATH = Path(__file__).parents[1] / "kernels" / "configs" / "fp8_gemm.json"
GEMM_ROW_BUCKETS = (16, 32, 64, 128, 192, 256, 384, 512)


@functools.cache
def _gemm_table(gpu: str) -> dict[str, dict[str, list[int] | None]]:
    tables = json.loads(GEMM_CONFIGS_PATH.read_text()) if GEMM_CONFIGS_PATH.exists() else {}
    return tables.get(gpu, {})


@functools.cache
def gpu_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


@functools.lru_cache(maxsize=1 << 14)
def tuned_gemm(rows: int, n: int, k: int, gpu: str) -> tuple[bool, tuple[int, int, int, int] | None]:
    """Whether ``gpu`` has a tuned kernel for ``rows`` x weights [n, k], and which: a Triton
    config for ``kernels.fp8.block_matmul``, or None for cuBLAS. Cached: every GEMM of every
    step asks (eager prefill chunks are host-bound on small models)."""
    by_rows = _gemm_table(gpu).get(f"{n}x{k}")
    if by_rows is None or rows > GEMM_ROW_BUCKETS[-1]:
        return False, None
    bucket = next(b for b in GEMM_ROW_BUCKETS if b >= rows)
    if str(bucket) not in by_rows:
        return False, None
    config = by_rows[str(bucket)]
    return True, None if config is None else tuple(config)


def scaled_mm(
    a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """cuBLAS's row-scaled fp8 GEMM: a [M, K] (scales [M, 1]) times w [N, K] (scales [N]).

    With fast accumulation, as vLLM's and SGLang's CUTLASS fp8 kernels and our Triton kernel
    (Triton's default on Hopper) accumulate: the error against exact float32 sums is that of
    the Triton kernel to three digits (0.21% of the product's norm at K = 4096, 0.33% at 14336;
    fp8 rounding of the inputs is ten times that), and the 8B's gate_up takes 57 us instead of
    67 at 256 rows, 1433 instead of 1628 at 8192 (H100, fp8_fast_accum_h100.json)."""
    return torch._scaled_mm(
        a, w.t(), scale_a=a_scale, scale_b=w_scale.view(1, -1), out_dtype=out_dtype, use_fast_accum=True
    )


# The fp8 LM head (8B's 128256 x 4096, us with quantization, float32 logits; lm_head_*_h100.json):
# our Triton kernel below this many rows (139 rows: 268 against cuBLAS's 374; bf16 418), cuBLAS
# from it on (256: 274 against 307; bf16 458).
LOGITS_TRITON_ROWS = 192


@dataclass(frozen=True)
class Fp8Scheme:
    """How a model's linear layers are quantized. ``block``: input columns per weight scale and
    per activation scale (None: one scale per output channel and one per token). ``source``
    names where the weights come from, for logs: "online" or the checkpoint format."""

    block: int | None = None
    source: str = "online"


class Fp8Act(NamedTuple):
    """An activation already quantized by the op that produced it: ``data`` fp8 [T, K], ``scale``
    float32 [T, 1] or [T, K / block]; ``dtype`` the model dtype the GEMM returns."""

    data: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype


def parse_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """SGLang's ``--kv-cache-dtype`` names: auto (the model dtype), fp8_e4m3, bf16/bfloat16."""
    if name == "auto":
        return model_dtype
    if name == "fp8_e4m3":
        return FP8
    if name in ("bf16", "bfloat16"):
        return torch.bfloat16
    raise ValueError(f"--kv-cache-dtype {name!r} is not supported ({', '.join(KV_CACHE_DTYPES)})")


def quantization_scheme(quant_config: dict[str, Any] | None, requested: str | None) -> Fp8Scheme | None:
    """The scheme of a checkpoint's ``quantization_config`` (compressed-tensors float 8-bit with
    dynamic per-token activations; "fp8" per tensor/channel or with 128 x 128 blocks), or the
    online one ``--quantization fp8`` asks for. Anything else is refused by name."""
    if requested is not None and requested not in QUANTIZATIONS:
        raise ValueError(f"--quantization {requested!r} is not supported ({', '.join(QUANTIZATIONS)})")
    if not quant_config:
        return Fp8Scheme() if requested else None
    method = quant_config.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(quant_config)
    if method == "fp8":
        if quant_config.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError("fp8 checkpoints with static activation scales are not supported (dynamic only)")
        block = quant_config.get("weight_block_size")
        if block is None:
            return Fp8Scheme(source="fp8")
        if len(block) != 2 or block[0] != block[1]:
            raise ValueError(f"fp8 weight_block_size {block} is not supported (square blocks only)")
        return Fp8Scheme(block=int(block[0]), source=f"fp8 {block[0]}x{block[1]} blocks")
    raise ValueError(f"checkpoint quantization {method!r} is not supported (fp8, compressed-tensors float8)")


def _compressed_tensors_scheme(quant_config: dict[str, Any]) -> Fp8Scheme:
    groups = list((quant_config.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise ValueError(f"compressed-tensors: one config group supported, the checkpoint has {len(groups)}")
    weights, acts = groups[0].get("weights") or {}, groups[0].get("input_activations") or {}
    if weights.get("type") != "float" or weights.get("num_bits") != 8:
        raise ValueError(
            f"compressed-tensors weights {weights.get('type')}{weights.get('num_bits')} are not supported (float 8-bit)"
        )
    if weights.get("strategy") not in ("channel", "tensor"):
        raise ValueError(
            f"compressed-tensors weight strategy {weights.get('strategy')!r} is not supported (channel, tensor)"
        )
    if not acts or acts.get("type") != "float" or acts.get("num_bits") != 8 or not acts.get("dynamic"):
        raise ValueError("compressed-tensors: only dynamic float 8-bit input activations are supported")
    ignored = [name for name in quant_config.get("ignore", []) if "lm_head" not in name]
    if ignored:
        raise ValueError(f"compressed-tensors: layers left unquantized besides lm_head are not supported: {ignored}")
    return Fp8Scheme(source="compressed-tensors")


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
        from minisgl.kernels.fp8 import quantize_rows

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
            from minisgl.kernels.fp8 import block_matmul

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
) -> torch.Tensor:
    """x W^T + b for an fp8 ``weight`` [N, K] with per-row ``scale`` ([N] or [N, K / block])."""
    act = x if isinstance(x, Fp8Act) else quantize(x.reshape(-1, x.shape[-1]), block)
    lead = x.shape[:-1] if isinstance(x, torch.Tensor) else act.data.shape[:-1]
    if act.data.is_cuda and act.dtype in (torch.float16, torch.bfloat16) and act.data.shape[0] > 0:
        from minisgl.kernels.fp8 import block_matmul

        if block is not None:
            out = block_matmul(act.data, act.scale, weight, scale, block, act.dtype)
        else:
            rows = act.data.shape[0]
            tuned, config = tuned_gemm(rows, *weight.shape, gpu_name(act.data.device.index))
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
        out = (dequantize(act.data, act.scale, block) @ dequantize(weight, scale, block).t()).to(act.dtype)
    if bias is not None:
        out = out + bias
    return out if len(lead) == 1 else out.view(*lead, weight.shape[0])
