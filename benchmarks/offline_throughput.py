"""Offline throughput through the LLM API: radix cache and cascade attention on and off in one run.

    python benchmarks/offline_throughput.py --model benchmarks/configs/llama3.1-8b --load-format dummy

Variants: radix-on (everything on), cascade-off, radix-off, and with --ablations no-cuda-graph,
no-piecewise (decode graphs, eager prefill) and no-overlap. ``--quantization none fp8
--kv-cache-dtype auto fp8_e4m3`` runs every workload once per (quantization, KV dtype) pair, each on
a fresh engine, in the same process. Prints a table (with prefill tokens computed against the
workload's distinct prompt tokens) and writes JSON to benchmarks/results/. Outputs ignore EOS so
every request generates exactly its output length.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workloads import WORKLOADS, Workload, distinct_tokens, save_result  # noqa: E402
from minisgl.config.args import EngineArgs
from minisgl.llm import LLM  # noqa: E402
from minisgl.utils import init_logging  # noqa: E402
from minisgl.wire.sampling import SamplingParams


def run(
    llm: LLM, prompts: list[list[int]], output_lens: list[int], temperature: float = 0.0, loras: list[str] | None = None
) -> dict[str, float]:
    """``loras``: the adapters requests run under, one per tenant (``tenant_adapters``)."""
    params = [SamplingParams(temperature=temperature, max_new_tokens=n, ignore_eos=True) for n in output_lens]
    device = getattr(llm.runner, "device", None)  # none at tp > 1: the ranks are other processes, idle here
    cuda = device is not None and device.type == "cuda"
    if cuda:
        import torch

        torch.cuda.synchronize()
        before = torch.cuda.memory_stats(device)
    pauses: list[tuple[int, float]] = []  # Python's garbage collections inside the timed run

    def on_gc(phase: str, info: dict) -> None:
        now = time.perf_counter()
        if phase == "start":
            pauses.append((info["generation"], now))
        elif pauses:
            pauses[-1] = (pauses[-1][0], now - pauses[-1][1])

    gc.callbacks.append(on_gc)
    start = time.perf_counter()
    try:
        names = tenant_adapters(prompts, loras) if loras else None
        results = llm.generate(prompts, params, lora_path=names)
    finally:
        elapsed = time.perf_counter() - start
        gc.callbacks.remove(on_gc)
    out_tokens = sum(len(r["output_ids"]) for r in results)
    in_tokens = sum(len(p) for p in prompts)
    stats = llm.scheduler.stats()
    out = {
        "seconds": elapsed,
        "requests": len(prompts),
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "output_tok_per_s": out_tokens / elapsed,
        "total_tok_per_s": (in_tokens + out_tokens) / elapsed,
        "cache_hit_rate": stats["cache_hit_rate"],
        "retractions": stats["retractions"],
        "prefill_tokens": stats["prefill_tokens"],
        "cascade_steps": stats["cascade_steps"],
        "decode_steps": stats["decode_steps"],
        "gc_ms": 1e3 * sum(t for _, t in pauses),
        "gc_full_collections": sum(g == 2 for g, _ in pauses),
    }
    if cuda:  # cudaMalloc calls and out-of-memory retries (each frees cached blocks: a device sync)
        after = torch.cuda.memory_stats(device)
        for key in ("num_device_alloc", "num_alloc_retries"):
            out[key] = after.get(key, 0) - before.get(key, 0)
    return out


def profile(llm: LLM, wl: Workload, host_ops: bool = False) -> None:
    """Kernel time by kernel over one run and how much of the wall time the GPU was busy (with
    ``host_ops``, also the host calls under the longest idle gaps; slower); then the host side of
    a second run by Python function (cProfile)."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    run(llm, wl.prompts[:8], [8] * 8)  # warm up outside the trace
    llm.reset_scheduler(disable_radix_cache=False)
    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if host_ops else [])
    with torch_profile(activities=activities, with_stack=host_ops) as prof:
        result = run(llm, wl.prompts, wl.output_lens)
    events = prof.key_averages()
    busy = sum(e.self_device_time_total for e in events) / 1e6
    print(events.table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=90))
    print(
        f"{wl.name}: wall {result['seconds']:.2f} s (profiled), kernels {busy:.2f} s, "
        f"GPU idle {result['seconds'] - busy:.2f} s"
    )
    idle_gaps(prof.events())
    llm.reset_scheduler(disable_radix_cache=False)
    with cProfile.Profile() as host:
        result = run(llm, wl.prompts, wl.output_lens)
    print(f"host profile of a second run ({result['seconds']:.2f} s under cProfile):")
    pstats.Stats(host).sort_stats("tottime").print_stats(30)


