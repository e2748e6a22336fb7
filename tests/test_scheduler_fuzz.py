"""The scheduler under random load, with a fake executor and fake grammars (no model):
arrivals in bursts of identical prompts (as n > 1 and repeated sampling send them), constrained
requests whose grammars compile late or fail, aborts at any point, a pool small enough to evict
and retract, both policies, overlap on and off, radix cache on and off, and speculation under
each verify schedule (the fake model often samples what was drafted). The cache, pages, slots
and request lists agree after every step, a constrained batch's masks come before the next
launch, a verify step's drafts come before anything else, and once drained nothing is left
behind."""

from __future__ import annotations

import random
from collections import deque
from concurrent.futures import Future

import pytest

from minisgl.config.args import SPEC_SCHEDULES, EngineArgs
from minisgl.serve.scheduler.scheduler import Scheduler
from minisgl.wire.sampling import SamplingParams
from minisgl.wire.steps import ForwardBatch, StepOutput

EOS, VOCAB = 1, 100


class FakeExecutor:
    """Random tokens (EOS now and then) for every sampled row, in launch order; a batch with
    constrained rows must get its masks before anything else is launched or it is collected."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        # per batch: [the batch, constrained rows awaiting masks, draft rows awaiting their ids]
        self.launched: deque[list] = deque()

    def launch(self, batch: ForwardBatch) -> None:
        firsts, row = [], 0  # a verify run's rows share its request's slot: one slot a request
        for size in batch.verify_sizes:
            assert len(set(batch.slots[row : row + size])) == 1, "a verify run over two slots"
            firsts.append(batch.slots[row])
            row += size
        slots = firsts + batch.slots[row:]
        assert len(set(slots)) == len(slots), "a slot twice in one batch"
        assert not (self.launched and (self.launched[-1][1] or self.launched[-1][2])), (
            "a batch launched before the last one's masks or drafts came"
        )
        self.launched.append([batch, len(batch.mask_rows), len(batch.draft_rows)])

    def fill_drafts(self, ids: list[int]) -> None:
        last = self.launched[-1]
        assert last[2] == len(ids) and all(EOS <= i < VOCAB for i in ids)
        for row, token in zip(last[0].draft_rows, ids):
            last[0].input_ids[row] = token
        last[2] = 0

    def oldest_done(self) -> bool:
        return self.rng.random() < 0.5

    def _token(self) -> int:
        return EOS if self.rng.random() < 0.03 else self.rng.randrange(2, VOCAB)

    def collect(self) -> StepOutput:
        batch, awaiting, drafts = self.launched.popleft()
        assert not awaiting and not drafts, "a batch collected before its masks or drafts came"
        tokens, row = [], 0
        for size in batch.verify_sizes:  # a run: each row samples its next draft token most of the time
            ids = batch.input_ids[row + 1 : row + size]
            tokens += [t if self.rng.random() < 0.8 else self._token() for t in ids] + [self._token()]
            row += size
        return StepOutput(tokens=tokens + [self._token() for _ in range(sum(batch.sample) - row)])

    def sample_masked(self, bitmask: bytes) -> None:
        last = self.launched[-1]
        assert last[1] and len(bitmask) == last[1] * 4 * ((VOCAB + 31) // 32)
        last[1] = 0


class FakeMatcher:
    """A grammar that is complete after ``length`` tokens."""

    def __init__(self, length: int):
        self.length, self.seen = length, 0

    def accept_token(self, token: int) -> bool:
        assert self.seen < self.length, "a token after the grammar ended"
        self.seen += 1
        return True

    def is_terminated(self) -> bool:
        return self.seen >= self.length


class FakeGrammars:
    """Compiles ``regex`` texts into matchers of their length: at once or a few steps later
    (``tick``), and fails texts starting with "bad"."""

    available = True  # (GrammarBackend's: xgrammar is installed)

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.pending: list[tuple[Future, str]] = []

    def compile(self, kind: str, text: str) -> Future:
        fut: Future = Future()
        self.pending.append((fut, text))
        if self.rng.random() < 0.5:
            self.tick(1.0)
        return fut

    def tick(self, chance: float = 0.3) -> None:
        for fut, text in [p for p in self.pending if self.rng.random() < chance]:
            self.pending.remove((fut, text))
            if text.startswith("bad"):
                fut.set_exception(ValueError(f"invalid regex: {text}"))
            else:
                fut.set_result(len(text))

    def abandon(self, fut: Future) -> None:
        """As the real backend: a compile nobody waits for is cancelled (none here has started)."""
        if fut.cancel():
            self.pending = [p for p in self.pending if p[0] is not fut]

    @staticmethod
    def matcher(compiled: int) -> FakeMatcher:
        return FakeMatcher(compiled)

    @staticmethod
    def bitmask(rows: list) -> bytes:
        return bytes(4 * len(rows) * ((VOCAB + 31) // 32))


@pytest.mark.parametrize("seed", range(8))
def test_fuzzed_scheduler_stays_consistent_and_leaks_nothing(seed):
    fuzz(seed)


@pytest.mark.parametrize("schedule", SPEC_SCHEDULES)
@pytest.mark.parametrize("seed", range(4))  # (odd seeds: overlap off, every schedule alike; 3: radix off)
def test_fuzzed_speculation_stays_consistent_and_leaks_nothing(seed, schedule, monkeypatch):
    monkeypatch.setattr("minisgl.serve.scheduler.spec_rule.SpecRule.pays", lambda self, decoding: True)
    stats = fuzz(seed, speculative_algorithm="NGRAM", speculative_schedule=schedule, speculative_num_draft_tokens=4)
    assert stats["spec_verify_steps"] > 0 and stats["spec_accepted_tokens"] > 0


def fuzz(seed: int, **spec) -> dict[str, float]:
    """300 steps of random load, then drained; the scheduler's stats."""
    rng = random.Random(seed)
    page = rng.choice([1, 4, 16])
    args = EngineArgs(
        model="",
        page_size=page,
        max_running_requests=rng.choice([3, 16, 64]),
        chunked_prefill_size=rng.choice([page * 4, 64, 256]),
        schedule_policy=rng.choice(["lpm", "fcfs"]),
        disable_overlap_schedule=seed % 2 == 1,
        disable_radix_cache=seed % 4 == 3,
        **spec,
    )
    num_pages = 600 // page  # room for a few requests of up to ~280 tokens: eviction and retraction
    grammars = FakeGrammars(rng)
    sched = Scheduler(args, num_pages, 512, VOCAB, [EOS], FakeExecutor(rng), grammars)
    stems = [[rng.randrange(2, VOCAB) for _ in range(rng.randint(8, 120))] for _ in range(5)]
    reqs = []
    for step in range(300):
        for _ in range(rng.choice([0, 0, 1, 2])):
            prompt = rng.choice(stems)[: rng.randint(1, 120)] + [
                rng.randrange(2, VOCAB) for _ in range(rng.randint(0, 40))
            ]
            regex = rng.choice([None, None, None, "a" * rng.randint(1, 30), "bad("])
            params = SamplingParams(
                max_new_tokens=rng.randint(0, 100), temperature=0.0, ignore_eos=rng.random() < 0.5, regex=regex
            )
            for _ in range(rng.choice([1, 1, 4, 8])):  # identical prompts together, as n > 1 sends them
                reqs.append(sched.add_request(prompt, params))
        grammars.tick()
        for _ in range(rng.choice([0, 0, 0, 1])):  # a client goes away: queued, running or in flight
            live = [r for r in reqs if not r.finished]
            if live:
                sched.finish(rng.choice(live), "abort")
        if sched.has_work:
            sched.step()
        sched.check_integrity()
    while sched.has_work:
        grammars.tick(1.0)
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
        if r.params.regex is not None and r.params.regex.startswith("bad"):
            assert not r.output_ids  # refused (or aborted, or asked for nothing, before it compiled)
            assert r.error or r.finish_reason == "abort" or r.params.max_new_tokens == 0
        elif r.params.regex is not None and r.finish_reason == "stop":  # its grammar completed
            assert len(r.output_ids) == len(r.params.regex) or r.output_ids[-1] == EOS
        elif r.finish_reason == "stop" and not r.params.ignore_eos:
            assert r.output_ids[-1] == EOS
    return sched.stats()


