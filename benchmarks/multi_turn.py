"""Multi-turn chat whose working set outgrows the device KV pool: the hierarchical cache's workload.

    python benchmarks/multi_turn.py --model benchmarks/configs/llama3.1-8b --load-format dummy
    python benchmarks/multi_turn.py --model ... --online          # through HTTP, with TTFT

N conversations x R rounds; each round adds a user turn (``--turn-len`` tokens) and the answer
the model gives (``--answer-len`` tokens, or around it with ``--answer-jitter``) to the
conversation's history. At most ``--max-parallel`` turns run at once, conversations taking turns,
so a conversation comes back after the others have passed through the pool. The device pool is
capped (``--max-total-tokens``, by default the final working set / ``--oversubscribe``), and three
runs compare:

- ``device``: the capped pool alone (evicted history is prefilled again);
- ``hicache``: the capped pool plus the host tier (``--enable-hierarchical-cache``, a host pool
  holding the whole working set);
- ``big``: a device pool holding everything (the hit rate the host tier should come close to);
- ``no-radix``: the same pool with the radix cache off (every turn prefills its whole history).

Reports throughput, prompt tokens computed, the hit rate by tier and, online, TTFT p50/p90.
Offline, the LLM API runs each wave of ``--max-parallel`` turns as one ``generate`` call; online,
each conversation is a client sending its next turn when the last answer is back.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import sys
import time
from pathlib import Path

import aiohttp
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.online_serving import client_session, stream_generate, summary  # noqa: E402
from benchmarks.server import start_server  # noqa: E402
from benchmarks.workloads import save_result  # noqa: E402

MODES = ("device", "hicache", "big", "no-radix")


def histories(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    """Each conversation's opening (a system prompt of ``--system-len`` tokens, distinct per
    conversation)."""
    rng = random.Random(args.seed)
    return [[rng.randrange(vocab) for _ in range(args.system_len)] for _ in range(args.conversations)]


def turns(args: argparse.Namespace, vocab: int) -> list[list[list[int]]]:
    """turns[r][c]: conversation c's user message in round r."""
    rng = random.Random(args.seed + 1)
    return [
        [[rng.randrange(vocab) for _ in range(args.turn_len)] for _ in range(args.conversations)]
        for _ in range(args.rounds)
    ]


def answer_lens(args: argparse.Namespace) -> list[list[int]]:
    """lens[r][c]: the tokens conversation c's answer in round r asks for: ``--answer-len``, or
    with ``--answer-jitter j`` drawn uniformly from answer_len * (1 +- j) (the same mean). Equal
    lengths make turns that start together end together, so online the next turns arrive in
    waves and their prefills never land while others decode."""
    rng = random.Random(args.seed + 2)
    assert 0 <= args.answer_jitter < 1, "--answer-jitter is a fraction of --answer-len, below 1"
    spread = int(args.answer_len * args.answer_jitter)
    return [
        [args.answer_len + rng.randint(-spread, spread) for _ in range(args.conversations)] for _ in range(args.rounds)
    ]


def working_set(args: argparse.Namespace) -> int:
    return args.conversations * (args.system_len + args.rounds * (args.turn_len + args.answer_len))