def idle_gaps(events: list, top: int = 15) -> None:
    """Where the GPU waited between kernels: idle time by gap length, and the longest gaps with
    the kernels either side, their time from the first kernel (prefill, decode or the end) and,
    where the trace has host events, the host calls that were running meanwhile."""
    from torch.autograd import DeviceType

    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in events if e.device_type == DeviceType.CUDA)
    host = [e for e in events if e.device_type == DeviceType.CPU]
    if not spans:
        return
    gaps, end, last = [], spans[0][1], spans[0][2]
    for start, stop, name in spans[1:]:
        if start > end:
            gaps.append((start - end, end - spans[0][0], last[:40], name[:40], end, start))
        if stop > end:
            end, last = stop, name
    first_decode = next((s for s in spans if s[2] == "_partial_attention_kernel"), spans[-1])[0]
    busy = sum(stop - start for start, stop, _ in spans if stop <= first_decode)
    print(
        f"kernels from first to last: {(end - spans[0][0]) / 1e6:.3f} s; until the first decode attention "
        f"kernel {(first_decode - spans[0][0]) / 1e6:.3f} s, kernels in it {busy / 1e6:.3f} s"
    )
    bounds = [10, 100, 1000, 10000, float("inf")]  # us
    for lo, hi in zip([0] + bounds, bounds):
        sel = [g[0] for g in gaps if lo <= g[0] < hi]
        print(f"gaps {lo:>6}-{hi:<6} us: {len(sel):6d}, {sum(sel) / 1e6:.3f} s")
    for gap, at, before, after, t0, t1 in sorted(gaps, reverse=True)[:top]:
        print(f"  {gap / 1e3:8.2f} ms at {at / 1e6:7.3f} s  after {before}  before {after}")
        # The innermost host calls that span most of the gap (outer frames span all of it), then
        # the longest of those that span less: what the host was doing instead of launching.
        during = [
            (min(e.time_range.end, t1) - max(e.time_range.start, t0), e.time_range.elapsed_us(), e.name)
            for e in host
            if e.time_range.start < t1 and e.time_range.end > t0
        ]
        spanning = sorted((d for d in during if d[0] >= gap / 2), key=lambda d: d[1])[:6]
        partial = sorted((d for d in during if d[0] < gap / 2), reverse=True)[:6]
        for overlap, _, name in spanning + partial:
            print(f"      host {overlap / 1e3:7.2f} ms  {name[:90]}")


