"""Online serving: the shared-prefix workload through HTTP /generate streaming.

    python benchmarks/online_serving.py --model benchmarks/configs/llama3.1-8b --max-concurrency 64
    python benchmarks/online_serving.py --url http://127.0.0.1:30000 --request-rate 8

Starts ``python -m minisgl.launch`` with dummy weights (unless ``--url`` points at a running
server), sends every request as token ids with ``ignore_eos``, either at a Poisson request rate
or keeping at most ``--max-concurrency`` in flight, and reports request and token throughput,
TTFT, inter-token latency (as SGLang's bench_serving counts it: an event that brings n tokens
after a gap g gives n gaps of g / n) and end-to-end latency (mean, p50, p99) and the cache hit
rate (the server's, and the client's: cached prompt tokens over prompt tokens, which holds behind
the ``--dp-size`` router too, where the server's figure is one replica's).

    python benchmarks/online_serving.py --model benchmarks/configs/llama3.1-8b --server-args --dp-size 2
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import random
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import aiohttp
import httpx
import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.server import start_server  # noqa: E402
from benchmarks.workloads import WORKLOADS, save_result  # noqa: E402


class _Meta(msgspec.Struct):
    completion_tokens: int
    cached_tokens: int


class _Event(msgspec.Struct):
    meta_info: _Meta


class _EventWithIds(_Event):
    output_ids: list[int] | None = None  # cumulative


# Only the counters are decoded unless the ids are wanted: the client must not become the
# bottleneck it measures (a stream's output_ids are cumulative).
_decoders = {False: msgspec.json.Decoder(_Event), True: msgspec.json.Decoder(_EventWithIds)}


def client_session() -> aiohttp.ClientSession:
    """The streaming client: aiohttp, as SGLang's bench_serving uses; it parses HTTP in C and spent
    half of httpx's CPU per streamed event here (28 vs 56 us, 256 streams), which matters once the
    client streams tens of thousands of tokens a second."""
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=None), connector=aiohttp.TCPConnector(limit=0), read_bufsize=1 << 20
    )


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """User + system CPU seconds so far of each server process (local servers only)."""
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    for name, pid in pids.items():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[name] = (int(fields[11]) + int(fields[12])) / ticks
    return out


REPLICA_COUNTERS = ("prefix_queried_tokens", "prefix_hit_tokens", "prefill_tokens", "decode_steps")


def replica_counters(url: str) -> dict[str, dict[str, float]]:
    """Each replica's scheduler counters behind a ``--dp-size`` router (its ``/workers`` list),
    keyed by replica URL; empty for a single server. The difference of two readings says how the
    router spread the work: prompt tokens routed to each replica, and what each computed."""
    workers = httpx.get(f"{url}/workers", timeout=30)
    if workers.status_code != 200:
        return {}
    out = {}
    for w in workers.json().get("workers", []):
        sched = httpx.get(f"{w['url']}/get_server_info", timeout=30).json()["scheduler"]
        out[w["url"]] = {k: sched[k] for k in REPLICA_COUNTERS}
    return out


def token_gaps(arrivals: list[tuple[float, int]]) -> list[float]:
    """Inter-token latencies from a stream's (time, new tokens) events, as SGLang's bench_serving
    counts them: an event that brings n tokens a gap g after the one before gives n gaps of g / n."""
    return [(b - a) / n for (a, _), (b, n) in zip(arrivals, arrivals[1:]) for _ in range(n)]


async def stream_generate(
    client: aiohttp.ClientSession, url: str, prompt: list[int], max_new: int, with_ids: bool = False
) -> dict:
    """One greedy ``ignore_eos`` request streamed through /generate: its TTFT, end-to-end time,
    inter-token gaps (``token_gaps``), tokens, cached prompt tokens and, ``with_ids``, its output
    ids; an HTTP failure gives {"error": ...} (counted, as bench_serving does, not the end of a run)."""
    body = {
        "input_ids": prompt,
        "stream": True,
        "sampling_params": {"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True},
    }
    decoder = _decoders[with_ids]
    start = time.perf_counter()
    arrivals, tokens, cached, ids = [], 0, 0, []
    try:
        async with client.post(f"{url}/generate", json=body) as r:
            if r.status >= 400:
                return {"error": f"HTTP {r.status}: {(await r.text())[:200]}", "prompt": len(prompt)}
            async for line in r.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                event = decoder.decode(line[6:])
                meta = event.meta_info
                if meta.completion_tokens > tokens:  # an event with new tokens (one or, when joined, several)
                    arrivals.append((time.perf_counter(), meta.completion_tokens - tokens))
                    tokens = meta.completion_tokens
                cached = meta.cached_tokens
                if with_ids and event.output_ids is not None:
                    ids = event.output_ids
    except aiohttp.ClientError as e:
        return {"error": f"{type(e).__name__}: {e}", "prompt": len(prompt)}
    end = time.perf_counter()
    return {
        "ttft": (arrivals[0][0] if arrivals else end) - start,
        "e2e": end - start,
        "itl": token_gaps(arrivals),
        "tokens": tokens,
        "cached": cached,
        "prompt": len(prompt),
        **({"output_ids": ids} if with_ids else {}),
    }


async def run(
    url: str, prompts: list[list[int]], output_lens: list[int], rate: float | None, concurrency: int | None, seed: int
) -> tuple[list[dict], float]:
    rng = random.Random(seed)
    limit = asyncio.Semaphore(concurrency or len(prompts))
    async with client_session() as client:

        async def gated(p: list[int], n: int) -> dict:
            async with limit:
                return await stream_generate(client, url, p, n)

        start = time.perf_counter()
        tasks = []
        for p, n in zip(prompts, output_lens):
            tasks.append(asyncio.create_task(gated(p, n)))
            if rate:
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - start


def _client_slice(
    url: str,
    prompts: list[list[int]],
    output_lens: list[int],
    rate: float | None,
    concurrency: int | None,
    seed: int,
    start_at: float,
) -> tuple[list[dict], float, float]:
    """One client process's share: from the common start time; returns its results, end time
    (epoch seconds) and CPU seconds."""
    time.sleep(max(0.0, start_at - time.time()))
    results, _ = asyncio.run(run(url, prompts, output_lens, rate, concurrency, seed))
    return results, time.time(), time.process_time()


def run_clients(
    url: str, prompts: list[list[int]], output_lens: list[int], rate: float | None, concurrency: int | None, procs: int
) -> tuple[list[dict], float, float]:
    """The requests dealt round-robin over ``procs`` client processes (one Python process
    streaming hundreds of requests saturates its core before a fast server does), each with
    its share of the rate and concurrency. Returns results, elapsed seconds, client CPU seconds."""
    if procs == 1:
        before = time.process_time()
        results, elapsed = asyncio.run(run(url, prompts, output_lens, rate, concurrency, seed=0))
        return results, elapsed, time.process_time() - before
    start_at = time.time() + 2.0  # every process ready before the first request
    with ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [
            pool.submit(
                _client_slice,
                url,
                prompts[i::procs],
                output_lens[i::procs],
                rate / procs if rate else None,
                -(-concurrency // procs) if concurrency else None,
                i,
                start_at,
            )
            for i in range(procs)
        ]
        parts = [f.result() for f in futures]
    return [r for part in parts for r in part[0]], max(p[1] for p in parts) - start_at, sum(p[2] for p in parts)


def summary(values: list[float]) -> dict[str, float]:
    v = sorted(values)
    pick = lambda q: v[min(len(v) - 1, int(q * len(v)))]  # noqa: E731
    return {"mean": sum(v) / len(v), "p50": pick(0.5), "p99": pick(0.99)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint or config folder to serve (ignored with --url)")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--url", default=None)
    ap.add_argument("--port", type=int, default=30123)
    ap.add_argument("--workload", default="shared-prefix", choices=list(WORKLOADS))
    ap.add_argument("--request-rate", type=float, default=None, help="requests/s (Poisson); default all at once")
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--num-prompts", type=int, default=None, help="only the first N requests of the workload")
    ap.add_argument(
        "--client-procs",
        type=int,
        default=1,
        help="client processes sharing the requests (when one client core saturates)",
    )
    ap.add_argument("--server-args", nargs=argparse.REMAINDER, default=[], help="passed to minisgl.launch")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args.model, args.port, args.server_args, args.load_format)
    try:
        vocab = httpx.get(f"{url}/get_model_info", timeout=30).json()["vocab_size"]
        wl = WORKLOADS[args.workload](vocab)
        n = args.num_prompts or len(wl.prompts)
        pids = httpx.get(f"{url}/get_server_info", timeout=30).json()["processes"]
        cpu_before, replicas_before = cpu_seconds(pids), replica_counters(url)
        results, elapsed, client_cpu = run_clients(
            url, wl.prompts[:n], wl.output_lens[:n], args.request_rate, args.max_concurrency, args.client_procs
        )
        cpu = {k: (v - cpu_before[k]) / elapsed for k, v in cpu_seconds(pids).items() if k in cpu_before}
        cpu["benchmark client"] = client_cpu / elapsed
        sched = httpx.get(f"{url}/get_server_info", timeout=30).json()["scheduler"]
        replicas = {
            u: {k: v - replicas_before[u][k] for k, v in now.items()}
            for u, now in replica_counters(url).items()
            if u in replicas_before
        }
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    failed = [r["error"] for r in results if "error" in r]
    results = [r for r in results if "error" not in r]
    if not results:
        raise SystemExit(f"every request failed: {sorted(set(failed))}")
    out_tokens = sum(r["tokens"] for r in results)
    report = {
        "workload": args.workload,
        "requests": len(results),
        "failed_requests": len(failed),
        "errors": sorted(set(failed)),
        "seconds": elapsed,
        "request_rate": args.request_rate,
        "max_concurrency": args.max_concurrency,
        "client_procs": args.client_procs,
        "request_throughput": len(results) / elapsed,
        "output_tok_per_s": out_tokens / elapsed,
        "total_tok_per_s": (out_tokens + sum(r["prompt"] for r in results)) / elapsed,
        "ttft_s": summary([r["ttft"] for r in results]),
        "itl_s": summary([x for r in results for x in r["itl"]]),
        "e2e_s": summary([r["e2e"] for r in results]),
        "cache_hit_rate": sched["cache_hit_rate"],
        "client_cache_hit_rate": sum(r["cached"] for r in results) / sum(r["prompt"] for r in results),
        "cached_tokens_reported": sum(r["cached"] for r in results),
        "server_args": args.server_args,
        "cpu_busy": cpu,
        "replicas": replicas,
    }
    print(
        f"{args.workload}: {len(results)} requests in {elapsed:.2f} s, {report['request_throughput']:.2f} req/s, "
        f"{report['output_tok_per_s']:.0f} out tok/s, cache hit rate {report['cache_hit_rate']:.3f} "
        f"(client {report['client_cache_hit_rate']:.3f})" + (f", {len(failed)} FAILED: {failed[0]}" if failed else "")
    )
    for key in ("ttft_s", "itl_s", "e2e_s"):
        s = report[key]
        ms = {q: s[q] * 1e3 for q in ("mean", "p50", "p99")}
        print(f"  {key[:-2]:5s} mean {ms['mean']:9.1f} ms  p50 {ms['p50']:9.1f} ms  p99 {ms['p99']:9.1f} ms")
    for u, r in replicas.items():
        print(
            f"  replica {u}: {r['prefix_queried_tokens']:.0f} prompt tokens routed, "
            f"{r['prefill_tokens']:.0f} computed, {r['decode_steps']:.0f} decode steps"
        )
    print("  CPU busy (share of one core): " + ", ".join(f"{k} {v:.0%}" for k, v in cpu.items()))
    name = Path(args.model).name if args.model else "server"
    save_result(report, args.out, f"online_{name}")


if __name__ == "__main__":
    main()
