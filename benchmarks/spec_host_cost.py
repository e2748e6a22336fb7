"""Host cost of drafting from the radix tree, as the tree grows: indexing per inserted token and
drafting per request, with 4x and 16x the sibling samples in the tree.

    python benchmarks/spec_host_cost.py --samples 64 256 1024

Each size builds a radix tree of one 512-token prompt and ``samples`` sampled continuations of
``--output-len`` tokens (a small vocabulary with repeated phrases, so lookups find matches),
then drafts for 32 running requests whose own outputs are partly done, as a verify step does.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workloads import save_result  # noqa: E402
from minisgl.config.args import EngineArgs
from minisgl.serve.cache.ngram_index import NgramIndex
from minisgl.serve.cache.radix_manager import RadixCacheManager
from minisgl.serve.scheduler.request import Req
from minisgl.serve.scheduler.speculative import Drafter
from minisgl.wire.sampling import SamplingParams


def sample(rng: random.Random, phrases: list[list[int]], length: int) -> list[int]:
    out: list[int] = []
    while len(out) < length:
        out += rng.choice(phrases) if rng.random() < 0.7 else [rng.randrange(32000)]
    return out[:length]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--output-len", type=int, default=512)
    ap.add_argument("--running", type=int, default=32)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for samples in args.samples:
        rng = random.Random(0)
        phrases = [[rng.randrange(32000) for _ in range(rng.randint(3, 8))] for _ in range(200)]
        prompt = [rng.randrange(32000) for _ in range(512)]
        outputs = [sample(rng, phrases, args.output_len) for _ in range(samples)]
        insert_us = {}
        for indexed in (False, True):  # the tree alone, then with the index
            cache = RadixCacheManager(page_size=1)
            cache.ngrams = NgramIndex(2, 6, capacity=EngineArgs.speculative_ngram_capacity) if indexed else None
            start = time.perf_counter()
            for out in outputs:
                ids = prompt + out
                cache.insert_prefix(ids, list(range(len(ids))))
            insert_us[indexed] = 1e6 * (time.perf_counter() - start) / (samples * args.output_len)
        drafter = Drafter(cache.ngrams, 2, 6)
        reqs = []
        for i in range(args.running):
            req = Req(i, prompt, SamplingParams(), 0, 4096)
            req.output_ids = sample(rng, phrases, args.output_len // 2)
            reqs.append(req)
        drafter.draft(reqs[0], 4)  # (first use)
        found = 0
        start = time.perf_counter()
        for _ in range(args.steps):
            for req in reqs:
                found += bool(drafter.draft(req, 4))
                req.output_ids.append(rng.choice(rng.choice(phrases)))
        draft_us = 1e6 * (time.perf_counter() - start) / (args.steps * args.running)
        row = {
            "samples": samples,
            "insert_us_per_token": insert_us[False],
            "insert_indexed_us_per_token": insert_us[True],
            "draft_us_per_request": draft_us,
            "found_share": found / (args.steps * args.running),
        }
        rows.append(row)
        print(
            f"{samples:5d} samples: insert {insert_us[False]:5.2f} us/token "
            f"({insert_us[True]:5.2f} indexed), "
            f"draft {draft_us:6.1f} us/request/step (found {row['found_share']:.2f})",
            flush=True,
        )
    save_result({"args": vars(args), "results": rows}, args.out, "spec_host_cost")


if __name__ == "__main__":
    main()
