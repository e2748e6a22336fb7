"""The cost side of speculative decoding: a verify step of k draft tokens per request against a
plain decode step, by batch size, on one engine (dummy weights in a real shape).

    python benchmarks/spec_cost.py --model benchmarks/configs/llama3.1-8b

Every request drafts ``k`` random tokens each step (so nearly none are accepted and each step
still advances one token): the time per step is what a verify step costs. ``k = 0`` is
speculation off. Together with an acceptance rate measured on real weights (spec_bench.py),
speedup ~= (1 + accepted per step) x plain step / verify step. ``--schedule`` is the verify
steps' ``--speculative-schedule`` (late: loaded while the step before runs, drafted after it).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workloads import save_result  # noqa: E402
from minisgl.config.args import SPEC_SCHEDULES
from minisgl.llm import LLM  # noqa: E402
from minisgl.serve.scheduler import spec_rule, speculative
from minisgl.wire.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 32, 64])
    ap.add_argument("--k", type=int, nargs="+", default=[0, 2, 4, 8])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--schedule", choices=list(SPEC_SCHEDULES), default="late", help="--speculative-schedule")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    # Every step verifies: the measured rule and the rests after misses are bypassed.
    spec_rule.SpecRule.pays = lambda self, decoding: True
    speculative.count_run = lambda req, kept: None
    llm = LLM(
        args.model,
        load_format=args.load_format,
        max_running_requests=max(256, max(args.batch)),
        speculative_algorithm="NGRAM",  # (graphs with room for the verify rows)
        speculative_num_draft_tokens=max(max(args.k), 1),
        speculative_disable_by_batch_size=max(args.batch),
    )
    rng = random.Random(0)
    vocab = llm.runner.vocab_size
    rows = []
    for batch in args.batch:
        prompts = [[rng.randrange(vocab) for _ in range(args.context)] for _ in range(batch)]
        params = SamplingParams(temperature=0.0, max_new_tokens=args.steps, ignore_eos=True)
        base = None
        for k in args.k:
            llm.args.speculative_algorithm = "NGRAM" if k else None
            llm.args.speculative_num_draft_tokens = max(k, 1)
            llm.args.speculative_schedule = args.schedule
            llm.reset_scheduler()
            if k:
                llm.scheduler.spec.drafter.draft = lambda req, count, pending=(): [
                    rng.randrange(vocab) for _ in range(count)
                ]
            llm.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=1))  # prefill, cached
            start = time.perf_counter()
            llm.generate(prompts, params)
            seconds = time.perf_counter() - start
            steps = llm.scheduler.stats()["decode_steps"]
            per_step = seconds / max(steps, 1)
            base = per_step if k == 0 else base
            rows.append({"batch": batch, "k": k, "seconds": seconds, "steps": steps, "ms_per_step": 1e3 * per_step})
            ratio = f"{per_step / base:.2f}x plain" if base else ""
            print(f"batch {batch:4d} k {k}: {1e3 * per_step:7.2f} ms/step ({steps} steps) {ratio}", flush=True)
    save_result({"args": vars(args), "results": rows}, args.out, f"spec_cost_{Path(args.model).name}")


if __name__ == "__main__":
    main()
