"""Speculative decoding drafted from the radix tree: one engine, speculation off and on in turn.

    python benchmarks/spec_bench.py --model SmolLM2-135M-Instruct.Q4_1.gguf --workload repeated
    python benchmarks/spec_bench.py --model SmolLM2-135M-Instruct.Q4_1.gguf --workload agent

``repeated``: arithmetic questions made here (chat template), ``--samples`` samples each at
``--temperature``, until EOS or ``--max-new-tokens``: the long tail of repeated sampling.
``code``: the same with coding questions, whose answers run longer (up to 8 questions).
``agent``: a generated code file sent again each round with one line edited and the model
asked to repeat it with that change, so its output repeats spans of its context.
Reports wall time, output tokens, verify steps and acceptance, and when the last 10% of
samples finished (the tail a repeated-sampling step waits for). Each mode runs on the same
engine (``LLM.reset_scheduler``), first a warm-up round. ``--rules measured always`` runs
speculation under the engine's measured rule and with every step that may speculate doing so.
``--repeats N`` runs every mode N times, one pass after another, and reports each mode's
median run and the median of its speedups over speculation off within each pass (passes of one
run spread 1.3-1.9 s on the H100; single runs moved 15% between leases). ``--schedules late
wait overlap`` runs each speculating mode under each ``--speculative-schedule``. Every sample
runs at once unless ``--max-running-requests`` says otherwise; ``--disable-by-batch-size 32
1024`` runs each speculating mode under each bound (``--speculative-disable-by-batch-size``).
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
from minisgl.config.args import SPEC_SCHEDULES
from minisgl.llm import LLM  # noqa: E402
from minisgl.serve.scheduler import spec_rule
from minisgl.serve.tokenizer.chat import encode_chat
from minisgl.wire.sampling import SamplingParams


def arithmetic_prompts(count: int, seed: int) -> list[list[dict[str, str]]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        a, b, c = rng.randrange(12, 99), rng.randrange(12, 99), rng.randrange(2, 30)
        question = f"What is {a} * {b} + {c}? Work it out step by step, then give the answer."
        out.append([{"role": "user", "content": question}])
    return out


CODE_TASKS = [
    "a function that parses a CSV line with quoted fields",
    "a class for a least-recently-used cache with get and put",
    "a function that merges overlapping intervals",
    "a function that checks whether a string of brackets is balanced",
    "a binary search over a sorted list that returns the insertion point",
    "a function that converts a Roman numeral to an integer",
    "a tokenizer for arithmetic expressions with numbers, operators and parentheses",
    "a function that finds the shortest path in a grid with obstacles",
]


def code_prompts(count: int, seed: int) -> list[list[dict[str, str]]]:
    """Coding questions whose answers run long (code, then an explanation): the 1024-token tail."""
    rng = random.Random(seed)
    tasks = rng.sample(CODE_TASKS, min(count, len(CODE_TASKS)))
    ask = "Write {} in Python, with a docstring and three test cases, then explain it."
    return [[{"role": "user", "content": ask.format(task)}] for task in tasks]


def code_file(lines: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    names = ["total", "count", "items", "value", "result", "index", "buffer", "limit"]
    out = []
    for i in range(lines):
        a, b = rng.sample(names, 2)
        out.append(f"    {a}_{i % 7} = {b}_{(i + 3) % 7} + {rng.randrange(100)}")
    return ["def step(state):"] + out + ["    return state"]


def agent_rounds(rounds: int, seed: int) -> list[list[dict[str, str]]]:
    """One conversation per round: the file so far, one line edited, asked back whole."""
    rng = random.Random(seed)
    source = code_file(40, seed)
    out = []
    for _ in range(rounds):
        line = rng.randrange(1, len(source) - 1)
        source[line] = source[line].rstrip() + f"  # checked {rng.randrange(1000)}"
        text = "\n".join(source)
        out.append([{"role": "user", "content": f"Here is a function:\n\n{text}\n\nRepeat the function exactly."}])
    return out


WORKLOADS = {"repeated": arithmetic_prompts, "code": code_prompts, "agent": agent_rounds}


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[list, dict]:
    """Every request at once through the scheduler: the requests, and times (finish of each)."""
    sched = llm.scheduler
    start = time.perf_counter()
    reqs = [sched.add_request(p, sp) for p, sp in zip(prompts, params)]
    finished: dict[int, float] = {}
    while sched.has_work:
        for event in sched.step():
            if event.req.finished and event.req.rid not in finished:
                finished[event.req.rid] = time.perf_counter() - start
    seconds = time.perf_counter() - start
    times = sorted(finished.values())
    p90 = times[int(0.9 * (len(times) - 1))]
    out_tokens = sum(len(r.output_ids) for r in reqs)
    return reqs, {
        "seconds": seconds,
        "output_tokens": out_tokens,
        "out_tok_per_s": out_tokens / seconds,
        "p90_finish_s": p90,
        "last_10pct_s": seconds - p90,
        "mean_output_len": out_tokens / len(reqs),
    }


def setup(
    args: argparse.Namespace, speculation: tuple[int, int] | None
) -> tuple[LLM, list[list[int]], list[SamplingParams]]:
    """The engine, and the workload's prompts (each ``--samples`` times) with seeded params.
    ``speculation``: the most draft tokens and the largest batch bound any mode will use
    (configured from the start, so the CUDA graphs have room for the verify rows:
    ``EngineArgs.graph_batch_size``); None: an engine that never speculates."""
    convs = WORKLOADS[args.workload](args.prompts, args.seed)
    engine = {  # every sample at once by default, as an RL step submits them
        "dtype": args.dtype,
        "max_running_requests": args.max_running_requests or max(len(convs) * args.samples, 1),
    }
    if speculation is not None:
        engine["speculative_algorithm"] = "NGRAM"
        engine["speculative_num_draft_tokens"], engine["speculative_disable_by_batch_size"] = speculation
    if args.device:
        engine["device"] = args.device
    llm = LLM(args.model, **engine)
    ids = [encode_chat(llm.tokenizer, c, None, None) for c in convs]
    prompts = [p for p in ids for _ in range(args.samples)]
    params = [
        SamplingParams(temperature=args.temperature, seed=args.seed * 100_000 + i, max_new_tokens=args.max_new_tokens)
        for i in range(len(prompts))
    ]
    return llm, prompts, params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--workload", choices=list(WORKLOADS), default="repeated")
    ap.add_argument("--prompts", type=int, default=8, help="repeated: questions; agent: rounds")
    ap.add_argument("--samples", type=int, default=64, help="samples per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=1024)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument(
        "--max-running-requests", type=int, default=None, help="default: every sample at once (an RL step's batch)"
    )
    ap.add_argument("--num-draft-tokens", type=int, nargs="+", default=[4])
    ap.add_argument(
        "--idle-after-no-draft",
        type=int,
        nargs="+",
        default=[spec_rule.IDLE_AFTER_NO_DRAFT],
        help="plain steps after one in which no request drafted (spec_rule.IDLE_AFTER_NO_DRAFT)",
    )
    ap.add_argument(
        "--rules",
        nargs="+",
        choices=["measured", "always"],
        default=["measured"],
        help="measured: SpecPlanner's rule decides each step; always: every step that may speculates",
    )
    ap.add_argument(
        "--disable-by-batch-size",
        type=int,
        nargs="+",
        default=[32],
        help="--speculative-disable-by-batch-size of each speculating mode",
    )
    ap.add_argument(
        "--schedules",
        nargs="+",
        choices=list(SPEC_SCHEDULES),
        default=["late"],
        help="--speculative-schedule of each speculating mode",
    )
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--repeats", type=int, default=1, help="measured runs of each mode, interleaved; the table shows medians"
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    llm, prompts, params = setup(args, (max(args.num_draft_tokens), max(args.disable_by_batch_size)))
    modes = [("off", None, 0, "measured", "late", 0)] + [
        (
            f"on k={k} idle={idle} {rule}"
            + (f" batch<={cap}" if len(args.disable_by_batch_size) > 1 else "")
            + f" {schedule}",
            k,
            idle,
            rule,
            schedule,
            cap,
        )  # fmt: skip
        for k in args.num_draft_tokens
        for idle in args.idle_after_no_draft
        for rule in args.rules
        for cap in args.disable_by_batch_size
        for schedule in args.schedules
    ]
    measured = spec_rule.SpecRule.pays
    rows, outputs = [], []
    runs: dict[str, list[dict]] = {name: [] for name, *_ in modes}
    # One warm-up pass, then the measured passes, each mode once a pass (drift hits every mode alike).
    for warm in [True] + [False] * args.repeats:
        for name, k, idle, rule, schedule, cap in modes:
            spec_rule.IDLE_AFTER_NO_DRAFT = idle
            spec_rule.SpecRule.pays = measured if rule == "measured" else lambda self, decoding: True
            llm.args.speculative_algorithm = None if k is None else "NGRAM"
            llm.args.speculative_schedule = schedule
            llm.args.speculative_disable_by_batch_size = cap or 1
            llm.args.speculative_num_draft_tokens = k or 1
            llm.reset_scheduler()
            # Warm-up: a few requests (graphs, kernels); then the measured run on a fresh cache.
            reqs, result = run(llm, prompts[: 4 if warm else len(prompts)], params[: 4 if warm else len(params)])
            if warm:
                continue
            outputs.append([r.output_ids for r in reqs])
            # Same seeds: equal to the first mode's samples unless rounding differs (bf16).
            result["same_as_off"] = sum(a == b for a, b in zip(outputs[0], outputs[-1])) / len(reqs)
            stats = llm.scheduler.stats()
            result.update(mode=name, **{key: v for key, v in stats.items() if key.startswith("spec_")})
            result["decode_steps"] = stats["decode_steps"]
            runs[name].append(result)
            print(
                f"{name:10s} {result['seconds']:8.2f} s  {result['out_tok_per_s']:9.0f} out tok/s  "
                f"last 10% {result['last_10pct_s']:6.2f} s  mean len {result['mean_output_len']:6.1f}  "
                f"steps {result['decode_steps']}  accept {result.get('spec_accept_rate', 0):.2f} "
                f"({result.get('spec_accepted_tokens', 0)}/{result.get('spec_draft_tokens', 0)})  "
                f"drafting {result.get('spec_draft_us_per_request', 0):.1f} us/request/step  "
                f"same samples as off {result['same_as_off']:.2f}",
                flush=True,
            )
    off = runs[modes[0][0]]
    for name, results in runs.items():  # per mode, the run of median time (with every run's seconds)
        # and the median of its speedups over speculation off in the same pass (drift between
        # passes, 10-30% on the H100, cancels within one)
        paired = [o["seconds"] / r["seconds"] for o, r in zip(off, results)]
        paired_tail = [o["last_10pct_s"] / max(r["last_10pct_s"], 1e-9) for o, r in zip(off, results)]
        results = sorted(results, key=lambda r: r["seconds"])
        rows.append(
            {
                **results[len(results) // 2],
                "seconds_all": [r["seconds"] for r in results],
                "paired_speedup": statistics.median_high(paired),
                "paired_tail_speedup": statistics.median_high(paired_tail),
            }
        )
    base = rows[0]
    for row in rows[1:]:
        print(
            f"{row['mode']}: {base['seconds'] / row['seconds']:.2f}x end to end, "
            f"last 10% {base['last_10pct_s'] / max(row['last_10pct_s'], 1e-9):.2f}x (medians); "
            f"within a pass {row['paired_speedup']:.2f}x, last 10% {row['paired_tail_speedup']:.2f}x"
        )
    save_result({"args": vars(args), "results": rows}, args.out, f"spec_{args.workload}")


if __name__ == "__main__":
    main()
