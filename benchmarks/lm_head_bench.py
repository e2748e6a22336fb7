"""The LM head's GEMM at decode sizes: bf16 weights (float32 logits from the accumulator, as
``ParallelLMHead`` runs it) against fp8 weights with per-row scales and per-token activation
scales (quantization of the hidden state included), on cuBLAS (``torch._scaled_mm``) and on our
Triton kernel. us per call, CUDA-graph replays.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workloads import save_result  # noqa: E402


def replay_us(fn, iters: int = 50) -> float:
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1e3


def main() -> None:
    from minisgl.device.kernels.fp8 import block_matmul, quantize_rows
    from minisgl.device.layers.fp8_gemm import scaled_mm
    from minisgl.device.layers.linear import linear_fp32
    from minisgl.device.layers.quantization import quantize_torch

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", nargs="+", default=["128256x4096", "151936x1024"], metavar="VOCABxHIDDEN")
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 139, 256, 1024])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for shape in args.shapes:
        n, k = map(int, shape.split("x"))
        w = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
        wq, ws = quantize_torch(w)
        ws = ws.view(-1).contiguous()
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row = {"vocab": n, "hidden": k, "rows": m, "bf16_us": replay_us(lambda: linear_fp32(x, w))}

            def cublas(dtype):
                q, s = quantize_rows(x, None)
                return scaled_mm(q, s, wq, ws, dtype)

            for name, dtype in (("fp8_cublas_fp32_us", torch.float32), ("fp8_cublas_bf16_us", torch.bfloat16)):
                try:
                    row[name] = replay_us(lambda: cublas(dtype))
                except RuntimeError as e:
                    row[name] = None
                    print(f"  {name}: {str(e).splitlines()[0]}")
            for cfg in (None, (64, 64, 4, 4), (64, 128, 4, 4), (128, 128, 8, 3), (128, 256, 8, 3)):

                def triton_head():
                    q, s = quantize_rows(x, None)
                    return block_matmul(q, s, wq, ws, None, torch.float32, cfg)

                row[f"fp8_triton_{'auto' if cfg is None else 'x'.join(map(str, cfg))}_us"] = replay_us(triton_head)
            rows.append(row)
            print("  ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
    save_result({"gpu": torch.cuda.get_device_name(), "rows": rows}, args.out, "lm_head")


if __name__ == "__main__":
    main()
