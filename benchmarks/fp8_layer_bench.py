"""One decoder layer's linear work in bf16 and in FP8 (W8A8), quantization included, per batch size.

    python benchmarks/fp8_layer_bench.py --model benchmarks/configs/llama3.1-8b --batch-sizes 256 8192

For each batch, microseconds per layer (CUDA-graph replay) of:
  bf16 gemms      qkv + o + gate_up + down, cuBLAS (F.linear)
  bf16 layer ops  the same plus what feeds them: add+RMSNorm twice, SiLU-and-mul (FlashInfer)
  fp8 gemms       the four torch._scaled_mm (row-wise scales) on pre-quantized inputs
  fp8 layer ops   the GEMMs fed by our fused kernels: add+RMSNorm+quant twice, quant of the
                  attention output, SiLU-and-mul+quant (what the engine runs)
  fp8 block       the same with 128-column groups (block-wise checkpoints), our Triton GEMM
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.decode_bench import replay_ms  # noqa: E402
from benchmarks.workloads import save_result  # noqa: E402
from minisgl.checkpoint.model_config import ModelConfig
from minisgl.device.kernels.fp8 import quantize_rows
from minisgl.device.kernels.fused import add_rmsnorm, silu_and_mul
from minisgl.device.layers.fp8_scheme import Fp8Scheme
from minisgl.device.layers.norm import RMSNorm
from minisgl.device.layers.quantization import fp8_linear, quantize, quantize_weight

TRITON_CONFIGS = [
    (16, 64, 4, 3),
    (32, 64, 4, 4),
    (64, 64, 4, 4),
    (64, 128, 4, 4),
    (128, 128, 8, 3),
    (128, 256, 8, 3),
    (64, 256, 8, 4),
]  # (BM, BN, warps, stages)


def layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    i = cfg.intermediate_size
    return {
        "qkv": (qkv, cfg.hidden_size),
        "o": (cfg.hidden_size, cfg.num_heads * cfg.head_dim),
        "gate_up": (2 * i, cfg.hidden_size),
        "down": (cfg.hidden_size, i),
    }


def run(cfg: ModelConfig, batch: int) -> dict:
    dev, bf16 = "cuda", torch.bfloat16
    shapes = layer_shapes(cfg)
    h = cfg.hidden_size
    w = {n: torch.randn(s, dtype=bf16, device=dev) * 0.02 for n, s in shapes.items()}
    x = torch.randn(batch, h, dtype=bf16, device=dev)
    res = torch.randn(batch, h, dtype=bf16, device=dev)
    attn = torch.randn(batch, shapes["o"][1], dtype=bf16, device=dev)
    norm_w = torch.ones(h, dtype=bf16, device=dev)
    out = {"batch": batch}

    def bf16_gemms():
        F.linear(x, w["qkv"]), F.linear(attn, w["o"])
        F.linear(silu_and_mul(F.linear(x, w["gate_up"])), w["down"])

    def bf16_layer():  # FlashInfer's fused add+RMSNorm works in place, as in the engine
        y, _ = add_rmsnorm(x, res, norm_w, 1e-5)
        F.linear(y, w["qkv"])
        o = F.linear(attn, w["o"])
        y, _ = add_rmsnorm(o, res, norm_w, 1e-5)
        F.linear(silu_and_mul(F.linear(y, w["gate_up"])), w["down"])

    out["bf16_gemms_us"] = replay_ms(bf16_gemms) * 1e3
    out["bf16_layer_us"] = replay_ms(bf16_layer) * 1e3
    for label, block in (("fp8", None), ("fp8_block", 128)):
        scheme = Fp8Scheme(block=block)
        qw = {n: quantize_weight(t, block) for n, t in w.items()}
        norm = RMSNorm(h, 1e-5, scheme).to(dev)
        norm.weight.data = norm_w
        acts = {
            "qkv": quantize(x, block),
            "o": quantize(attn, block),
            "gate_up": quantize(x, block),
            "down": quantize(torch.randn(batch, shapes["down"][1], dtype=bf16, device=dev), block),
        }

        def gemms():
            for n, (wq, ws) in qw.items():
                fp8_linear(acts[n], wq, ws, None, block)

        def layer():
            a, _ = norm(x, res)
            fp8_linear(a, *qw["qkv"], None, block)
            o = fp8_linear(attn, *qw["o"], None, block)
            a, _ = norm(o, res)
            gu = fp8_linear(a, *qw["gate_up"], None, block)
            fp8_linear(silu_and_mul(gu, scheme), *qw["down"], None, block)

        out[f"{label}_gemms_us"] = replay_ms(gemms) * 1e3
        if block is None:  # our Triton kernel on the per-channel GEMMs, by tile configuration
            from minisgl.device.kernels.fp8 import block_matmul

            for config in TRITON_CONFIGS:

                def triton_gemms(config=config):
                    for n, (wq, ws) in qw.items():
                        block_matmul(acts[n].data, acts[n].scale, wq, ws, None, bf16, config)

                try:
                    out[f"fp8_triton_{'x'.join(map(str, config))}_us"] = replay_ms(triton_gemms) * 1e3
                except Exception as e:  # noqa: BLE001 - a configuration that does not fit is skipped
                    print(f"config {config}: {type(e).__name__}")
        out[f"{label}_layer_us"] = replay_ms(layer) * 1e3
        if block is None:  # the fused quantizers alone, against the bf16 ops they replace
            gate_up = torch.randn(batch, shapes["gate_up"][0], dtype=bf16, device=dev)
            out["bf16_add_rmsnorm_us"] = replay_ms(lambda: add_rmsnorm(x, res, norm_w, 1e-5)) * 1e3
            out["bf16_silu_and_mul_us"] = replay_ms(lambda: silu_and_mul(gate_up)) * 1e3
            out["fp8_add_rmsnorm_quant_us"] = replay_ms(lambda: norm(x, res)) * 1e3
            for chunk, warps in ((None, None), (1024, 4), (2048, 8), (16384, 8), (16384, 32)):
                out[f"fp8_silu_quant_{chunk}_{warps}_us"] = (
                    replay_ms(lambda: quantize_rows(gate_up, None, True, chunk, warps)) * 1e3
                )
                out[f"fp8_quant_{chunk}_{warps}_us"] = (
                    replay_ms(lambda: quantize_rows(attn, None, False, chunk, warps)) * 1e3
                )
        # Accuracy of the whole chain against bf16 on the same inputs (relative error of qkv).
        ref = F.linear(x, w["qkv"]).float()
        got = fp8_linear(quantize(x, block), *qw["qkv"], None, block).float()
        out[f"{label}_qkv_rel_err"] = ((got - ref).norm() / ref.norm()).item()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a folder with config.json")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[256, 8192])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = ModelConfig.from_path(Path(args.model))
    rows = []
    for batch in args.batch_sizes:
        row = run(cfg, batch)
        rows.append(row)
        print(" ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
    save_result(
        {"model": args.model, "gpu": torch.cuda.get_device_name(), "rows": rows},
        args.out,
        f"fp8_layer_{Path(args.model).name}",
    )


if __name__ == "__main__":
    main()
