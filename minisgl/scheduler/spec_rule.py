"""When a step speculates (``--speculative-algorithm``): measured, not guessed.

A verify step computes k + 1 rows per drafting request and waits for the steps before it (or,
with ``--speculative-overlap``, the step after it waits on the worker for the verify step's kept
counts, ``ForwardBatch.resolve_rows``); what that costs depends on the model and the machine.
``SpecRule`` times plain and verify steps, start to start, per batch size (bit length of the
decoding requests), and keeps the tokens a verify step gives per decoding request; a step
speculates while those tokens exceed the verify step's cost in plain steps. What is not
measured yet is tried first, and the other choice is tried now and then, so a change of
workload turns speculation back on or off. A try that confirms the choice doubles the interval
to the next one, and one that changes it starts the interval again (a waiting try pays two
drains of the pipeline, which the start-to-start timings leave out: an isolated verify step
cost ~4.6 ms on the H100 against ~1.2 ms inside a run of them, SmolLM2).
"""

from __future__ import annotations

# Verify steps while at most this many requests decode: above it a step of k + 1 tokens per
# request costs well over a one-token step (full batches keep overlap scheduling).
MAX_BATCH = 32
# Plain steps (with overlap) after a step in which no request found a draft.
IDLE_AFTER_NO_DRAFT = 4
# After this many steps of one choice, two of the other (the second is the one measured: the
# first still waits on the step before it), so both estimates stay fresh; doubled after each try
# that confirms the choice, up to MAX_EXPLORE.
EXPLORE = 32
MAX_EXPLORE = 1024
SMOOTHING = 0.2  # weight of a new measurement in the moving averages


class SpecRule:
    def __init__(self) -> None:
        self.seconds: dict[tuple[bool, int], float] = {}  # (verify?, batch bit length) -> seconds a step
        self.gain: float | None = None  # tokens a verify step gives per decoding request
        self.idle = 0  # steps left without speculation
        self.streak = 0  # steps of the current choice since the other was last tried
        self.trying = 0  # steps of the other choice still to take
        self.explore = EXPLORE  # steps of one choice before the other is tried
        self._tried_against: bool | None = None  # the choice the last try questioned, until it is judged
        self._started = 0.0  # when the current scheduler step started
        self._last: tuple[bool | None, int, float] | None = None  # (kind, requests, start) of the last step
        self._before: bool | None = None  # the kind of the step before that

    def wants(self, decoding: int) -> bool:
        """Whether this step speculates: small batches only, not for a few steps after no
        request found a draft, and only while ``pays`` says so (or the other choice is tried)."""
        if self.idle > 0:
            self.idle -= 1
            return False
        if not 0 < decoding <= MAX_BATCH:
            return False
        best = self.pays(decoding)
        if self.trying > 0:
            self.trying -= 1
            return not best
        if self._tried_against is not None:  # a try just ended: measured, it kept or changed the choice
            self.explore = min(2 * self.explore, MAX_EXPLORE) if best == self._tried_against else EXPLORE
            self._tried_against = None
        self.streak += 1
        if self.streak >= self.explore:
            self.streak, self.trying, self._tried_against = 0, 1, best
            return not best
        return best

    def pays(self, decoding: int) -> bool:
        """Whether a verify step's tokens are worth its time at this batch size, by the
        measurements; while one is missing, the choice that measures it."""
        bucket = decoding.bit_length()
        plain, verify = self.seconds.get((False, bucket)), self.seconds.get((True, bucket))
        if verify is None or self.gain is None:
            return True
        if plain is None:
            return False
        return self.gain > verify / plain

    def no_drafts(self) -> None:
        """A step meant to speculate found no draft: the next few keep overlap scheduling."""
        self.idle = IDLE_AFTER_NO_DRAFT

    def verified(self, gain: float) -> None:
        """A verify step gave ``gain`` tokens per decoding request."""
        self.gain = gain if self.gain is None else self.gain + SMOOTHING * (gain - self.gain)

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

    def launched(self, verify: bool | None, decoding: int) -> None:
        """What this scheduler step launched: a verify step (True), a plain decode step with
        overlap (False), or anything else (None: a prefill, a plain step that waited for
        drafts it did not find, nothing)."""
        self._last = (verify, decoding, self._started)

    def observe(self, verify: bool, decoding: int, seconds: float) -> None:
        """A decode step of ``decoding`` requests took ``seconds``."""
        key = (verify, decoding.bit_length())
        last = self.seconds.get(key)
        self.seconds[key] = seconds if last is None else last + SMOOTHING * (seconds - last)
