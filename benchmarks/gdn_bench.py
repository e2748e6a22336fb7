"""Gated DeltaNet kernels on the GPU against their floor, one layer of a real shape.

    python benchmarks/gdn_bench.py --model benchmarks/configs/qwen3.5-35b-a3b

Decode: one token for each of B requests through ``fla_gated_delta`` as the model calls it
(states gathered from the pool's rows, FLA's fused recurrent step, states scattered back), and
FLA's kernel alone on a contiguous state; the floor is every request's float32 state read and
written once over the device's copy bandwidth (``--bandwidth``, read + write bytes a second).
Prefill: FLA's varlen chunked kernel over B prompts of ``--prompt`` tokens, in tokens a second.
Prints one JSON line per measurement.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.fp8_prefill_bench import timed  # noqa: E402 (milliseconds a call)
from minisgl.checkpoint.model_config import ModelConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--bandwidth", type=float, default=4.3e12, help="device copy bandwidth, read + write bytes/s")
    args = ap.parse_args()
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    from minisgl.device.layers.gated_delta import FLA_DECODE_ROWS, fla_gated_delta, l2norm

    c = ModelConfig.from_path(args.model)
    hv, k, v = c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    dev = torch.device("cuda")
    for b in args.batches:
        pool_rows = 2 * (b + 1)
        ssm = torch.zeros(pool_rows, hv, k, v, device=dev)
        q = l2norm(torch.randn(b, hv, k, device=dev)) * k**-0.5
        kk = l2norm(torch.randn(b, hv, k, device=dev))
        vv = torch.randn(b, hv, v, device=dev)
        g, beta = -torch.rand(b, hv, device=dev), torch.rand(b, hv, device=dev)

        class Pool:  # what fla_gated_delta reads of the StatePool
            slots = torch.arange(1, b + 1, device=dev)
            decode = True

        n = min(b, FLA_DECODE_ROWS)  # (the kernel alone: one run of the rows fla_gated_delta gives it)
        state = torch.zeros(n, hv, k, v, device=dev)
        layer = timed(lambda: fla_gated_delta(q, kk, vv, g, beta, ssm, Pool), 50) / 1e3
        kernel = (b // n) * timed(
            lambda: fused_recurrent_gated_delta_rule(
                q[:n, None], kk[:n, None], vv[:n, None], g[:n, None], beta[:n, None], scale=1.0, initial_state=state,
                output_final_state=True,
            ),
            50,
        ) / 1e3  # fmt: skip
        floor = 2 * b * hv * k * v * 4 / args.bandwidth
        row = {"decode_batch": b, "layer_us": layer * 1e6, "kernel_us": kernel * 1e6, "floor_us": floor * 1e6}
        print(json.dumps({**row, "layer_over_floor": layer / floor, "kernel_over_floor": kernel / floor}))
    for b in (1, 8):
        t = b * args.prompt
        q = l2norm(torch.randn(1, t, hv, k, device=dev)) * k**-0.5
        kk = l2norm(torch.randn(1, t, hv, k, device=dev))
        vv = torch.randn(1, t, hv, v, device=dev)
        g, beta = -torch.rand(1, t, hv, device=dev) * 0.1, torch.rand(1, t, hv, device=dev)
        cu = torch.arange(0, t + 1, args.prompt, device=dev)
        h0 = torch.zeros(b, hv, k, v, device=dev)
        secs = (
            timed(
                lambda: chunk_gated_delta_rule(
                    q, kk, vv, g, beta, scale=1.0, initial_state=h0, output_final_state=True, cu_seqlens=cu
                ),
                10,
            )
            / 1e3
        )
        print(json.dumps({"prefill_prompts": b, "tokens": t, "ms": secs * 1e3, "tokens_per_s": t / secs}))


if __name__ == "__main__":
    main()
