"""Decode-shaped GEMMs: cuBLAS (torch's F.linear, what the engine runs) against the best of a
sweep of plain Triton matmul configurations, in TFLOP/s, and the time to read the weights once.

    python benchmarks/gemm_bench.py --model benchmarks/configs/llama3.1-8b --batch-sizes 128 256

The linear layers are about half of a decode step at batch 256 on the 8B (gpu_2026-11-22.md,
session 12); this tells whether a kernel of our own could shorten them.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.decode_bench import replay_ms  # noqa: E402
from benchmarks.workloads import save_result  # noqa: E402
from minisgl.checkpoint.model_config import ModelConfig
from minisgl.device.kernels.fp8 import tile


@triton.jit
def _matmul(a_ptr, b_ptr, c_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr):
    """C = A B^T for row-major A [M, K] and B [N, K] (F.linear's layout), tiles in groups of
    ``GROUP`` columns so neighbouring programs share weight tiles in L2."""
    pid_m, pid_n = tile(tl.program_id(0), M, N, BM, BN, GROUP)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    a = a_ptr + rm[:, None] * K + rk[None, :]
    b = b_ptr + rn[:, None] * K + rk[None, :]
    acc = tl.zeros([BM, BN], tl.float32)
    for k in tl.range(0, K, BK):
        x = tl.load(a, mask=rm[:, None] < M, other=0.0)
        w = tl.load(b, mask=rn[:, None] < N, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        a += BK
        b += BK
    tl.store(
        c_ptr + rm[:, None] * N + rn[None, :],
        acc.to(c_ptr.dtype.element_ty),
        mask=(rm[:, None] < M) & (rn[None, :] < N),
    )


def triton_linear(
    x: torch.Tensor, w: torch.Tensor, BM: int, BN: int, BK: int, warps: int, stages: int, group: int = 8
) -> torch.Tensor:
    M, K = x.shape
    N = w.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(M, BM) * triton.cdiv(N, BN),)
    _matmul[grid](x, w, out, M, N, K, BM=BM, BN=BN, BK=BK, GROUP=group, num_warps=warps, num_stages=stages)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[128, 256])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = ModelConfig.from_path(Path(args.model))
    h, i = cfg.hidden_size, cfg.intermediate_size
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    shapes = {"qkv": (qkv, h), "o": (h, cfg.num_heads * cfg.head_dim), "gate_up": (2 * i, h), "down": (h, i)}
    configs = list(itertools.product([64, 128], [64, 128, 256], [64], [4, 8], [3, 4]))
    rows = []
    for bs in args.batch_sizes:
        for name, (n, k) in shapes.items():
            x = torch.randn(bs, k, dtype=torch.bfloat16, device="cuda")
            w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
            flop = 2 * bs * n * k
            t_cublas = replay_ms(lambda: F.linear(x, w))
            best = None
            for BM, BN, BK, warps, stages in configs:
                try:
                    t = replay_ms(lambda: triton_linear(x, w, BM, BN, BK, warps, stages))
                except triton.runtime.errors.OutOfResources:
                    continue
                if best is None or t < best[0]:
                    best = (t, (BM, BN, BK, warps, stages))
            ref = F.linear(x, w).float()
            err = (triton_linear(x, w, *best[1]).float() - ref).abs().max().item()
            print(
                f"batch {bs:4d} {name:8s} N {n:6d} K {k:6d}: cuBLAS {t_cublas * 1e3:7.1f} us "
                f"({flop / t_cublas / 1e9:5.0f} TFLOP/s); triton best {best[0] * 1e3:7.1f} us "
                f"({flop / best[0] / 1e9:5.0f} TFLOP/s) {best[1]} max err {err:.3g}; "
                f"weights at 3 TB/s {n * k * 2 / 3e12 * 1e6:.1f} us",
                flush=True,
            )
            rows.append(
                {
                    "batch": bs,
                    "gemm": name,
                    "n": n,
                    "k": k,
                    "cublas_us": t_cublas * 1e3,
                    "triton_us": best[0] * 1e3,
                    "triton_config": best[1],
                    "weights_3tbs_us": n * k * 2 / 3e6,
                }
            )
    save_result(
        {"model": args.model, "gpu": torch.cuda.get_device_name(), "gemms": rows},
        args.out,
        f"gemm_{Path(args.model).name}",
    )


if __name__ == "__main__":
    main()
