"""Offline throughput through the LLM API: radix cache and cascade attention on and off in one run.

    python benchmarks/offline_throughput.py --model benchmarks/configs/llama3.1-8b --load-format dummy

Variants: radix-on (everything on), cascade-off, radix-off, and with --ablations no-cuda-graph
and no-overlap. Prints a table (with prefill tokens computed against the workload's distinct
prompt tokens) and writes JSON to benchmarks/results/. Outputs ignore EOS so every request
generates exactly its output length.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workloads import WORKLOADS, Workload, distinct_tokens, save_result  # noqa: E402
from minisgl.args import EngineArgs  # noqa: E402
from minisgl.llm import LLM  # noqa: E402
from minisgl.sampling import SamplingParams  # noqa: E402


def run(llm: LLM, prompts: list[list[int]], output_lens: list[int]) -> dict[str, float]:
    params = [SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True) for n in output_lens]
    device = getattr(llm.runner, "device", None)  # none at tp > 1: the ranks are other processes, idle here
    if device is not None and device.type == "cuda":
        import torch

        torch.cuda.synchronize()
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(r["output_ids"]) for r in results)
    in_tokens = sum(len(p) for p in prompts)
    stats = llm.scheduler.stats()
    return {
        "seconds": elapsed, "requests": len(prompts), "input_tokens": in_tokens, "output_tokens": out_tokens,
        "output_tok_per_s": out_tokens / elapsed, "total_tok_per_s": (in_tokens + out_tokens) / elapsed,
        "cache_hit_rate": stats["cache_hit_rate"], "retractions": stats["retractions"],
        "prefill_tokens": stats["prefill_tokens"], "cascade_steps": stats["cascade_steps"],
        "decode_steps": stats["decode_steps"],
    }


def profile(llm: LLM, wl: Workload) -> None:
    """Kernel time by kernel over one run and how much of the wall time the GPU was busy; then
    the host side of a second run by Python function (cProfile)."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    run(llm, wl.prompts[:8], [8] * 8)  # warm up outside the trace
    llm.reset_scheduler(disable_radix_cache=False)
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        result = run(llm, wl.prompts, wl.output_lens)
    events = prof.key_averages()
    busy = sum(e.self_device_time_total for e in events) / 1e6
    print(events.table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=90))
    print(f"{wl.name}: wall {result['seconds']:.2f} s (profiled), kernels {busy:.2f} s, "
          f"GPU idle {result['seconds'] - busy:.2f} s")
    llm.reset_scheduler(disable_radix_cache=False)
    with cProfile.Profile() as host:
        result = run(llm, wl.prompts, wl.output_lens)
    print(f"host profile of a second run ({result['seconds']:.2f} s under cProfile):")
    pstats.Stats(host).sort_stats("tottime").print_stats(30)


VARIANTS = {  # name: (radix cache off, cascade off, CUDA graphs, overlap)
    "radix-on": (False, False, True, True),
    "cascade-off": (False, True, True, True),
    "radix-off": (True, True, True, True),
    "no-cuda-graph": (False, False, False, True),
    "no-overlap": (False, False, True, False),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--workloads", nargs="+", default=["shared-prefix", "random"], choices=list(WORKLOADS))
    ap.add_argument("--page-size", type=int, default=EngineArgs.page_size)
    ap.add_argument("--max-running-requests", type=int, default=256)
    ap.add_argument("--chunked-prefill-size", type=int, default=8192)
    ap.add_argument("--context-length", type=int, default=4096)
    ap.add_argument("--variants", nargs="+", default=["radix-on", "cascade-off", "radix-off"],
                    choices=list(VARIANTS), help="radix-on has radix cache and cascade attention on")
    ap.add_argument("--ablations", action="store_true",
                    help="also run each workload (radix on) without CUDA graphs and without overlap")
    ap.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/offline_<model>.json)")
    ap.add_argument("--profile", action="store_true",
                    help="profile the first workload (radix on): GPU kernels and idle time, then the host by function")
    ap.add_argument("--tp-size", type=int, default=1,
                    help="tensor-parallel ranks (worker processes; the in-process ablations and --profile need 1)")
    args = ap.parse_args()
    if args.tp_size > 1 and (args.ablations or args.profile):
        ap.error("--ablations and --profile reach into the in-process model runner: use --tp-size 1")

    llm = LLM(args.model, load_format=args.load_format, page_size=args.page_size,
              max_running_requests=args.max_running_requests, chunked_prefill_size=args.chunked_prefill_size,
              context_length=args.context_length, tp_size=args.tp_size)
    if args.profile:
        profile(llm, WORKLOADS[args.workloads[0]](llm.runner.vocab_size))
        return
    graphs = getattr(llm.runner, "graphs", None)
    variants = args.variants + (["no-cuda-graph", "no-overlap"] if args.ablations else [])
    rows = []
    for name in args.workloads:
        wl = WORKLOADS[name](llm.runner.vocab_size)
        distinct = distinct_tokens(wl.prompts)
        for variant in variants:
            radix_off, cascade_off, use_graphs, overlap = VARIANTS[variant]
            if args.tp_size == 1:
                llm.runner.graphs = graphs if use_graphs else None
            llm.args.disable_overlap_schedule = not overlap
            llm.args.disable_cascade_attention = cascade_off
            llm.reset_scheduler(disable_radix_cache=radix_off)  # empty cache per run
            result = run(llm, wl.prompts, wl.output_lens)
            result["distinct_prompt_tokens"] = distinct
            rows.append({"workload": name, "variant": variant, **result})
            print(f"{name:14s} {variant:14s} {result['seconds']:8.2f} s  {result['output_tok_per_s']:9.0f} out tok/s"
                  f"  hit rate {result['cache_hit_rate']:.2f}  prefill {result['prefill_tokens'] / distinct:.3f}x "
                  f"distinct  cascade steps {result['cascade_steps']}/{result['decode_steps']}", flush=True)
        if args.tp_size == 1:
            llm.runner.graphs = graphs
        base = next(r["seconds"] for r in rows if r["workload"] == name and r["variant"] == variants[0])
        for r in rows:
            if r["workload"] == name and r["variant"] != variants[0]:
                print(f"{name}: {r['variant']} / {variants[0]} = {r['seconds'] / base:.2f}x")
    import torch

    device = getattr(llm.runner, "device", torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    info = {"model": args.model, "device": str(device), "args": vars(args), "rows": rows}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    save_result(info, args.out, f"offline_{Path(args.model).name}")


if __name__ == "__main__":
    main()