VARIANTS = {  # name: (radix cache off, cascade off, CUDA graphs (decode, prefill pieces), overlap)
    "radix-on": (False, False, (True, True), True),
    "hicache": (False, False, (True, True), True),  # radix-on plus the host tier (the engine built with --hicache)
    "cascade-off": (False, True, (True, True), True),
    "radix-off": (True, True, (True, True), True),
    "no-cuda-graph": (False, False, (False, False), True),
    "no-piecewise": (False, False, (True, False), True),  # decode graphs, eager prefill
    "no-overlap": (False, False, (True, True), False),
    # radix-on with --speculative-algorithm NGRAM: what speculation's index costs full batches
    "ngram": (False, False, (True, True), True),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--workloads", nargs="+", default=["shared-prefix", "random"], choices=list(WORKLOADS))
    ap.add_argument("--page-size", type=int, default=EngineArgs.page_size)
    ap.add_argument("--max-running-requests", type=int, default=256)
    ap.add_argument("--cuda-graph-max-bs", type=int, default=None, help="default: max-running-requests")
    ap.add_argument(
        "--temperature",
        type=float,
        nargs="+",
        default=[0.0],
        help="run each workload at each of these temperatures (0: greedy)",
    )
    ap.add_argument("--problems", type=int, default=8, help="repeated workload: prompts")
    ap.add_argument("--samples", type=int, default=1024, help="repeated workload: samples per prompt")
    ap.add_argument("--chunked-prefill-size", type=int, default=8192)
    ap.add_argument("--context-length", type=int, default=4096)
    ap.add_argument(
        "--variants",
        nargs="+",
        default=["radix-on", "cascade-off", "radix-off"],
        choices=list(VARIANTS),
        help="radix-on has radix cache and cascade attention on",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="timed runs per workload and variant; rows report the median (and every time)",
    )
    ap.add_argument(
        "--ablations",
        action="store_true",
        help="also run each workload (radix on) without CUDA graphs, without prefill graphs and without overlap",
    )
    ap.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/offline_<model>.json)")
    ap.add_argument(
        "--profile",
        nargs="?",
        const="gpu",
        choices=["gpu", "host"],
        help="profile the first workload (radix on): GPU kernels and idle time, then the host by "
        "function; 'host' also traces host calls (with Python stacks) to show what ran in idle gaps",
    )
    ap.add_argument(
        "--quantization",
        nargs="+",
        default=["none"],
        choices=["none", "fp8", "fp8-head"],
        help="linear layers per mode (paired with --kv-cache-dtype; one value applies to all); "
        "fp8-head: fp8 with the LM head quantized too (--quantize-lm-head)",
    )
    ap.add_argument("--kv-cache-dtype", nargs="+", default=["auto"], choices=["auto", "fp8_e4m3"])
    ap.add_argument(
        "--hicache",
        type=float,
        default=0.0,
        metavar="GB",
        help="build the engine with a host tier of this many GB (--enable-hierarchical-cache "
        "--hicache-size); the hicache variant runs with it, the others without (its cost when "
        "everything fits on the device)",
    )
    ap.add_argument(
        "--lora",
        type=int,
        nargs=2,
        default=None,
        metavar=("ADAPTERS", "RANK"),
        help="serve ADAPTERS random LoRA adapters of RANK on every module (as many device slots), "
        "one per tenant (requests whose prompts start alike share one)",
    )
    ap.add_argument(
        "--tp-size",
        type=int,
        default=1,
        help="tensor-parallel ranks (worker processes; the in-process ablations and --profile need 1)",
    )
    args = ap.parse_args()
    init_logging("info")  # pool size, derived limits, CUDA-graph capture time
    if ("hicache" in args.variants) != (args.hicache > 0):
        ap.error("the hicache variant and --hicache go together")
    if args.tp_size > 1 and (args.ablations or args.profile):
        ap.error("--ablations and --profile reach into the in-process model runner: use --tp-size 1")

    modes = len(args.quantization), len(args.kv_cache_dtype)
    if max(modes) > 1 and min(modes) > 1 and modes[0] != modes[1]:
        ap.error("--quantization and --kv-cache-dtype pair up: give as many of each (or one)")
    pairs = list(zip(args.quantization * (max(modes) // modes[0]), args.kv_cache_dtype * (max(modes) // modes[1])))
    WORKLOADS["repeated"] = partial(WORKLOADS["repeated"], problems=args.problems, samples=args.samples)
    rows: list[dict] = []
    llm = None
    for quantization, kv_dtype in pairs:
        if llm is not None:  # free the last engine's weights, pool and graphs first
            import torch

            del llm
            gc.collect()
            torch.cuda.empty_cache()
        llm = LLM(
            args.model,
            load_format=args.load_format,
            page_size=args.page_size,
            max_running_requests=args.max_running_requests,
            chunked_prefill_size=args.chunked_prefill_size,
            context_length=args.context_length,
            tp_size=args.tp_size,
            cuda_graph_max_bs=args.cuda_graph_max_bs,
            quantization=None if quantization == "none" else "fp8",
            kv_cache_dtype=kv_dtype,
            quantize_lm_head=quantization == "fp8-head",
            enable_hierarchical_cache=args.hicache > 0,
            hicache_size=args.hicache,
            # (its CUDA graphs then have room for verify rows; other variants run without it)
            speculative_algorithm="NGRAM" if "ngram" in args.variants else None,
            **(
                dict(enable_lora=True, max_loras_per_batch=args.lora[0], max_lora_rank=args.lora[1])
                if args.lora
                else {}
            ),
        )
        args.lora_names = load_random_adapters(llm, args.model, *args.lora) if args.lora else None
        if args.profile:
            profile(llm, WORKLOADS[args.workloads[0]](llm.runner.vocab_size), args.profile == "host")
            return
        mode = {"quantization": quantization, "kv_cache_dtype": kv_dtype, "lora": args.lora}
        if len(pairs) > 1:
            print(f"== quantization {quantization}, KV cache {kv_dtype}", flush=True)
        run_workloads(llm, args, mode, rows)
    import torch

    device = getattr(llm.runner, "device", torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    info = {"model": args.model, "device": str(device), "args": vars(args), "rows": rows}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    save_result(info, args.out, f"offline_{Path(args.model).name}")
    if len(pairs) > 1:
        first = [r for r in rows if (r["quantization"], r["kv_cache_dtype"]) == pairs[0]]
        for r in rows[len(first) :]:
            base = next(
                b
                for b in first
                if (b["workload"], b["variant"], b["temperature"]) == (r["workload"], r["variant"], r["temperature"])
            )
            print(
                f"{r['workload']} {r['variant']} T={r['temperature']}: {r['quantization']}/{r['kv_cache_dtype']} "
                f"{r['seconds']:.2f} s vs {pairs[0][0]}/{pairs[0][1]} {base['seconds']:.2f} s = "
                f"{base['seconds'] / r['seconds']:.2f}x throughput"
            )


def tenant_adapters(prompts: list[list[int]], loras: list[str], prefix: int = 64) -> list[str]:
    """Each request's adapter: requests whose prompts start alike (a tenant's system prompt) share
    one, and each new start takes the next adapter in turn, as a server with one adapter per
    tenant sees them (so the tenant's requests still share their prefix's cache)."""
    tenant: dict[tuple[int, ...], str] = {}
    return [tenant.setdefault(tuple(p[:prefix]), loras[len(tenant) % len(loras)]) for p in prompts]


def load_random_adapters(llm: LLM, model: str, count: int, rank: int) -> list[str]:
    """``count`` random adapters of ``rank`` on every module of ``model``'s shape, loaded."""
    import tempfile

    from minisgl.device.tiny_model import make_lora_adapter

    root = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    names = [f"a{i}" for i in range(count)]
    for i, name in enumerate(names):
        ok, message = llm.load_lora_adapter(
            name, str(make_lora_adapter(model, root / name, rank=rank, seed=i, std=0.01))
        )
        assert ok, message
    return names


def run_workloads(llm: LLM, args: argparse.Namespace, mode: dict[str, str], rows: list[dict]) -> None:
    """Every workload under every variant (and temperature) on one engine; rows are appended."""
    graphs = getattr(llm.runner, "graphs", None)
    pieces = getattr(llm.runner, "piecewise", None)
    variants = args.variants + (["no-cuda-graph", "no-piecewise", "no-overlap"] if args.ablations else [])
    start = len(rows)
    for name in args.workloads:
        wl = WORKLOADS[name](llm.runner.vocab_size)
        distinct = distinct_tokens(wl.prompts)
        # Untimed: kernels a workload's shapes first need (Triton specializations, FlashInfer
        # modules) compile here, not inside a timed run.
        llm.reset_scheduler(disable_radix_cache=False)
        run(llm, wl.prompts[:16], [4] * min(16, len(wl.prompts)), loras=args.lora_names)
        for temperature, variant in [(t, v) for t in args.temperature for v in variants]:
            radix_off, cascade_off, (use_graphs, use_pieces), overlap = VARIANTS[variant]
            if args.tp_size == 1:
                llm.runner.graphs = graphs if use_graphs else None
                llm.runner.piecewise = pieces if use_pieces else None
            llm.args.disable_overlap_schedule = not overlap
            llm.args.disable_cascade_attention = cascade_off
            llm.args.enable_hierarchical_cache = variant == "hicache"
            llm.args.speculative_algorithm = "NGRAM" if variant == "ngram" else None
            results = []
            for _ in range(args.repeats):
                llm.reset_scheduler(disable_radix_cache=radix_off)  # empty cache per run
                results.append(run(llm, wl.prompts, wl.output_lens, temperature, args.lora_names))
            result = sorted(results, key=lambda r: r["seconds"])[len(results) // 2]  # the median run
            result["seconds_all"] = [r["seconds"] for r in results]
            result["distinct_prompt_tokens"] = distinct
            rows.append({"workload": wl.name, "variant": variant, "temperature": temperature, **mode, **result})
            print(
                f"{wl.name:14s} {variant:14s} T={temperature:<4} {result['seconds']:8.2f} s  "
                f"{result['output_tok_per_s']:9.0f} out tok/s  hit rate {result['cache_hit_rate']:.2f}  "
                f"prefill {result['prefill_tokens'] / distinct:.3f}x distinct  "
                f"cascade steps {result['cascade_steps']}/{result['decode_steps']}  "
                f"gc {result['gc_ms']:.1f} ms ({result['gc_full_collections']} full)"
                + (
                    f"  cudaMalloc {result['num_device_alloc']}, retries {result['num_alloc_retries']}"
                    if "num_device_alloc" in result
                    else ""
                )
                + (f"  (runs {', '.join(f'{t:.2f}' for t in result['seconds_all'])})" if args.repeats > 1 else ""),
                flush=True,
            )
        if args.tp_size == 1:
            llm.runner.graphs = graphs
        for temperature in args.temperature:
            same = [r for r in rows[start:] if r["workload"] == wl.name and r["temperature"] == temperature]
            for r in same[1:]:
                print(
                    f"{wl.name} T={temperature}: {r['variant']} / {same[0]['variant']} = "
                    f"{r['seconds'] / same[0]['seconds']:.2f}x"
                )


if __name__ == "__main__":
    main()
