"""Which GEMM runs an fp8 product on the GPU: cuBLAS's row-scaled ``_scaled_mm`` or our Triton
tile, by a table tuned per GPU and weight shape (``kernels/configs/fp8_gemm.json``, written by
``benchmarks/fp8_gemm_tune.py``)."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from minisgl.device.layers import tuned_tables

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


@functools.lru_cache(maxsize=1 << 14)
def tuned_gemm(rows: int, n: int, k: int, gpu: str, chip: str = "") -> tuple[bool, tuple[int, int, int, int] | None]:
    """Whether ``gpu`` (or a GPU of its ``chip``, ``layers.tuned_tables``) has a tuned kernel for
    ``rows`` x weights [n, k], and which: a Triton config for ``kernels.fp8.block_matmul``, or
    None for cuBLAS. Cached: every GEMM of every step asks (eager prefill chunks are host-bound
    on small models)."""
    by_rows = tuned_tables.table(GEMM_CONFIGS_PATH, gpu, chip).get(f"{n}x{k}")
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
