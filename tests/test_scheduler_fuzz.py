"""The scheduler under random load, with a fake executor (no model): arrivals in bursts of
identical prompts (as n > 1 and repeated sampling send them), aborts at any point, a pool small
enough to evict and retract, both policies, overlap on and off, radix cache on and off. The
cache, pages, slots and request lists agree after every step, and once drained nothing is left
behind."""

from __future__ import annotations

import random
from collections import deque

import pytest

from minisgl.args import EngineArgs
from minisgl.messages import ForwardBatch, StepOutput
from minisgl.sampling import SamplingParams
from minisgl.scheduler import Scheduler

EOS, VOCAB = 1, 100


class FakeExecutor:
    """Random tokens (EOS now and then) for every sampled row, in launch order."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.rows: deque[int] = deque()

    def launch(self, batch: ForwardBatch) -> None:
        assert len(set(batch.slots)) == len(batch.slots), "a slot twice in one batch"
        self.rows.append(sum(batch.sample))

    def collect(self) -> StepOutput:
        n = self.rows.popleft()
        return StepOutput(tokens=[EOS if self.rng.random() < 0.03 else self.rng.randrange(2, VOCAB) for _ in range(n)])

    def sample_masked(self, bitmask: bytes) -> None:
        raise AssertionError("no grammars here")


@pytest.mark.parametrize("seed", range(8))
def test_fuzzed_scheduler_stays_consistent_and_leaks_nothing(seed):
    rng = random.Random(seed)
    page = rng.choice([1, 4, 16])
    args = EngineArgs(
        model="", page_size=page, max_running_requests=rng.choice([3, 16, 64]),
        chunked_prefill_size=rng.choice([page * 4, 64, 256]), schedule_policy=rng.choice(["lpm", "fcfs"]),
        disable_overlap_schedule=seed % 2 == 1, disable_radix_cache=seed % 4 == 3,
    )
    num_pages = 600 // page  # room for a few requests of up to ~280 tokens: eviction and retraction
    sched = Scheduler(args, num_pages, 512, VOCAB, [EOS], FakeExecutor(rng))
    stems = [[rng.randrange(2, VOCAB) for _ in range(rng.randint(8, 120))] for _ in range(5)]
    reqs = []
    for step in range(300):
        for _ in range(rng.choice([0, 0, 1, 2])):
            prompt = rng.choice(stems)[: rng.randint(1, 120)] + [rng.randrange(2, VOCAB) for _ in range(rng.randint(0, 40))]
            params = SamplingParams(max_new_tokens=rng.randint(0, 100), temperature=0.0, ignore_eos=rng.random() < 0.5)
            for _ in range(rng.choice([1, 1, 4, 8])):  # identical prompts together, as n > 1 sends them
                reqs.append(sched.add_request(prompt, params))
        for _ in range(rng.choice([0, 0, 0, 1])):  # a client goes away: queued, running or in flight
            live = [r for r in reqs if not r.finished]
            if live:
                sched.finish(rng.choice(live), "abort")
        if sched.has_work:
            sched.step()
        sched.check_integrity()
    while sched.has_work:
        sched.step()
        sched.check_integrity()
    assert not sched.running and not sched.waiting and not sched.inflight and not sched.prefilling
    info = sched.cache.size_info()
    assert info.protected == 0, "a finished request still locks a prefix"
    assert sched.allocator.num_free + info.evictable == num_pages, "pages leaked"
    assert sorted(sched.memory.free_slots) == list(range(args.max_running_requests)), "slots leaked"
    for r in reqs:
        assert r.finished and r.slot is None and r.queue_seq is None and not r.pages
        assert len(r.output_ids) <= r.params.max_new_tokens
        if r.finish_reason == "length":
            assert len(r.output_ids) == r.max_outputs
        if r.finish_reason == "stop" and not r.params.ignore_eos:
            assert r.output_ids[-1] == EOS


def test_fuzzing_reaches_retraction():
    """The pool above is small enough that some seeds retract (else the fuzz misses that path)."""
    rng = random.Random(0)
    args = EngineArgs(model="", page_size=4, max_running_requests=64, chunked_prefill_size=64)
    sched = Scheduler(args, 150, 512, VOCAB, [EOS], FakeExecutor(rng))
    for _ in range(40):
        sched.add_request([rng.randrange(2, VOCAB) for _ in range(40)], SamplingParams(max_new_tokens=100, ignore_eos=True))
    while sched.has_work:
        sched.step()
        sched.check_integrity()
    assert sched.stats()["retractions"] > 0
