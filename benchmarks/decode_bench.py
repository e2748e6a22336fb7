"""Decode step time against the memory-bandwidth floor, and FlashInfer's two decode kernels.

    python benchmarks/decode_bench.py --model benchmarks/configs/llama3.1-8b --batch-sizes 1 16 64 128 256

Part 1: a full decode step (CUDA graph, sampling included) at each batch size with every
request at ``--context`` tokens. The floor is (weight bytes + KV bytes read) / measured
device-to-device copy bandwidth (of a MoE's experts, the share a batch routed at random uses).
"sync" waits for each step's tokens (what a lone request sees); "pipelined" launches steps back
to back (what overlap scheduling achieves).

Part 2: one layer's decode attention, tensor-core vs CUDA-core path, on 256 requests either in
16 groups sharing a 2048-token prefix (plus 256 private tokens each) or with 2304 private tokens,
with the layer's K/V in dense tensors (the engine's layer-first cache) or spread page-first.

Part 3: one layer's decode attention, plain (FlashInfer's tensor-core decode, and our kernel)
against cascade (shared level once per group, own level resuming it, combine of split
requests), at batch 64 and 256 with 1 to 64 groups sharing 256 to 2048 tokens plus 256 of their
own, or none, each timed as CUDA-graph replays as the engine runs it, against the floor of
reading every distinct page once. It also times the parts alone and the kernel's tuning knobs.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workloads import save_result  # noqa: E402
from minisgl.checkpoint.model_config import ModelConfig
from minisgl.config.args import EngineArgs
from minisgl.device.distributed import set_tp_info
from minisgl.device.worker.model_runner import ModelRunner
from minisgl.utils import cdiv  # noqa: E402
from minisgl.wire.steps import ForwardBatch


def copy_bandwidth(nbytes: int = 2 << 30, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting the read and the write."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 2 * nbytes * iters / (start.elapsed_time(end) / 1e3)


def active_share(config: ModelConfig, batch: int) -> float:
    """The share of a MoE layer's experts that ``batch`` tokens routed uniformly at random use
    (each reads its weights once): 1 - (1 - k / E) ** batch."""
    if not config.num_experts:
        return 1.0
    return 1 - (1 - config.num_experts_per_tok / config.num_experts) ** batch


def fill_adapters(runner: ModelRunner) -> None:
    """Random adapters in every LoRA slot, and request slot i under adapter i % slots."""
    from minisgl.device.models.lora_adapter import lora_weights

    for w in lora_weights(runner.model):
        w.a.normal_(std=0.01)
        w.b.normal_(std=0.01)
    slots = runner.lora_rows.slots
    runner.adapter_of_slot[:-1] = torch.arange(len(runner.adapter_of_slot) - 1).numpy() % slots


def step_times(runner: ModelRunner, bs: int, context: int, iters: int) -> tuple[float, float]:
    """(sync, pipelined) seconds per decode step for ``bs`` requests of ``context`` tokens."""
    pages_per_req = cdiv(context + 1, runner.page_size)
    first = ForwardBatch(
        slots=list(range(bs)),
        cached_lens=[context] * bs,
        new_lens=[1] * bs,
        input_ids=[1] * bs,
        sample=[True] * bs,
        table_slots=[s for s in range(bs) for _ in range(pages_per_req)],
        table_cols=[c for _ in range(bs) for c in range(pages_per_req)],
        table_pages=list(range(bs * pages_per_req)),
    )
    runner.step(first)
    batch = ForwardBatch(
        slots=first.slots,
        cached_lens=first.cached_lens,
        new_lens=first.new_lens,
        input_ids=[-1] * bs,
        sample=first.sample,
    )
    for _ in range(3):
        runner.step(batch)
    t = time.perf_counter()
    for _ in range(iters):
        runner.step(batch)
    sync = (time.perf_counter() - t) / iters
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        runner.launch(batch)
    for _ in range(iters):
        runner.collect()
    return sync, (time.perf_counter() - t) / iters


def profile(runner: ModelRunner, bs: int, context: int) -> None:
    """Where a decode step's time goes, on the host and on the GPU."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    step_times(runner, bs, context, iters=3)
    batch = ForwardBatch(
        slots=list(range(bs)), cached_lens=[context] * bs, new_lens=[1] * bs, input_ids=[-1] * bs, sample=[True] * bs
    )
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            runner.launch(batch)
        for _ in range(5):
            runner.collect()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))


