"""Tune the per-channel FP8 GEMM at decode sizes for this GPU.

    python benchmarks/fp8_gemm_tune.py --models benchmarks/configs/llama3.1-8b benchmarks/configs/qwen3-0.6b

cuBLAS picks one 128 x 128 row-scaled kernel for every shape, which leaves SMs idle at decode
batch sizes (8B o_proj at 64 rows: 13.1 us against our Triton kernel's 7.8 in 64 x 64 tiles), while
at 256 rows and more it is often the fastest. For each linear shape of the given models (and
their tensor-parallel shards) and each row bucket of ``layers.fp8_gemm.GEMM_ROW_BUCKETS``,
this times cuBLAS (``torch._scaled_mm``) and the Triton kernel in each candidate tile, and writes
the fastest per bucket into ``minisgl/device/kernels/configs/fp8_gemm.json`` under this GPU's name,
which ``fp8_linear`` reads (shapes or GPUs missing there keep the size rule). The timings go to
benchmarks/results.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.decode_bench import replay_ms  # noqa: E402
from benchmarks.fp8_layer_bench import layer_shapes  # noqa: E402
from benchmarks.workloads import save_result  # noqa: E402
from minisgl.checkpoint.model_config import ModelConfig
from minisgl.device.kernels.fp8 import block_matmul
from minisgl.device.layers import tuned_tables
from minisgl.device.layers.fp8_gemm import GEMM_CONFIGS_PATH, GEMM_ROW_BUCKETS, scaled_mm

CANDIDATES = [  # BM, BN, warps, stages
    (16, 64, 4, 6),
    (32, 64, 4, 6),
    (64, 64, 4, 4),
    (64, 64, 4, 6),
    (64, 128, 4, 4),
    (128, 64, 4, 4),
    (128, 64, 4, 6),
    (128, 128, 8, 3),
    (128, 128, 8, 4),
]


def shapes(models: list[str], tp_sizes: list[int]) -> set[tuple[int, int]]:
    """(N, K) of every linear layer of ``models``, whole and as each tp rank holds it."""
    out = set()
    for model in models:
        for name, (n, k) in layer_shapes(ModelConfig.from_path(Path(model))).items():
            for tp in tp_sizes:  # qkv and gate_up split their outputs, o and down their inputs
                out.add((n // tp, k) if name in ("qkv", "gate_up") else (n, k // tp))
    return out


def tune(n: int, k: int) -> tuple[dict[str, list[int] | None], list[dict]]:
    """The fastest kernel per row bucket for weights [n, k] (None: cuBLAS), and every timing."""
    w = (torch.randn(n, k, device="cuda") * 0.5).to(torch.float8_e4m3fn)
    w_scale = torch.rand(n, device="cuda") + 0.5
    best, rows = {}, []
    for m in GEMM_ROW_BUCKETS:
        x = (torch.randn(m, k, device="cuda") * 0.5).to(torch.float8_e4m3fn)
        x_scale = torch.rand(m, 1, device="cuda") + 0.5
        ref = scaled_mm(x, x_scale, w, w_scale, torch.bfloat16)
        times = {"cublas": replay_ms(lambda: scaled_mm(x, x_scale, w, w_scale, torch.bfloat16)) * 1e3}
        for config in CANDIDATES:
            if config[0] > 2 * m and config[0] > 16:  # tiles mostly empty rows
                continue
            out = block_matmul(x, x_scale, w, w_scale, None, torch.bfloat16, config)
            torch.testing.assert_close(out.float(), ref.float(), atol=0.05 * ref.abs().max().item(), rtol=0.02)
            times[str(list(config))] = (
                replay_ms(lambda: block_matmul(x, x_scale, w, w_scale, None, torch.bfloat16, config)) * 1e3
            )
        fastest = min(times, key=times.get)
        best[str(m)] = None if fastest == "cublas" else json.loads(fastest)
        rows.append({"n": n, "k": k, "m": m, "us": times, "fastest": fastest})
        print(
            f"  {n} x {k}, {m} rows: cuBLAS {times['cublas']:.1f} us, fastest {fastest} {times[fastest]:.1f} us",
            flush=True,
        )
    return best, rows


def table_text(table: dict[str, dict[str, dict[str, list[int] | None]]]) -> str:
    """The table as JSON, one line per GPU and weight shape (buckets in row order)."""

    def shape_key(shape: str) -> tuple[int, ...]:
        return tuple(map(int, shape.split("x")))

    gpus = []
    for gpu in sorted(table):
        lines = [
            f"  {json.dumps(shape)}: {json.dumps(dict(sorted(rows.items(), key=lambda kv: int(kv[0]))))}"
            for shape, rows in sorted(table[gpu].items(), key=lambda kv: shape_key(kv[0]))
        ]
        gpus.append(f" {json.dumps(gpu)}: {{\n" + ",\n".join(lines) + "\n }")
    return "{\n" + ",\n".join(gpus) + "\n}\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", required=True, help="folders with config.json")
    ap.add_argument("--tp-sizes", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--table", default=str(GEMM_CONFIGS_PATH), help="the JSON to merge this GPU's choices into")
    ap.add_argument("--out", default=None, help="timings JSON (default: benchmarks/results/fp8_gemm_tune_<gpu>.json)")
    args = ap.parse_args()
    gpu = torch.cuda.get_device_name()
    table_path = Path(args.table)
    table = json.loads(table_path.read_text()) if table_path.exists() else {}
    ours = table.setdefault(gpu, {})
    timings = []
    for n, k in sorted(shapes(args.models, args.tp_sizes)):
        ours[f"{n}x{k}"], rows = tune(n, k)
        timings += rows
    table_path.parent.mkdir(parents=True, exist_ok=True)
    table_path.write_text(table_text(table))
    tuned_tables.record_chip(0)
    print(f"wrote {table_path}")
    save_result(
        {"gpu": gpu, "models": args.models, "rows": timings},
        args.out,
        f"fp8_gemm_tune_{gpu.split()[1].lower() if ' ' in gpu else gpu}",
    )


if __name__ == "__main__":
    main()
