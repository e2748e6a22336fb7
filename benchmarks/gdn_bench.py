"""Gated DeltaNet kernels on the GPU against their floor, one layer of a real shape.

    python benchmarks/gdn_bench.py --model benchmarks/configs/qwen3.5-35b-a3b

Decode: one token for each of B requests whose states sit in scattered rows of a pool twice as
large: the project's step (``kernels/gdn_step.py``: the conv and the gated delta rule in place
by slot), replayed from a CUDA graph as the server runs it and launched eagerly; and for
comparison flash-linear-attention's fused recurrent step on states already gathered into a
contiguous batch. The floor is every request's float32 state read and written once over the
device's copy bandwidth (``--bandwidth``, read + write bytes a second). Prefill: FLA's varlen
chunked kernel over B prompts of ``--prompt`` tokens, in tokens a second. Prints one JSON line
per measurement.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.decode_bench import replay_ms  # noqa: E402 (milliseconds a call, from a CUDA graph)
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

    from minisgl.device.kernels.gdn_step import conv_step, delta_step
    from minisgl.device.layers.gated_delta import l2norm

    c = ModelConfig.from_path(args.model)
    hk, hv, k, v = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    channels, width = 2 * hk * k + hv * v, c.linear_conv_kernel_dim - 1
    dev = torch.device("cuda")
    for b in args.batches:
        rows = 2 * b + 1
        slots = torch.randperm(rows, device=dev)[:b]
        ssm = torch.zeros(rows, hv, k, v, device=dev)
        bf16 = {"device": dev, "dtype": torch.bfloat16}
        conv = torch.zeros(rows, channels, width, **bf16)
        x, weight = torch.randn(b, channels, **bf16), torch.randn(channels, width + 1, **bf16)
        a, bb = torch.randn(b, hv, **bf16), torch.randn(b, hv, **bf16)
        a_log, dt_bias = torch.rand(hv, device=dev), torch.rand(hv, device=dev)
        step = lambda: delta_step(x, a, bb, a_log, dt_bias, ssm, slots, hk)  # noqa: E731
        conv_us = replay_ms(lambda: conv_step(x, weight, conv, slots)) * 1e3
        step_us, eager_us = replay_ms(step) * 1e3, timed(step, 50) * 1e3
        q = l2norm(torch.randn(b, 1, hv, k, device=dev)) * k**-0.5
        kk = l2norm(torch.randn(b, 1, hv, k, device=dev))
        vv = torch.randn(b, 1, hv, v, device=dev)
        g, beta = -torch.rand(b, 1, hv, device=dev), torch.rand(b, 1, hv, device=dev)
        state = torch.zeros(b, hv, k, v, device=dev)
        fla_us = timed(
            lambda: fused_recurrent_gated_delta_rule(
                q, kk, vv, g, beta, scale=1.0, initial_state=state, output_final_state=True
            ),
            50,
        ) * 1e3  # fmt: skip
        floor = 2 * b * hv * k * v * 4 / args.bandwidth * 1e6
        row = {"decode_batch": b, "step_graphed_us": step_us, "step_eager_us": eager_us, "conv_graphed_us": conv_us}
        row |= {"fla_contiguous_us": fla_us, "floor_us": floor, "step_over_floor": step_us / floor}
        print(json.dumps(row), flush=True)
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
