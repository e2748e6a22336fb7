"""When a step speculates (``--speculative-algorithm``): measured, not guessed.

A verify step computes k + 1 rows per drafting request, planned beside the steps before it (the
step after it carrying rows whose lengths the device corrects, ``ForwardBatch.resolve_rows``)
or, with ``--speculative-schedule wait``, after them; what that costs depends on the model and
the machine.
``SpecRule`` times plain and verify steps, start to start, per batch size (bit length of the
decoding requests), and keeps the tokens a verify step gives per decoding request at each size;
a step speculates while those tokens exceed the verify step's cost in plain steps, up to
``--speculative-disable-by-batch-size`` decoding requests: above it even a try costs a large
model several plain steps, while a small model on a big GPU is bound by the host at any batch (a
verify step of k + 1 rows a request costs little more than a plain one; raise the bound). With
``--speculative-schedule wait`` a step that looked for drafts and found none counts as a verify
step that gave one token a request (it drained the pipeline for nothing; at a full batch whose
requests rest or find nothing, such tries turn speculation off before any verify step is
timed). Planned beside the steps in flight (late, overlap), such a step is a plain one that
also looked, and counts as one: a request's tail alternates between spans its siblings wrote
(long kept drafts) and new text (no draft), and counting the looks as losses stopped the
verify steps through the next span. What is not measured yet is tried
first, and the other choice is tried now and then, so a change of workload turns speculation
back on or off. A try that confirms the choice doubles the interval to the next one, and one
that changes it starts the interval again (a waiting try pays two drains of the pipeline, which
the start-to-start timings leave out: an isolated verify step cost ~4.6 ms on the H100 against
~1.2 ms inside a run of them, SmolLM2). Each batch size keeps its own interval: a run's tail
passes from large batches to one request, and a loss at 32 requests says nothing about one.

Estimates are over the last ``WINDOW`` steps: the median step time (a step that compiles a
kernel for a new shape takes ~100 times the others; in a moving average one such step reads as a
clear loss and stops tries for the longest interval) and the mean gain (a request's tail
alternates between tries that find no draft, one token, and long kept drafts: their mean is what
speculating gives, where a moving average after a few empty tries reads as a loss).
"""

from __future__ import annotations

import statistics
from collections import deque

# Plain steps (with overlap) after a step in which no request found a draft.
IDLE_AFTER_NO_DRAFT = 4
# After this many steps of one choice, two of the other (the second is the one measured: the
# first still waits on the step before it), so both estimates stay fresh; doubled after each try
# that confirms the choice, up to MAX_EXPLORE; at once to MAX_EXPLORE when the verify steps'
# tokens were under half their cost (full batches of a large model: a try costs several steps).
EXPLORE = 32
MAX_EXPLORE = 1024
CLEAR_LOSS = 0.5
WINDOW = 8  # steps (or verify steps' gains) an estimate is taken over, per batch size
MIN_GAINS = 3  # tries at a batch size before its gain counts (one empty try is not a verdict)