def test_fuzzing_reaches_retraction():
    """The pool above is small enough that some seeds retract (else the fuzz misses that path)."""
    rng = random.Random(0)
    args = EngineArgs(model="", page_size=4, max_running_requests=64, chunked_prefill_size=64)
    sched = Scheduler(args, 150, 512, VOCAB, [EOS], FakeExecutor(rng), FakeGrammars(rng))
    for _ in range(40):
        sched.add_request(
            [rng.randrange(2, VOCAB) for _ in range(40)], SamplingParams(max_new_tokens=100, ignore_eos=True)
        )
    while sched.has_work:
        sched.step()
        sched.check_integrity()
    assert sched.stats()["retractions"] > 0


def test_a_matcher_rejecting_a_sampled_token_ends_the_request_with_an_error():
    """A constrained request whose matcher refuses the token sampled under its mask ends with an
    error naming its grammar's field (never a silent result that breaks the grammar); a request
    beside it runs on, and nothing leaks."""

    class Rejecting(FakeGrammars):
        @staticmethod
        def matcher(compiled: int) -> FakeMatcher:
            m = FakeMatcher(compiled)
            m.accept_token = lambda token: False
            return m

    rng = random.Random(0)
    grammars = Rejecting(rng)
    args = EngineArgs(model="", page_size=4, max_running_requests=8)
    sched = Scheduler(args, 100, 512, VOCAB, [EOS], FakeExecutor(rng), grammars)
    bad = sched.add_request([5, 6, 7], SamplingParams(max_new_tokens=8, regex="aaaa"))
    good = sched.add_request([5, 6, 8], SamplingParams(max_new_tokens=8, ignore_eos=True))
    while sched.has_work:
        grammars.tick(1.0)
        sched.step()
        sched.check_integrity()
    assert bad.finish_reason == "abort" and bad.error.startswith("regex: the grammar rejected sampled token")
    assert good.finish_reason == "length" and len(good.output_ids) == 8
    assert sched.cache.size_info().protected == 0 and sorted(sched.memory.free_slots) == list(range(8))