PAGE_FIRST_LAYERS = 8  # part 2's page-first cache: a layer's pages spread among 8 layers' (all 32 would not fit)


def attention_kernels(
    qo_heads: int, kv_heads: int, head_dim: int, page_size: int, bandwidth: float, iters: int = 50
) -> list[dict]:
    import flashinfer

    groups, per_group = 16, 16
    shared, private = 2048 // page_size, 256 // page_size  # in pages
    n = groups * per_group
    rows = []
    for layout in ("shared-prefix", "no-sharing"):
        indices = []
        if layout == "shared-prefix":
            base = groups * shared
            for g in range(groups):
                for r in range(per_group):
                    own = base + (g * per_group + r) * private
                    indices.append(list(range(g * shared, (g + 1) * shared)) + list(range(own, own + private)))
        else:
            indices = [list(range(i * (shared + private), (i + 1) * (shared + private))) for i in range(n)]
        total_pages = max(max(x) for x in indices) + 1
        q = torch.randn(n, qo_heads, head_dim, dtype=torch.bfloat16, device="cuda")
        indptr = torch.tensor([0] + [len(x) for x in indices]).cumsum(0).int()
        flat = torch.tensor([p for x in indices for p in x], dtype=torch.int32, device="cuda")
        last = torch.full((n,), page_size, dtype=torch.int32)
        # Cache layouts: K and V of a layer in two dense tensors (layer-first, the engine's), or
        # page-first, where a token's K for one layer sits among those of the others.
        layer_first = torch.randn(2, total_pages, page_size, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
        caches = {"layer-first": (layer_first[0], layer_first[1])}
        page_first = torch.randn(
            2, total_pages, PAGE_FIRST_LAYERS, page_size, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda"
        )
        caches["page-first"] = (page_first[0, :, 0], page_first[1, :, 0])
        for storage, kv in caches.items():
            for tensor_cores in (True, False):
                ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
                w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tensor_cores)
                w.plan(
                    indptr,
                    flat,
                    last,
                    qo_heads,
                    kv_heads,
                    head_dim,
                    page_size,
                    q_data_type=torch.bfloat16,
                    kv_data_type=torch.bfloat16,
                )
                w.run(q, kv)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(iters):
                    w.run(q, kv)
                end.record()
                end.synchronize()
                ms = start.elapsed_time(end) / iters
                distinct = total_pages * page_size * 2 * kv_heads * head_dim * 2
                rows.append(
                    {
                        "batch": layout,
                        "cache": storage,
                        "path": "tensor-core" if tensor_cores else "cuda-core",
                        "ms": ms,
                        "distinct_kv_floor_ms": distinct / bandwidth * 1e3,
                    }
                )
        del caches, layer_first, page_first  # free before the next layout's tensors
    return rows


