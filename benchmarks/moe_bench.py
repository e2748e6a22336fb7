"""The fused MoE layer against its floor, and the tuning of its tiles.

    python benchmarks/moe_bench.py --model benchmarks/configs/qwen3-30b-a3b            # time
    python benchmarks/moe_bench.py --model benchmarks/configs/qwen3-30b-a3b --tune     # tune, then time
    python benchmarks/moe_bench.py --tune --tokens 256 1024   # those buckets only (others kept)

One sparse layer's experts (alignment, both grouped GEMMs, SiLU-and-mul, the weighted sum; the
router excluded), replayed from a CUDA graph with uniformly random routing, at batch 1, 16, 64,
256, 1024 and an 8192-token prefill chunk, in bf16, fp8 per channel and fp8 in 128-column
groups. The floor is the bytes of the experts the batch activates, each read once, over the
GPU's read bandwidth (a sum over 2 GiB). ``--tune`` times each GEMM in every candidate tile per
token bucket and writes the fastest into ``minisgl/device/kernels/configs/moe.json`` under this GPU's
name (``kernels.moe.moe_config`` reads it).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.decode_bench import replay_ms  # noqa: E402
from benchmarks.workloads import save_result  # noqa: E402
from minisgl.checkpoint.model_config import ModelConfig
from minisgl.device.kernels import moe as kmoe
from minisgl.device.layers import tuned_tables
from minisgl.device.layers.fp8_scheme import Fp8Scheme
from minisgl.device.layers.moe import FusedMoE, route
from minisgl.device.layers.quantization import FP8, quantize

SIZES = [1, 16, 64, 256, 1024, 8192]
TUNE_SIZES = [1, 16, 64, 256, 1024, 4096]
KINDS = {"bf16": None, "fp8": Fp8Scheme(None, "bench"), "fp8-b128": Fp8Scheme(128, "bench")}


def read_bandwidth(nbytes: int = 2 << 30) -> float:
    """Bytes/s a reduction streams from device memory."""
    x = torch.ones(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    return nbytes / (replay_ms(lambda: x.sum(), iters=10) / 1e3)


def dummy_moe(cfg: ModelConfig, quant: Fp8Scheme | None) -> FusedMoE:
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        moe = FusedMoE(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size, quant)
    torch.set_default_dtype(torch.float32)
    for w, s in ((moe.w13_weight, moe.w13_weight_scale), (moe.w2_weight, moe.w2_weight_scale)):
        if quant is None:
            w.data.normal_(0, 0.02)
        else:
            w.data.copy_(torch.empty(w.shape, device="cuda", dtype=torch.bfloat16).normal_(0, 1).to(FP8))
            s.data.fill_(0.02)
    return moe


def routing(tokens: int, cfg: ModelConfig, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(tokens, cfg.num_experts, device="cuda", generator=gen)
    return route(logits, cfg.num_experts_per_tok, cfg.norm_topk_prob)


def floor_us(moe: FusedMoE, ids: torch.Tensor, bandwidth: float) -> float:
    per_expert = moe.w13_weight[0].numel() * moe.w13_weight.element_size()
    per_expert += moe.w2_weight[0].numel() * moe.w2_weight.element_size()
    return ids.unique().numel() * per_expert / bandwidth * 1e6


def breakdown(moe: FusedMoE, x, w, ids, config: kmoe.MoeConfig) -> dict[str, float]:
    """Microseconds of each launch of ``kmoe.fused_experts``, each replayed alone."""
    quant, k, P = moe.quant, moe.top_k, ids.numel()
    group = None if quant is None else quant.block
    silu = config.silu  # SiLU-and-mul inside the first GEMM
    alignment = kmoe.align(ids, moe.num_experts, config.bm)
    act = x if quant is None else quantize(x, group)

    def first() -> torch.Tensor:
        scale = moe.w13_weight_scale
        return kmoe._gemm(act, moe.w13_weight, scale, alignment, P, k, x.dtype, config.up, None, group, silu)

    gate_up = first()
    mid = kmoe.mid_activation(gate_up, quant, silu)
    out = kmoe._gemm(mid, moe.w2_weight, moe.w2_weight_scale, alignment, P, 1, x.dtype, config.down, w, group)
    parts = {
        "align": lambda: kmoe.align(ids, moe.num_experts, config.bm),
        "quantize": (lambda: quantize(x, group)) if quant is not None else None,
        "up": first,
        # SiLU-and-mul (fp8: quantizing), or fp8's quantization of what the first GEMM's SiLU made
        "silu" if not silu else "quantize_mid": (
            (lambda: kmoe.mid_activation(gate_up, quant, silu)) if not silu or quant is not None else None
        ),
        "down": lambda: kmoe._gemm(
            mid, moe.w2_weight, moe.w2_weight_scale, alignment, P, 1, x.dtype, config.down, w, group
        ),
        "sum": lambda: kmoe.sum_rows(out, k),
    }
    return {name: replay_ms(fn, iters=10) * 1e3 for name, fn in parts.items() if fn is not None}


def table_json(tables: dict) -> str:
    """The tile table with one line per token bucket."""
    lines = ["{"]
    for g, gpu in enumerate(sorted(tables)):
        lines.append(f" {json.dumps(gpu)}: {{")
        shapes = sorted(tables[gpu])
        for s, shape in enumerate(shapes):
            lines.append(f"  {json.dumps(shape)}: {{")
            buckets = sorted(tables[gpu][shape], key=int)
            for b, bucket in enumerate(buckets):
                comma = "," if b < len(buckets) - 1 else ""
                lines.append(f"   {json.dumps(bucket)}: {json.dumps(tables[gpu][shape][bucket])}{comma}")
            lines.append("  }" + ("," if s < len(shapes) - 1 else ""))
        lines.append(" }" + ("," if g < len(tables) - 1 else ""))
    return "\n".join(lines + ["}"]) + "\n"


def timed(fn, candidates: list[kmoe.GemmConfig]) -> dict[kmoe.GemmConfig, float]:
    """Milliseconds of ``fn(config)`` per candidate that fits the GPU (too much shared memory: skipped)."""
    times = {}
    for c in candidates:
        try:
            times[c] = replay_ms(lambda c=c: fn(c), iters=10)
        except triton.runtime.errors.OutOfResources:
            torch.cuda.synchronize()
    return times


def tune(cfg: ModelConfig, kind: str, moe: FusedMoE, sizes: list[int]) -> dict[str, list]:
    """The fastest (BM, up tiles, down tiles[, SiLU inside the first GEMM]) per token bucket,
    each GEMM timed alone (the first with its SiLU-and-mul)."""
    quant = moe.quant
    group = None if quant is None else quant.block
    H, k = cfg.hidden_size, cfg.num_experts_per_tok
    # K tiles of 128 bytes and 256 bytes a row (fp8 rows are half as wide as bf16 ones); block-wise
    # fp8 is bound to its 128-column groups
    bks = [64, 128] if quant is None else [128, 256] if group is None else [128]
    table = {}
    for tokens in sizes:
        x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16)
        w, ids = routing(tokens, cfg)
        per_expert = tokens * k / cfg.num_experts
        bms = [16, 32, 64] if per_expert <= 32 else [64, 128]
        group_m = 1 if per_expert <= 32 else 8  # (grouping rows only pays where experts have several blocks)
        candidates = [
            kmoe.GemmConfig(bn, bk, group_m, w, s) for bn, bk, w, s in itertools.product([64, 128], bks, [4, 8], [3, 4])
        ]
        act = x if quant is None else quantize(x, group)
        best = None
        for bm in bms:
            # blocks larger than an expert's usual run multiply half their rows where those
            # suffice (an expert's weights read once for up to BM rows)
            tiles = [c._replace(halves=bm >= 64 and per_expert < bm) for c in candidates]
            alignment = kmoe.align(ids, cfg.num_experts, bm)
            P = tokens * k
            mid = torch.randn(P, moe.local, device="cuda", dtype=torch.bfloat16)
            mid_act = mid if quant is None else quantize(mid, group)

            def up(c, silu=False):
                return kmoe._gemm(
                    act, moe.w13_weight, moe.w13_weight_scale, alignment, P, k, x.dtype, c, None, group, silu
                )

            def down(c):
                return kmoe._gemm(
                    mid_act, moe.w2_weight, moe.w2_weight_scale, alignment, P, 1, x.dtype, c, w.contiguous(), group
                )

            up_ms, down_ms = timed(up, tiles), timed(down, tiles)
            u, d = min(up_ms, key=up_ms.get), min(down_ms, key=down_ms.get)
            gate_up = up(u)
            up_total, entry = up_ms[u] + replay_ms(lambda: kmoe.silu_and_mul(gate_up, quant), iters=10), list(u)
            # SiLU-and-mul inside the first GEMM (fp8: then a quantization of its half-width
            # output), where that beats the two launches
            fused_ms = timed(lambda c: up(c, silu=True), tiles + [c._replace(bn=256) for c in tiles])
            f = min(fused_ms, key=fused_ms.get)
            half = up(f, silu=True)
            fused_total = fused_ms[f] + (replay_ms(lambda: quantize(half, group), iters=10) if quant else 0.0)
            silu = fused_total < up_total
            if silu:
                up_total, entry = fused_total, list(f)
            total = up_total + down_ms[d]
            print(
                f"  {kind} T={tokens} BM={bm}: up{' with SiLU' if silu else ' + SiLU'} {up_total * 1e3:.1f} us "
                f"{entry}, down {down_ms[d] * 1e3:.1f} us {d}"
            )
            if best is None or total < best[0]:
                best = (total, [bm, entry, list(d)] + ([True] if silu else []))
        table[str(tokens)] = best[1]
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="benchmarks/configs/qwen3-30b-a3b")
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--tokens", type=int, nargs="+", default=None, help="token counts to time (and tune) only")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = ModelConfig.from_path(args.model)
    bandwidth = read_bandwidth()
    gpu = tuned_tables.gpu(0)[0]
    print(f"{gpu}: read bandwidth {bandwidth / 1e12:.2f} TB/s")
    results = {"gpu": gpu, "model": args.model, "read_bandwidth_tbs": bandwidth / 1e12, "rows": []}
    for kind in args.kinds:
        moe = dummy_moe(cfg, KINDS[kind])
        key = kmoe.layer_key(moe, torch.bfloat16)
        if args.tune:
            table = tune(cfg, kind, moe, args.tokens or TUNE_SIZES)
            path = kmoe.CONFIGS_PATH
            tables = json.loads(path.read_text()) if path.exists() else {}
            tables.setdefault(gpu, {}).setdefault(key, {}).update(table)
            path.write_text(table_json(tables))
            tuned_tables.record_chip(0)
            tuned_tables.table.cache_clear()
            kmoe.moe_config.cache_clear()
            print(f"wrote {key} to {path}")
        for tokens in args.tokens or SIZES:
            x = torch.randn(tokens, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
            w, ids = routing(tokens, cfg)
            us = replay_ms(lambda: moe(x, w, ids), iters=10) * 1e3
            floor = floor_us(moe, ids, bandwidth)
            config = kmoe.config_for(tokens, key, cfg.num_experts, cfg.num_experts_per_tok, x.device)
            parts = breakdown(moe, x, w, ids, config)
            print(f"{kind:9s} T={tokens:5d}: {us:8.1f} us, floor {floor:7.1f} us, {us / floor:5.2f}x  {config}")
            print("           parts (us): " + ", ".join(f"{k} {v:.1f}" for k, v in parts.items()))
            results["rows"].append(
                {"kind": kind, "tokens": tokens, "us": us, "floor_us": floor, "config": config, "parts_us": parts}
            )
    save_result(results, args.out, f"moe_bench_{gpu.split()[1].lower()}")


if __name__ == "__main__":
    main()
