"""Where a decode step's host time goes: the scheduler's and worker's phases timed on a real run.

    python benchmarks/step_phases.py --model SmolLM2-135M-Instruct.Q4_1.gguf --modes off wait late

Runs ``spec_bench.py``'s workload (its prompts, samples and seeded params) once per mode, with a
wall-clock timer around each phase of a step (scheduling, drafting, the step's inputs, attention
planning, graph replay, sampling, processing the tokens, waiting for them), and reports each
phase's milliseconds per scheduler step, and the time between step starts by batch size and kind
(plain or verify) with the largest phases inside the scheduler steps that launched that kind
(phases nest: ``launch`` holds ``_metadata``). The timers cost a few microseconds a call, so
compare phases and modes within one run rather than totals with ``spec_bench.py``'s. Every
speculating mode verifies on every step that may (the measured rule is bypassed, as
``spec_bench.py --rules always`` does).
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks import spec_bench  # noqa: E402
from benchmarks.workloads import save_result  # noqa: E402
from minisgl.config.args import SPEC_SCHEDULES
from minisgl.device import sampler
from minisgl.device.attention import base as attention_base
from minisgl.device.attention import cascade_triton
from minisgl.device.worker import cuda_graph, model_runner
from minisgl.serve.scheduler import scheduler, spec_rule, speculative

MODES = ["off", *SPEC_SCHEDULES]  # speculation off, or on under each --speculative-schedule
Runner = model_runner.ModelRunner
PHASES = [  # (class, method): the phases timed
    (scheduler.Scheduler, "_schedule"),
    (scheduler.Scheduler, "_process"),
    (speculative.SpecPlanner, "schedule"),
    (speculative.SpecPlanner, "redraft"),
    (speculative.SpecPlanner, "accept"),
    (speculative.Drafter, "draft"),
    (Runner, "launch"),
    (Runner, "fill_drafts"),
    (Runner, "collect"),
    (Runner, "_metadata"),
    (Runner, "_defer"),
    (Runner, "_resolve"),
    (Runner, "_sample"),
    (Runner, "_last_verified"),
    (Runner, "_to_host"),
    (attention_base.AttentionBackend, "prepare"),
    (cascade_triton.TritonCascade, "plan"),
    (cuda_graph.CudaGraphRunner, "load"),
    (cuda_graph.CudaGraphRunner, "replay"),
    (sampler.Sampler, "sample"),
]


class Timers:
    """Seconds and calls per phase; ``install`` wraps each phase's method."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: dict[str, int] = collections.defaultdict(int)

    def install(self) -> None:
        for cls, name in PHASES:
            setattr(cls, name, self._wrap(getattr(cls, name), f"{cls.__name__}.{name}"))

    def _wrap(self, fn, label: str):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - start
                self.calls[label] += 1

        return timed


BUCKETS = [(1, "1"), (4, "2-4"), (16, "5-16"), (32, "17-32")]


def bucket(decoding: int) -> str:
    """The batch-size bucket a step of ``decoding`` requests is reported in."""
    return next((name for top, name in BUCKETS if decoding <= top), ">32")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--workload", choices=list(spec_bench.WORKLOADS), default="repeated")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=1024)
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--num-draft-tokens", type=int, default=8)
    ap.add_argument("--disable-by-batch-size", type=int, default=32)
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.max_running_requests = None
    llm, prompts, params = spec_bench.setup(args, (args.num_draft_tokens, args.disable_by_batch_size))
    spec_rule.SpecRule.pays = lambda self, decoding: True
    timers = Timers()
    timers.install()
    starts: list[tuple[float, int, bool]] = []  # per scheduler step: start, decoding requests, verified
    # per (bucket, verified): each phase's seconds inside the scheduler steps that launched that kind
    by_step: dict[tuple[str, bool], dict[str, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
    step = scheduler.Scheduler.step

    def logged_step(self: scheduler.Scheduler):
        start, decoding = time.perf_counter(), len(self.decoding)
        verified = self.spec.verify_steps if self.spec is not None else 0
        before = dict(timers.seconds)
        events = step(self)
        kind = (bucket(decoding), self.spec is not None and self.spec.verify_steps > verified)
        starts.append((start, decoding, kind[1]))
        for label, seconds in timers.seconds.items():
            by_step[kind][label] += seconds - before.get(label, 0.0)
        return events

    scheduler.Scheduler.step = logged_step
    rows = []
    for warm in (True, False):  # a warm-up pass (graphs, kernels), then the measured one
        for mode in args.modes:
            llm.args.speculative_algorithm = None if mode == "off" else "NGRAM"
            llm.args.speculative_schedule = "late" if mode == "off" else mode
            llm.args.speculative_disable_by_batch_size = args.disable_by_batch_size
            llm.args.speculative_num_draft_tokens = args.num_draft_tokens
            llm.reset_scheduler()
            timers.seconds.clear()
            timers.calls.clear()
            starts.clear()
            by_step.clear()
            count = 4 if warm else len(prompts)
            _, result = spec_bench.run(llm, prompts[:count], params[:count])
            if warm:
                continue
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            steps = max(len(starts), 1)
            kinds: dict[tuple[str, bool], list[float]] = collections.defaultdict(lambda: [0, 0.0])
            for (t0, decoding, verified), (t1, _, _) in zip(starts, starts[1:]):
                kinds[bucket(decoding), verified][0] += 1
                kinds[bucket(decoding), verified][1] += t1 - t0
            phases = {k: 1e3 * v / steps for k, v in sorted(timers.seconds.items(), key=lambda kv: -kv[1])}
            print(f"== {mode}: {result['seconds']:.3f} s, last 10% {result['last_10pct_s']:.3f} s, {steps} steps")
            by_kind = {}  # per kind: steps, ms between starts, and its six largest phases (host ms a step)
            for (b, v), (n, s) in sorted(kinds.items()):
                top = sorted(by_step[b, v].items(), key=lambda kv: -kv[1])[:6]
                name = f"{b} {'verify' if v else 'plain'}"
                by_kind[name] = {"steps": n, "ms_apart": 1e3 * s / n, "phases": {k: 1e3 * t / n for k, t in top}}
                print(
                    f"   batch {name:14s} {n:5d} steps {1e3 * s / n:7.3f} ms apart; host ms a step in: "
                    + ", ".join(f"{k.split('.')[-1]} {ms:.3f}" for k, ms in by_kind[name]["phases"].items())
                )
            for label, ms in phases.items():
                print(f"   {ms:7.3f} ms/step  {timers.calls[label] / steps:5.2f} calls/step  {label}")
            rows.append({"mode": mode, **result, "steps": steps, "ms_per_step": phases, "by_kind": by_kind})
    save_result({"args": vars(args), "results": rows}, args.out, f"step_phases_{args.workload}")


if __name__ == "__main__":
    main()
