"""Host cost of the scheduler per step against queue length and running requests (CPU only).

    python benchmarks/host_cost.py --waiting 1000 10000 100000 --running 256 1024 4096

A fake executor stands in for the model (every sampled row gets a token that never ends a
request), so what is timed is the scheduler's own work in ``Scheduler.step``: ordering the
queue, admission and prefill chunks, decode pages and cascade groups, building the batch
message and processing the step's output. The queue is held at ``--waiting`` requests (topped
up after each step, outside the timing) of repeated sampling: problems of ``--prompt-len``
tokens, ``--samples`` requests each, outputs uniform in [64, 448], as RL rollouts and
best-of-n send them; ``--shape distinct`` gives every prompt its own first page instead.
Prints per-step milliseconds (decode steps, prefill steps, all) and writes JSON to
benchmarks/results/.
"""

from __future__ import annotations

import argparse
import cProfile
import platform
import pstats
import random
import sys
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workloads import save_result  # noqa: E402
from minisgl.config.args import EngineArgs
from minisgl.serve.scheduler.scheduler import Scheduler
from minisgl.utils import resolve_device  # noqa: E402
from minisgl.wire.sampling import SamplingParams
from minisgl.wire.steps import ForwardBatch, StepOutput

VOCAB, TOKEN = 128256, 7


class FakeExecutor:
    """Returns one token per sampled row, in launch order; no model."""

    def __init__(self) -> None:
        self.rows: deque[int] = deque()

    def launch(self, batch: ForwardBatch) -> None:
        self.rows.append(sum(batch.sample))

    def collect(self) -> StepOutput:
        return StepOutput(tokens=[TOKEN] * self.rows.popleft())

    def sample_masked(self, bitmask: bytes) -> None:
        raise NotImplementedError("no grammars in this benchmark")


class Workload:
    def __init__(self, shape: str, prompt_len: int, samples: int, seed: int = 0):
        self.rng = random.Random(seed)
        self.shape, self.prompt_len, self.samples = shape, prompt_len, samples
        self.body = [self.rng.randrange(8, VOCAB) for _ in range(prompt_len)]
        self.problem: list[int] = []
        self.sent = 0

    def next(self) -> tuple[list[int], SamplingParams]:
        if self.shape == "distinct":
            prompt = [self.rng.randrange(8, VOCAB) for _ in range(16)] + self.body[16:]
        else:
            if self.sent % self.samples == 0:
                self.problem = [self.rng.randrange(8, VOCAB) for _ in range(self.prompt_len)]
            prompt = self.problem
        self.sent += 1
        return prompt, SamplingParams(temperature=0.0, max_new_tokens=self.rng.randint(64, 448), ignore_eos=True)


def measure(running: int, waiting: int, steps: int, args: argparse.Namespace) -> dict:
    engine = EngineArgs(model="", page_size=16, max_running_requests=running, chunked_prefill_size=8192)
    context = 4096
    pages = running * (args.prompt_len + 448 + 32) // 16 + 8192  # every slot full, plus cache
    sched = Scheduler(engine, pages, context, VOCAB, [0], FakeExecutor(), on_gpu=resolve_device().type == "cuda")
    wl = Workload(args.shape, args.prompt_len, args.samples)

    def top_up() -> None:
        while len(sched.waiting) < waiting:
            sched.add_request(*wl.next())

    top_up()
    while len(sched.running) < running:  # fill every slot once, then settle
        sched.step()
        top_up()
    for _ in range(args.warmup):
        sched.step()
        top_up()
    times = {"decode": [], "prefill": []}
    profiler = cProfile.Profile() if args.profile else None
    for _ in range(steps):
        decode_before = sched.counters.decode_steps
        if profiler:
            profiler.enable()
        start = time.perf_counter()
        sched.step()
        elapsed = time.perf_counter() - start
        if profiler:
            profiler.disable()
        times["decode" if sched.counters.decode_steps > decode_before else "prefill"].append(elapsed)
        top_up()
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    every = times["decode"] + times["prefill"]

    def ms(xs: list[float]) -> float:
        return 1000 * sum(xs) / len(xs) if xs else 0.0

    return {
        "running": running,
        "waiting": waiting,
        "steps": steps,
        "decode_steps": len(times["decode"]),
        "decode_ms": ms(times["decode"]),
        "prefill_ms": ms(times["prefill"]),
        "all_ms": ms(every),
        "running_at_end": len(sched.running),
        "waiting_at_end": len(sched.waiting),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--waiting", type=int, nargs="+", default=[1000, 10000, 100000])
    ap.add_argument("--running", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--steps", type=int, default=300, help="timed steps per point")
    ap.add_argument("--warmup", type=int, default=100, help="steps after every slot is full, before timing")
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--samples", type=int, default=1024, help="requests per problem (repeated shape)")
    ap.add_argument("--shape", choices=["repeated", "distinct"], default="repeated")
    ap.add_argument("--profile", action="store_true", help="cProfile the timed steps of each point")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    print(f"{'running':>8} {'waiting':>8} {'decode ms':>10} {'prefill ms':>11} {'all ms':>8} {'decode steps':>13}")
    for running in args.running:
        for waiting in args.waiting:
            r = measure(running, waiting, args.steps, args)
            rows.append(r)
            print(
                f"{running:8d} {waiting:8d} {r['decode_ms']:10.3f} {r['prefill_ms']:11.3f} {r['all_ms']:8.3f} "
                f"{r['decode_steps']:8d}/{r['steps']}",
                flush=True,
            )
    save_result(
        {"machine": platform.node(), "python": platform.python_version(), "args": vars(args), "rows": rows},
        args.out,
        f"host_cost_{args.shape}",
    )


if __name__ == "__main__":
    main()
