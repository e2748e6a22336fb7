"""Latency of one prompt's prefill (time to its first token) with prefill steps replayed from
piecewise CUDA graphs and run eagerly, in one process on one engine.

    python benchmarks/prefill_latency.py --model benchmarks/configs/qwen3-0.6b --load-format dummy

A lone short prompt is the case the graphs help most: its few kernels' launches, not the GPU,
set its time. For each prompt length, the median of ``--repeats`` single requests (one output
token, radix cache reset before each) per mode, alternating modes.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workloads import save_result  # noqa: E402
from minisgl.llm import LLM  # noqa: E402
from minisgl.utils import init_logging  # noqa: E402
from minisgl.wire.sampling import SamplingParams


def first_token_ms(llm: LLM, prompt: list[int]) -> float:
    llm.reset_scheduler(disable_radix_cache=False)
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True))
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 1024, 4096, 8192])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--quantization", default=None, choices=["fp8"])
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    init_logging("warning")
    llm = LLM(
        args.model,
        load_format=args.load_format,
        context_length=max(args.lengths) + 64,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    pieces = llm.runner.piecewise
    if pieces is None:
        ap.error("this engine has no piecewise prefill graphs (a GPU, CUDA graphs and one rank are needed)")
    rng = random.Random(0)
    rows = []
    for length in args.lengths:
        prompt = [rng.randrange(llm.runner.vocab_size) for _ in range(length)]
        times: dict[str, list[float]] = {"graphs": [], "eager": []}
        for i in range(args.repeats + 1):  # the first of each is a warm-up
            for mode in times:
                llm.runner.piecewise = pieces if mode == "graphs" else None
                ms = first_token_ms(llm, prompt)
                if i:
                    times[mode].append(ms)
        row = {"tokens": length, **{f"{m}_ms": statistics.median(t) for m, t in times.items()}}
        rows.append(row)
        print(
            f"{length:6d} tokens: graphs {row['graphs_ms']:7.2f} ms, eager {row['eager_ms']:7.2f} ms "
            f"({row['eager_ms'] / row['graphs_ms']:.2f}x)",
            flush=True,
        )
    llm.runner.piecewise = pieces
    import torch

    save_result(
        {
            "model": args.model,
            "gpu": torch.cuda.get_device_name(),
            "quantization": args.quantization,
            "kv_cache_dtype": args.kv_cache_dtype,
            "rows": rows,
        },
        args.out,
        f"prefill_latency_{Path(args.model).name}",
    )


if __name__ == "__main__":
    main()