class SpecRule:
    def __init__(self, max_batch: int = 32, waits: bool = False) -> None:
        self.max_batch = max_batch  # --speculative-disable-by-batch-size
        self.waits = waits  # a step that speculates waits for the steps in flight (schedule "wait")
        # (verify?, batch bit length) -> seconds of its last steps
        self.seconds: dict[tuple[bool, int], deque[float]] = {}
        self.gains: dict[int, deque[float]] = {}  # batch bit length -> tokens its last verify steps gave a request
        self.gain = 0.0  # at the last verify step's size (for stats)
        self.idle = 0  # steps left without speculation
        self.streak: dict[int, int] = {}  # per batch bit length: steps of its choice since the other was tried
        self.explore: dict[int, int] = {}  # per batch bit length: steps of one choice before the other is tried
        self.trying = 0  # steps of the other choice still to take
        self._tried: tuple[int, bool] | None = None  # (requests, choice questioned) of the last try, until judged
        self._started = 0.0  # when the current scheduler step started
        self._last: tuple[bool | None, int, float] | None = None  # (kind, requests, start) of the last step
        self._before: bool | None = None  # the kind of the step before that

    def wants(self, decoding: int) -> bool:
        """Whether this step speculates: up to ``max_batch`` decoding requests, not for a few
        steps after no request found a draft, and only while ``pays`` says so (or the other
        choice is tried)."""
        if self.idle > 0:
            self.idle -= 1
            return False
        if not 0 < decoding <= self.max_batch:
            return False
        best = self.pays(decoding)
        if self.trying > 0:
            self.trying -= 1
            return not best
        if self._tried is not None:  # a try just ended: measured, it kept or changed the choice
            tried_at, against = self._tried
            now = self.pays(tried_at)
            size = tried_at.bit_length()
            if now != against:
                self.explore[size] = EXPLORE
            elif not now and self.margin(tried_at) < CLEAR_LOSS:
                self.explore[size] = MAX_EXPLORE
            else:
                self.explore[size] = min(2 * self.explore.get(size, EXPLORE), MAX_EXPLORE)
            self._tried = None
        size = decoding.bit_length()
        self.streak[size] = self.streak.get(size, 0) + 1
        if self.streak[size] >= self.explore.get(size, EXPLORE):
            self.streak[size], self.trying, self._tried = 0, 1, (decoding, best)
            return not best
        return best

    def pays(self, decoding: int) -> bool:
        """Whether a verify step's tokens are worth its time at this batch size, by the
        measurements; while one is missing, the choice that measures it."""
        gain, plain, verify = self._measured(decoding)
        if gain is None:
            return True
        if gain <= 1.0:  # tries found nothing to keep: no cost makes that pay
            return False
        if verify is None:
            return True
        if plain is None:
            return False
        return gain > verify / plain

    def margin(self, decoding: int) -> float:
        """A verify step's tokens over its cost in plain steps at this batch size (1: even)."""
        gain, plain, verify = self._measured(decoding)
        if gain is None or plain is None or verify is None:
            return 1.0
        return gain * plain / verify

    def _measured(self, decoding: int) -> tuple[float | None, float | None, float | None]:
        """The gain, plain step seconds and verify step seconds at this batch size (None: not yet)."""
        bucket = decoding.bit_length()
        gains = self.gains.get(bucket)
        plain, verify = self.seconds.get((False, bucket)), self.seconds.get((True, bucket))
        return (
            statistics.fmean(gains) if gains and len(gains) >= MIN_GAINS else None,
            statistics.median(plain) if plain else None,
            statistics.median(verify) if verify else None,
        )

    def no_drafts(self, decoding: int, looked: bool) -> None:
        """A step of ``decoding`` requests meant to speculate found no draft: waiting, it was a
        try that gave one token a request; and if any request ``looked`` for a draft, the next
        few steps do not look (waiting, they keep overlap scheduling)."""
        if self.waits:
            self._add_gain(decoding, 1.0)
        if looked:
            self.idle = IDLE_AFTER_NO_DRAFT

    def verified(self, decoding: int, gain: float) -> None:
        """A verify step of ``decoding`` requests gave ``gain`` tokens per request."""
        self.gain = self._add_gain(decoding, gain)

    def _add_gain(self, decoding: int, gain: float) -> float:
        window = self.gains.setdefault(decoding.bit_length(), deque(maxlen=WINDOW))
        window.append(gain)
        return statistics.fmean(window)

    def step_started(self, now: float) -> None:
        """A scheduler step starts: the step launched by the one before took until now. It is
        measured only when it is of the same kind as the step before it (a step's wait for
        the outputs of the one before belongs to that one)."""
        if self._last is not None:
            kind, decoding, start = self._last
            if kind is not None and kind == self._before:
                self.observe(kind, decoding, now - start)
            self._before = kind
        self._started = now

    def launched(self, tried: bool | None, decoding: int, verified: bool = True) -> None:
        """What this scheduler step launched: a decode step that tried to speculate (True), a
        plain decode step (False), or anything else (None: a prefill, nothing). A try timed as a
        verify step: one that ``verified`` drafts, or, waiting, one that found none (it drained
        the pipeline); planned beside the steps in flight, that is a plain step."""
        kind = tried and (verified or self.waits) if tried is not None else None
        self._last = (kind, decoding, self._started)

    def observe(self, verify: bool, decoding: int, seconds: float) -> None:
        """A decode step of ``decoding`` requests took ``seconds``."""
        self.seconds.setdefault((verify, decoding.bit_length()), deque(maxlen=WINDOW)).append(seconds)
