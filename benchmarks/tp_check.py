"""Tensor parallelism on GPUs: greedy tokens at tp=2 against tp=1, and decode throughput.

    NCCL_NVLS_ENABLE=0 python benchmarks/tp_check.py agreement --out results.json
    NCCL_NVLS_ENABLE=0 python benchmarks/tp_check.py throughput --model benchmarks/configs/llama3.1-8b

``agreement`` serves a tiny head-dim-128 Llama at tp=1 and tp=2, in fp32 (tokens must be equal)
and bf16 (a different summation order of the all-reduce flips near-ties: the share that match
and each first divergence are reported), 64 prompts x 48 greedy tokens through /generate.
``throughput`` serves dummy weights in the model's shapes and times decode at batch 64 with
1024-token prompts: the prompts are prefilled once (max_new_tokens 1), then run again from the
cache for 256 tokens, end to end, and for 32 and 288 tokens: the difference is decode alone.

Each tp=2 variant is one way to all-reduce: ``nccl`` (--disable-custom-all-reduce), ``one-shot``
(the symmetric-memory kernel for decode-sized tensors) and ``fp32`` (partial sums all-reduced in
float32 before rounding to the model's dtype, --enable-fp32-all-reduce). ``profile`` traces 40
decode steps of each (tp=1 first) through /start_profile and prints rank 0's kernel table.
``step`` leaves the server out: each rank builds a ModelRunner and times the same decode batch
three ways, to split a step between the GPU and the host: the captured graph replayed back to
back (the GPU alone), ``launch`` + ``collect`` one step ahead as the worker runs them (the
worker's host path too), and the host time of ``launch`` alone. It reads ``--quantization``
and ``--kv-cache-dtype`` from ``--server-args``; with ``--groups G --shared-len S`` the batch
runs as cascade steps of G groups sharing their first S tokens:

    NCCL_NVLS_ENABLE=0 python benchmarks/tp_check.py step --variants one-shot --batch 256 \
        --groups 16 --shared-len 2048 --prompt-len 2176 --server-args "--quantization fp8 --kv-cache-dtype fp8_e4m3"
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from local_server import serving  # noqa: E402

from benchmarks.agreement import agreement  # noqa: E402


def generate(url: str, prompts: list[list[int]], max_new: int) -> tuple[list[list[int]], float]:
    body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}
    start = time.perf_counter()
    r = httpx.post(f"{url}/generate", json=body, timeout=600)
    r.raise_for_status()
    return [o["output_ids"] for o in r.json()], time.perf_counter() - start


VARIANTS = {  # tp=2 all-reduce variants: extra server flags
    "nccl": ["--disable-custom-all-reduce"],
    "one-shot": [],
    "fp32": ["--enable-fp32-all-reduce"],
}


def run_agreement(variants: list[str], extra: list[str] = ()) -> dict:
    from minisgl.device.tiny_model import make_tiny_model

    model = make_tiny_model("llama", Path(tempfile.mkdtemp()) / "tiny-hd128", overrides={"head_dim": 128})
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randrange(8, 200))] for _ in range(64)]
    report = {}
    for dtype in ("float32", "bfloat16"):
        with serving(str(model), "--device", "cuda", "--dtype", dtype, *extra, timeout=600) as url:
            reference = generate(url, prompts, 48)[0]
        for name in variants:
            with serving(
                str(model), "--device", "cuda", "--dtype", dtype, "--tp-size", "2", *VARIANTS[name], *extra, timeout=600
            ) as url:
                report[f"{dtype} {name}"] = agreement(generate(url, prompts, 48)[0], reference)
    return report


def warmed_servers(
    model: str, batch: int, prompt_len: int, variants: list[str], extra: list[str] = ()
) -> Iterator[tuple[str, str, list]]:
    """For tp=1 and then each tp=2 variant: a dummy-weight server whose ``batch`` random prompts
    are already cached and whose decode shapes are warm; yields (variant, url, prompts)."""
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 100000) for _ in range(prompt_len)] for _ in range(batch)]
    for name in ["tp1", *variants]:
        tp = "1" if name == "tp1" else "2"
        with serving(
            model,
            "--device",
            "cuda",
            "--load-format",
            "dummy",
            "--tp-size",
            tp,
            "--context-length",
            "4096",
            *VARIANTS.get(name, []),
            *extra,
            timeout=900,
        ) as url:
            generate(url, prompts, 1)  # prefill once; later runs read the prompts from the cache
            generate(url, prompts, 8)  # warm
            yield name, url, prompts


def run_throughput(
    model: str, batch: int, prompt_len: int, new_tokens: int, variants: list[str], extra: list[str] = ()
) -> dict:
    """Per variant: one request batch of ``new_tokens`` tokens end to end (its one-token prefill
    and the HTTP round trip included), and the decode rate alone: the extra tokens of a batch
    ``new_tokens`` longer than a 32-token one over its extra time."""
    short = 32
    report = {}
    for name, url, prompts in warmed_servers(model, batch, prompt_len, variants, extra):
        _, seconds = generate(url, prompts, new_tokens)
        _, base = generate(url, prompts, short)
        _, longer = generate(url, prompts, short + new_tokens)
        report[name] = {
            "seconds": seconds,
            "decode_tok_per_s": batch * new_tokens / seconds,
            "decode_only_tok_per_s": batch * new_tokens / (longer - base),
        }
        if name != "tp1":
            for key in ("decode_tok_per_s", "decode_only_tok_per_s"):
                report[name][key.replace("tok_per_s", "speedup")] = report[name][key] / report["tp1"][key]
    return report


def run_profile(model: str, batch: int, prompt_len: int, variants: list[str], out_dir: Path) -> dict:
    """Kernel tables of 40 decode steps per variant (through /start_profile), and how busy the
    GPU was: a step that leaves the GPU idle is bound by the host, not by the kernels."""
    report = {}
    for name, url, prompts in warmed_servers(model, batch, prompt_len, variants):
        where = out_dir / name
        httpx.post(
            f"{url}/start_profile", json={"output_dir": str(where), "num_steps": 40, "activities": ["GPU"]}, timeout=30
        )
        generate(url, prompts, 48)
        deadline = time.monotonic() + 60
        while not (tables := sorted(where.glob("*/rank*.txt"))) and time.monotonic() < deadline:
            time.sleep(0.5)
        report[name] = {t.stem: t.read_text().splitlines()[0] for t in tables}
        print(f"== {name}\n" + "\n".join(tables[0].read_text().splitlines()[:22]) if tables else f"== {name}: no table")
    return report


def _flag_value(flags: list[str], name: str, default: str | None) -> str | None:
    """The value after ``name`` in ``flags`` (step mode builds EngineArgs itself, not from a
    command line, and takes only the flags that change a decode step's kernels)."""
    return flags[flags.index(name) + 1] if name in flags else default


def _step_rank(
    rank: int,
    world: int,
    model: str,
    batch: int,
    prompt_len: int,
    steps: int,
    flags: list[str],
    init: str,
    out: Path,
    profile_steps: int,
    items_per_sm: int,
    groups: int,
    shared_len: int,
) -> None:
    """One rank of ``step``: rank 0 writes the timings to ``out``. With ``groups``, the batch
    splits into that many cascade groups whose requests share their first ``shared_len`` tokens."""
    import torch
    import torch.distributed as dist

    from minisgl.config.args import EngineArgs
    from minisgl.device.distributed import set_tp_info
    from minisgl.device.worker.model_runner import ModelRunner
    from minisgl.wire.steps import ForwardBatch

    if world > 1:
        torch.cuda.set_device(rank)
        dist.init_process_group(
            "nccl", init_method=init, rank=rank, world_size=world, device_id=torch.device(f"cuda:{rank}")
        )
        set_tp_info(rank, world, "--enable-fp32-all-reduce" in flags)
    args = EngineArgs(
        model=model,
        load_format="dummy",
        device=f"cuda:{rank}",
        tp_size=world,
        context_length=4096,
        disable_custom_all_reduce="--disable-custom-all-reduce" in flags,
        cuda_graph_max_bs=batch,
        quantization=_flag_value(flags, "--quantization", None),
        kv_cache_dtype=_flag_value(flags, "--kv-cache-dtype", "auto"),
    )
    runner = ModelRunner(args)
    runner.kv_cache.buffer.zero_()  # the prompts' K/V are never written: keep NaNs out of attention
    if items_per_sm:  # fewer (longer) decode attention items than the default; planned per step
        sms = torch.cuda.get_device_properties(rank).multi_processor_count
        runner.attn.cascade.target_items = min(
            runner.attn.cascade.target_items, items_per_sm * sms // runner.num_kv_heads
        )
    page = runner.page_size
    per_req = -(-(prompt_len + 3 * steps + 8) // page)
    pages = {slot: list(range(slot * per_req, (slot + 1) * per_req)) for slot in range(batch)}
    shared = shared_len // page if groups else 0
    for slot in range(batch):  # a group's requests begin with its first request's pages
        first = slot - slot % (batch // groups) if groups else slot
        pages[slot][:shared] = pages[first][:shared]

    def decode_batch(k: int) -> ForwardBatch:
        """Step k of every request: its cached length grows by one per step; a page-table write
        for each request that starts a new page (all of them at k = 0)."""
        length = prompt_len + k
        b = ForwardBatch(
            slots=list(range(batch)),
            cached_lens=[length] * batch,
            new_lens=[1] * batch,
            input_ids=[-1] * batch,
            sample=[True] * batch,
            group_sizes=[batch // groups] * groups if groups else [],
            group_pages=[shared] * groups,
        )
        cols = range(per_req) if k == 0 else [length // page] if length % page == 0 else []
        for slot in range(batch):
            for col in cols:
                b.table_slots.append(slot)
                b.table_cols.append(col)
                b.table_pages.append(pages[slot][col])
        return b

    runner.step(decode_batch(0))
    k, host = 1, []
    for phase in ("warm", "timed"):
        if world > 1:
            dist.barrier()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            t = time.perf_counter()
            runner.launch(decode_batch(k))
            host.append(time.perf_counter() - t)
            k += 1
            if len(runner.pending) > 1:
                runner.collect()
        while runner.pending:
            runner.collect()
        loop = (time.perf_counter() - start) / steps
    graph = runner.graphs.graphs[runner.graphs._size(decode_batch(k)), groups > 0, False]
    if world > 1:
        dist.barrier()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        graph.replay()
    torch.cuda.synchronize()
    replay = (time.perf_counter() - start) / steps
    if profile_steps:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(profile_steps):
                graph.replay()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=70)
        (out.parent / f"kernels_rank{rank}.txt").write_text(f"{profile_steps} graph replays\n{table}")
    x = torch.zeros(16, device=runner.device)
    start = time.perf_counter()
    for _ in range(1000):
        x.add_(1)
    op = (time.perf_counter() - start) / 1000
    if rank == 0:
        out.write_text(
            json.dumps(
                {
                    "gpu_ms": replay * 1e3,
                    "worker_loop_ms": loop * 1e3,
                    "launch_host_ms": 1e3 * sum(host[steps:]) / steps,
                    "small_op_us": op * 1e6,
                }
            )
        )
    if world > 1:
        dist.barrier()
    torch.cuda.synchronize()
    os._exit(0)  # a symmetric-memory group's teardown can hang at exit; the timings are written


def run_step(
    model: str,
    batch: int,
    prompt_len: int,
    steps: int,
    variants: list[str],
    profile_steps: int,
    items_per_sm: int,
    tp_size: int = 2,
    extra: list[str] = (),
    groups: int = 0,
    shared_len: int = 0,
) -> dict:
    import torch.multiprocessing as mp

    report = {}
    for name in ["tp1", *variants]:
        world = 1 if name == "tp1" else tp_size
        out = Path(tempfile.mkdtemp()) / "step.json"
        init = f"file://{out.parent / 'init'}"
        mp.start_processes(
            _step_rank,
            args=(
                world,
                model,
                batch,
                prompt_len,
                steps,
                [*VARIANTS.get(name, []), *extra],
                init,
                out,
                profile_steps,
                items_per_sm,
                groups,
                shared_len,
            ),
            nprocs=world,
            start_method="spawn",
        )
        report[name] = json.loads(out.read_text())
        print(name, report[name], flush=True)
        for table in sorted(out.parent.glob("kernels_rank*.txt")):
            print(f"== {name} {table.stem}\n{table.read_text()}", flush=True)
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["agreement", "throughput", "profile", "step"])
    ap.add_argument("--model", default=str(ROOT / "benchmarks" / "configs" / "llama3.1-8b"))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=100, help="decode steps per timing (step mode)")
    ap.add_argument("--profile-steps", type=int, default=0, help="step mode: kernel tables of this many replays")
    ap.add_argument("--items-per-sm", type=int, default=0, help="step mode: decode attention items per SM")
    ap.add_argument("--tp-size", type=int, default=2, help="step mode: the ranks of each variant")
    ap.add_argument("--groups", type=int, default=0, help="step mode: cascade groups (0: every request alone)")
    ap.add_argument("--shared-len", type=int, default=0, help="step mode: the prompt tokens a group shares")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument(
        "--server-args",
        default="",
        help="more flags for every server (tp=1 too), e.g. '--quantization fp8 --kv-cache-dtype fp8_e4m3'; "
        "step mode reads --quantization and --kv-cache-dtype from them",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    extra = args.server_args.split()
    if args.mode == "agreement":
        report = run_agreement(args.variants, extra)
    elif args.mode == "step":
        report = run_step(
            args.model,
            args.batch,
            args.prompt_len,
            args.steps,
            args.variants,
            args.profile_steps,
            args.items_per_sm,
            args.tp_size,
            extra,
            args.groups,
            args.shared_len,
        )
    elif args.mode == "throughput":
        report = run_throughput(args.model, args.batch, args.prompt_len, args.new_tokens, args.variants, extra)
    else:
        out_dir = Path(args.out).parent if args.out else Path(tempfile.mkdtemp())
        report = run_profile(args.model, args.batch, args.prompt_len, args.variants, out_dir / "profiles")
    print(json.dumps(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