def engine_flags(args: argparse.Namespace, mode: str) -> dict:
    """EngineArgs of a mode: the device pool size, and the host tier's."""
    total = working_set(args)
    small = args.max_total_tokens or int(total // args.oversubscribe)
    flags = {"max_total_tokens": int(total * 1.25) if mode in ("big", "no-radix") else small}
    if mode == "no-radix":
        flags["disable_radix_cache"] = True
    if mode == "hicache":
        flags.update(
            enable_hierarchical_cache=True, hicache_ratio=1.25 * total / small, hicache_write_policy=args.write_policy
        )
    return flags


def tier_stats(stats: dict) -> dict:
    queried = max(stats["prefix_queried_tokens"], 1)
    return {
        "hit_rate": stats["prefix_hit_tokens"] / queried,
        "host_hit_rate": stats.get("prefix_host_hit_tokens", 0) / queried,
        "prefill_tokens": stats["prefill_tokens"],
        "host_loaded_pages": stats.get("host_loaded_pages", 0),
        "host_written_pages": stats.get("host_written_pages", 0),
        "retractions": stats["retractions"],
    }


def run_offline(args: argparse.Namespace, mode: str) -> dict:
    import torch

    from minisgl.llm import LLM
    from minisgl.wire.sampling import SamplingParams

    llm = LLM(args.model, load_format=args.load_format, **engine_flags(args, mode), **args.engine)
    vocab = llm.runner.vocab_size
    hist, user, lens = histories(args, vocab), turns(args, vocab), answer_lens(args)
    greedy = dict(temperature=0.0, ignore_eos=True)
    llm.generate([[1] * 64], SamplingParams(max_new_tokens=4, **greedy))  # warm up outside the timing
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    prompt_tokens = out_tokens = 0
    start = time.perf_counter()
    for r in range(args.rounds):
        for at in range(0, args.conversations, args.max_parallel):
            wave = range(at, min(at + args.max_parallel, args.conversations))
            prompts = [hist[c] + user[r][c] for c in wave]
            params = [SamplingParams(max_new_tokens=lens[r][c], **greedy) for c in wave]
            for c, res in zip(wave, llm.generate(prompts, params)):
                hist[c] = prompts[c - at] + res["output_ids"]
                prompt_tokens += len(prompts[c - at])
                out_tokens += len(res["output_ids"])
    seconds = time.perf_counter() - start
    result = {
        "mode": mode,
        "seconds": seconds,
        "prompt_tokens": prompt_tokens,
        "output_tokens": out_tokens,
        "total_tok_per_s": (prompt_tokens + out_tokens) / seconds,
        **tier_stats(llm.scheduler.stats()),
        **engine_flags(args, mode),
    }
    if getattr(llm.runner, "host_pool", None) is not None:
        llm.runner.host_pool.close()
    del llm
    gc.collect()  # the engine's weights, pools and graphs go before the next mode's are made
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return result


async def run_online_clients(args: argparse.Namespace, url: str, vocab: int) -> tuple[list[dict], float]:
    hist, user, lens = histories(args, vocab), turns(args, vocab), answer_lens(args)
    gate = asyncio.Semaphore(args.max_parallel)
    results: list[dict] = []

    async def conversation(c: int, client: aiohttp.ClientSession) -> None:
        for r in range(args.rounds):
            prompt = hist[c] + user[r][c]
            async with gate:
                res = await stream_generate(client, url, prompt, lens[r][c], with_ids=True)
            if "error" in res:
                raise RuntimeError(f"turn {r} of conversation {c} failed: {res['error']}")
            hist[c] = prompt + res.pop("output_ids")
            results.append(res)

    async with client_session() as client:
        await stream_generate(client, url, [1] * 64, 4)  # warm up
        start = time.perf_counter()
        await asyncio.gather(*(conversation(c, client) for c in range(args.conversations)))
    return results, time.perf_counter() - start


def run_online(args: argparse.Namespace, mode: str) -> dict:
    flags = []
    for name, value in {**engine_flags(args, mode), **args.engine}.items():
        flag = "--" + name.replace("_", "-")
        flags += [flag] if value is True else [flag, str(value)]
    proc, url = start_server(args.model, args.port, flags, args.load_format)
    try:
        vocab = httpx.get(f"{url}/get_model_info").json().get("vocab_size", 32000)
        results, seconds = asyncio.run(run_online_clients(args, url, vocab))
        stats = httpx.get(f"{url}/get_server_info").json()["scheduler"]
    finally:
        proc.terminate()
        proc.wait(30)
    ttft = summary([r["ttft"] for r in results])
    ttft_sorted = sorted(r["ttft"] for r in results)
    prompt_tokens = sum(r["prompt"] for r in results)
    return {
        "mode": mode,
        "seconds": seconds,
        "turns_per_s": len(results) / seconds,
        "total_tok_per_s": (prompt_tokens + sum(r["tokens"] for r in results)) / seconds,
        "ttft_p50": ttft["p50"],
        "ttft_p90": ttft_sorted[int(0.9 * (len(ttft_sorted) - 1))],
        "ttft_mean": ttft["mean"],
        **{f"itl_{k}": v for k, v in summary([x for r in results for x in r["itl"]]).items()},
        "client_hit_rate": sum(r["cached"] for r in results) / prompt_tokens,
        **tier_stats(stats),
        **engine_flags(args, mode),
    }


def engine_kwargs(text: str) -> dict:
    """``--engine-args`` k=v,k=v as EngineArgs keywords (true -> True, digits -> int)."""
    out = {}
    for item in filter(None, text.split(",")):
        k, v = item.split("=", 1)
        out[k] = True if v.lower() == "true" else int(v) if v.isdigit() else v
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--system-len", type=int, default=0)
    ap.add_argument("--turn-len", type=int, default=512)
    ap.add_argument("--answer-len", type=int, default=64)
    ap.add_argument("--answer-jitter", type=float, default=0.0, help="answer lengths uniform in answer_len * (1 +- j)")
    ap.add_argument("--max-parallel", type=int, default=8, help="turns running at once")
    ap.add_argument("--oversubscribe", type=float, default=4.0, help="final working set / device pool")
    ap.add_argument("--max-total-tokens", type=int, default=None, help="device pool (overrides --oversubscribe)")
    ap.add_argument("--write-policy", default="write_through")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", nargs="+", default=list(MODES[:3]), choices=MODES)
    ap.add_argument("--online", action="store_true", help="through HTTP (a server per mode), with TTFT")
    ap.add_argument("--port", type=int, default=30123)
    ap.add_argument("--engine-args", default="", help="more EngineArgs as k=v,k=v (e.g. device=cpu,dtype=float32)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.engine = engine_kwargs(args.engine_args)
    print(f"working set {working_set(args)} tokens; device pool {engine_flags(args, 'device')['max_total_tokens']}")
    rows = [(run_online if args.online else run_offline)(args, mode) for mode in args.modes]
    keys = ["seconds", "total_tok_per_s", "hit_rate", "host_hit_rate", "prefill_tokens", "retractions"]
    if args.online:
        keys += ["ttft_p50", "ttft_p90", "itl_p50", "itl_p99"]
    print(f"{'mode':10s}" + "".join(f"{k:>17s}" for k in keys))
    for row in rows:
        print(
            f"{row['mode']:10s}"
            + "".join(f"{row[k]:17.3f}" if isinstance(row[k], float) else f"{row[k]:17d}" for k in keys)
        )
    by = {r["mode"]: r for r in rows}
    if "big" in by and "no-radix" in by and args.online:
        print(f"radix / no radix: TTFT p50 {by['big']['ttft_p50'] / by['no-radix']['ttft_p50']:.2f}x")
    if "device" in by and "hicache" in by:
        print(
            f"hicache / device: throughput {by['hicache']['total_tok_per_s'] / by['device']['total_tok_per_s']:.2f}x"
            + (f", TTFT p50 {by['hicache']['ttft_p50'] / by['device']['ttft_p50']:.2f}x" if args.online else "")
        )
    save_result(
        {"args": {k: v for k, v in vars(args).items()}, "results": rows},
        args.out,
        f"multi_turn_{'online' if args.online else 'offline'}",
    )


if __name__ == "__main__":
    main()