def replay_ms(fn, iters: int = 20) -> float:
    """Milliseconds per call of ``fn`` when ``iters`` calls replay from one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / (5 * iters)


CASCADE_CASES = [  # (batch, groups, shared tokens); every request also has 256 tokens of its own
    (256, 16, 2048),
    (256, 1, 2048),
    (256, 4, 2048),
    (256, 64, 2048),
    (64, 1, 2048),
    (64, 4, 2048),
    (64, 16, 2048),
    (128, 64, 2048),
    (128, 64, 256),
    (128, 64, 512),  # pairs
    (256, 16, 256),
    (256, 64, 256),
    (256, 16, 512),
    (256, 64, 512),
    (64, 16, 256),
    (64, 32, 512),
    (256, 0, 0),
    (64, 0, 0),  # no sharing: 2304 tokens of its own each
    (64, 8, 2048, 32),
    (256, 16, 2048, 64),  # groups and loose requests of 2304 tokens
]


CASCADE_VARIANTS = [  # (name, step kind, FlashInferBackend options); knob variants run as cascade
    # steps where the case has groups, else as plain steps on our kernel
    ("plain", "plain", {"decode_backend": "flashinfer"}),  # FlashInfer's tensor-core decode
    ("plain_triton", "plain", {}),  # our kernel, the default
    ("cascade", "cascade", {}),  # the engine's cascade step: equal to plain_triton bit for bit
] + [
    (name, "auto", {"cascade_options": options})
    for name, options in {  # the kernel's knobs
        "bn128_stages3": dict(block_n=128, num_stages=3),  # session 11's default: single-buffered tiles
        "bn32": dict(block_n=32),  # keys per tile
        "bn64": dict(block_n=64),  # (fp8 pages default to 128)
        "bn128": dict(block_n=128),  # (two 128-key buffers leave room for one program per SM)
        "stages4": dict(num_stages=4),  # pipeline depth (4 and fewer: one K/V buffer)
        "stages6": dict(num_stages=6),
        "warps8": dict(num_warps=8),
        "own_warps2": dict(own_num_warps=2),  # the own level alone (its items are short and many)
        "plain_warps2": dict(plain_num_warps=2),  # plain steps alone (fp8 pages with GQA 2 default to 2)
        "plain_warps4": dict(plain_num_warps=4),
        "own_warps8": dict(own_num_warps=8),
        "own_stages3": dict(own_num_stages=3),
        "own_stages2": dict(own_num_stages=2),
        "rows16": dict(shared_rows=16),  # query rows a shared item packs
        "rows32": dict(shared_rows=32),
        "own_maxnreg128": dict(cascade_own_maxnreg=128),  # cascade steps' own level capped (more CTAs per SM)
        "cascade_stages2": dict(cascade_num_stages=2),  # both levels of cascade steps
        "cascade_stages3": dict(cascade_num_stages=3),
        "rows64": dict(shared_rows=64),
        "items4": dict(items_per_sm=4),  # items per SM that segment lengths aim at
        "items16": dict(items_per_sm=16),
        "items32": dict(items_per_sm=32),
        "items64": dict(items_per_sm=64),
        "programs4": dict(programs_per_sm=4),  # CTAs per SM under graphs
        "programs16": dict(programs_per_sm=16),
    }.items()
]


def cascade_kernels(
    qo_heads: int,
    kv_heads: int,
    head_dim: int,
    page_size: int,
    bandwidth: float,
    cases: list[tuple[int, int, int]] = CASCADE_CASES,
    variants: list[str] | None = None,
    kv_dtype: torch.dtype = torch.bfloat16,
) -> list[dict]:
    from minisgl.device.attention.flashinfer_backend import FlashInferBackend
    from minisgl.device.attention.synthetic import decode_metadata
    from minisgl.device.kvcache.mha_pool import MHAKVCache

    own_len, rows = 256, []
    for batch, groups, shared, *rest in cases:
        shared_pages = shared // page_size
        loose_len = rest[1] if len(rest) > 1 else 2304
        loose = [loose_len + 1] * (rest[0] if rest else 0 if groups else batch)
        grouped = batch - len(loose)
        per = [grouped // groups + (g < grouped % groups) for g in range(groups)]
        layout = [(shared_pages, [shared + own_len + 1] * n) for n in per]
        total_pages = int(decode_metadata(page_size, layout, loose, "cpu").page_table_host.max()) + 1
        cache = MHAKVCache(total_pages, page_size, 1, kv_heads, head_dim, kv_dtype, torch.device("cuda"))
        cache.buffer.copy_(torch.randn(cache.buffer.shape, device="cuda").to(kv_dtype))
        q = torch.randn(batch, qo_heads, head_dim, dtype=torch.bfloat16, device="cuda")
        row = {
            "batch": batch,
            "groups": groups,
            "shared_tokens": shared,
            "own_tokens": own_len if groups else loose_len,
            "loose_requests": len(loose),
            "distinct_kv_floor_ms": total_pages
            * page_size
            * 2
            * kv_heads
            * head_dim
            * kv_dtype.itemsize
            / bandwidth
            * 1e3,
        }
        for name, kind, kw in CASCADE_VARIANTS:
            cascade = kind == "cascade" or (kind == "auto" and groups > 0)
            if (cascade and not groups) or (variants and name not in variants):
                continue
            backend = FlashInferBackend(cache, qo_heads, kv_heads, head_dim, dtype=torch.bfloat16, **kw)
            meta = decode_metadata(page_size, layout, loose, "cuda", cascade=cascade)
            backend.init_cuda_graph(batch, meta.page_table_host.shape[1])
            backend.prepare(meta, graph_batch_size=batch)
            row[f"{name}_ms"] = replay_ms(lambda: backend.forward(q, 0))
            kv = (cache.k_cache(0), cache.v_cache(0))
            if name != "plain":
                for part in ("shared", "own", "combine") if cascade else ("own", "combine"):
                    row[f"{name}_{part}_ms"] = replay_ms(
                        lambda: backend.cascade.forward(q, *kv, backend.scale, (part,))
                    )
            backend = None  # (its buffers go before the next variant's)
        rows.append(row)
        del cache
        torch.cuda.empty_cache()
        cells = "  ".join(f"{k} {v:.3f}" for k, v in row.items() if k.endswith("_ms"))
        print(f"  batch {batch:3d} groups {groups:3d} shared {shared:4d}: {cells}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64, 128, 256])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--page-size", type=int, default=EngineArgs.page_size)
    ap.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="BS",
        help="print a torch-profiler table of 5 pipelined steps at this batch size and exit",
    )
    ap.add_argument("--out", default=None)
    ap.add_argument("--quantization", default=None, choices=["fp8"], help="fp8: W8A8 linear layers")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3"])
    ap.add_argument("--parts", type=int, nargs="+", default=[1, 2, 3], help="which parts to run")
    ap.add_argument(
        "--lora",
        type=int,
        nargs=2,
        default=None,
        metavar=("SLOTS", "RANK"),
        help="part 1 with LoRA on every module: SLOTS random adapters of RANK, request i under "
        "adapter i %% SLOTS (every adapter in every step past batch SLOTS); add --lora-base for rows "
        "under the base model (what enabling LoRA costs requests that use none)",
    )
    ap.add_argument("--lora-base", action="store_true", help="with --lora: every row under the base model")
    ap.add_argument(
        "--cascade-cases",
        nargs="+",
        default=None,
        metavar="BxGxS",
        help="part 3 cases as batch x groups x shared tokens [x loose requests among the batch "
        "[x their tokens, 2304]], e.g. 256x16x2048, 64x8x2048x32 or 64x0x0x64x1024 (default: all)",
    )
    ap.add_argument(
        "--heads-of-tp",
        type=int,
        default=1,
        metavar="N",
        help="part 3: one rank's heads of a tp=N engine (segments cut as that engine cuts them)",
    )
    ap.add_argument(
        "--cascade-variants",
        nargs="+",
        default=None,
        help=f"part 3 variants (default: all of {', '.join(v[0] for v in CASCADE_VARIANTS)})",
    )
    args = ap.parse_args()

    bw = copy_bandwidth()
    cfg = ModelConfig.from_path(Path(args.model))
    result = {
        "model": args.model,
        "lora": args.lora,
        "gpu": torch.cuda.get_device_name(),
        "copy_bandwidth": bw,
        "context": args.context,
        "page_size": args.page_size,
    }
    if 3 in args.parts:
        print(
            f"one layer of decode attention, {cfg.num_heads} q / {cfg.num_kv_heads} kv heads, page size "
            f"{args.page_size}: plain vs cascade (CUDA-graph replays, ms)"
        )
        cases = [tuple(map(int, c.split("x"))) for c in args.cascade_cases] if args.cascade_cases else CASCADE_CASES
        kv_dtype = torch.float8_e4m3fn if args.kv_cache_dtype == "fp8_e4m3" else torch.bfloat16
        tp = args.heads_of_tp
        set_tp_info(0, tp)
        result["cascade"] = cascade_kernels(
            cfg.num_heads // tp,
            cfg.num_kv_heads // tp,
            cfg.head_dim,
            args.page_size,
            bw,
            cases,
            args.cascade_variants,
            kv_dtype,
        )
        set_tp_info(0, 1)
    if 1 not in args.parts and 2 not in args.parts:
        save_result(result, args.out, f"decode_{Path(args.model).name}")
        return
    max_bs = max(args.batch_sizes)
    runner = ModelRunner(
        EngineArgs(
            model=args.model,
            load_format="dummy",
            device="cuda",
            context_length=args.context + 64,
            page_size=args.page_size,
            max_running_requests=max_bs,
            max_total_tokens=max_bs * cdiv(args.context + 1, args.page_size) * args.page_size,
            quantization=args.quantization,
            kv_cache_dtype=args.kv_cache_dtype,
            **(
                dict(enable_lora=True, max_loras_per_batch=args.lora[0], max_lora_rank=args.lora[1])
                if args.lora
                else {}
            ),
        )
    )
    if args.lora and not args.lora_base:
        fill_adapters(runner)
    weight_bytes = sum(p.numel() * p.element_size() for n, p in runner.model.named_parameters() if ".experts." not in n)
    expert_bytes = sum(p.numel() * p.element_size() for n, p in runner.model.named_parameters() if ".experts." in n)
    kv_per_token = runner.kv_cache.buffer.nbytes // ((runner.num_pages + 1) * args.page_size)
    print(
        f"copy bandwidth {bw / 1e12:.2f} TB/s; weights {weight_bytes / 2**30:.2f} GiB; "
        f"KV {kv_per_token / 1024:.0f} KiB/token; page size {args.page_size}; {torch.cuda.get_device_name()}"
    )
    if args.profile:
        profile(runner, args.profile, args.context)
        return
    print(f"{'batch':>6} {'sync ms':>9} {'pipe ms':>9} {'floor ms':>9} {'pipe/floor':>10}")
    steps = []
    for bs in args.batch_sizes:
        sync, pipe = step_times(runner, bs, args.context, args.iters)
        floor = (weight_bytes + expert_bytes * active_share(runner.config, bs) + bs * args.context * kv_per_token) / bw
        steps.append({"batch": bs, "sync_ms": sync * 1e3, "pipelined_ms": pipe * 1e3, "floor_ms": floor * 1e3})
        print(f"{bs:>6} {sync * 1e3:9.2f} {pipe * 1e3:9.2f} {floor * 1e3:9.2f} {pipe / floor:10.2f}", flush=True)
    del runner  # free its cache for the kernel comparison's own (graphs hold a cycle: collect it)
    gc.collect()
    torch.cuda.empty_cache()
    result.update(weight_bytes=weight_bytes, kv_bytes_per_token=kv_per_token, steps=steps)
    if 2 in args.parts:
        kernels = attention_kernels(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, args.page_size, bw)
        print(f"\none layer of decode attention, {cfg.num_heads} q / {cfg.num_kv_heads} kv heads, 256 requests:")
        for k in kernels:
            print(
                f"  {k['batch']:14s} {k['cache']:12s} {k['path']:12s} {k['ms']:7.3f} ms  (distinct KV read once: "
                f"{k['distinct_kv_floor_ms']:.3f} ms)"
            )
        result["attention"] = kernels
    save_result(result, args.out, f"decode_{Path(args.model).name}")


if __name__ == "__main__":
    main()
