"""Scheduler: continuous batching over a paged KV cache shared through the prefix cache.

Each ``step`` builds one batch: prefill chunks first (``prefill.py``: requests already
prefilling, then new ones in queue order, ``queue.py``), otherwise one decode token for every
running request (``decode.py``). When pages run out it evicts unlocked cache, then retracts the
newest running requests back to the front of the queue. Outputs come back through
``output.py``; pages and slots are ``pages.py``'s.

With overlap scheduling (the default) the next batch is built and launched before the previous
one's tokens are known: decode inputs come from the worker's own last sampled token, and a
request whose in-flight step may be its last is not scheduled again. A request that turns out
to have finished (EOS, stop string) simply has its extra in-flight token dropped.
"""

from __future__ import annotations

import array
import gc
import logging
import random
import time
from collections import deque
from concurrent import futures
from typing import Protocol

import numpy as np

from minisgl.config.args import EngineArgs
from minisgl.serve.cache.disk_store import DiskStore
from minisgl.serve.cache.ngram_index import NgramIndex
from minisgl.serve.cache.radix_manager import RadixCacheManager
from minisgl.serve.scheduler import cascade
from minisgl.serve.scheduler.control import ControlPlane
from minisgl.serve.scheduler.counters import Counters
from minisgl.serve.scheduler.decode import DecodePlanner
from minisgl.serve.scheduler.grammar import GrammarBackend
from minisgl.serve.scheduler.lora import Adapter, LoraError, LoraRegistry
from minisgl.serve.scheduler.output import apply_output, record_captures
from minisgl.serve.scheduler.pages import Memory
from minisgl.serve.scheduler.prefill import PrefillPlanner
from minisgl.serve.scheduler.prefill_batch import mixed_batch, prefill_batch
from minisgl.serve.scheduler.queue import WaitingQueue
from minisgl.serve.scheduler.request import Req, ReqEvent
from minisgl.serve.scheduler.speculative import Drafter, Drafts, SpecPlanner
from minisgl.serve.scheduler.think_budget import ThinkBudget, grammar_on, masks
from minisgl.utils import cdiv, context_overflow
from minisgl.wire.control import WorkerReply
from minisgl.wire.options import RequestOptions
from minisgl.wire.sampling import SamplingParams
from minisgl.wire.steps import ForwardBatch, StepOutput, WorkerTask

logger = logging.getLogger(__name__)

# Requests queued between gc.freeze() calls. Python's full collections traverse every tracked
# object, and a queue of 100k requests holds over a million: one took 0.78 s, in one step
# (benchmarks/host_cost.py). Frozen objects are never traversed again; requests are freed by
# reference counting (they form no cycles once they leave the queue), and the process thaws
# when it runs out of work. Every 4096 left a batch of 2048 samples (an RL rollout of 8 x 256)
# unfrozen every other time: those rollouts took 14-15 s against 6 s (1B, H100); a freeze
# moves lists, not objects, so freezing often costs nothing.
GC_FREEZE_EVERY = 256


def ids_in_range(ids: list[int], bound: int) -> bool:
    """Whether every id is an integer in [0, ``bound``). Packing into unsigned 32-bit C ints
    rejects negatives, non-integers and huge values in one C loop, and numpy takes the max: a
    quarter of the cost of ``min`` and ``max`` over the Python list (a 2176-token prompt: 19
    against 67 us on the dev VM), which every prompt pays on arrival."""
    try:
        packed = array.array("I", ids)
    except (OverflowError, TypeError):
        return False
    return not packed or int(np.frombuffer(packed, dtype=np.uint32).max()) < bound


# What hybrid models cannot do exactly yet, and why: refused by name rather than served wrong.
HYBRID_REFUSED = {
    "speculative_algorithm": "rejected drafts would need the recurrent state rolled back",
    "lora_paths": "adapters on the Gated DeltaNet projections are not built",
    "enable_lora": "adapters on the Gated DeltaNet projections are not built",
    "enable_hierarchical_cache": "the host tier does not keep state snapshots",
    "enable_deterministic_inference": "the Gated DeltaNet kernels are not batch-invariant",
}


def refuse_for_hybrids(args: EngineArgs) -> None:
    for name, why in HYBRID_REFUSED.items():
        if getattr(args, name):
            raise ValueError(f"--{name.replace('_', '-')} is not supported for hybrid models yet: {why}")


class Executor(Protocol):
    """Runs batches in launch order: ``collect`` returns the oldest launched batch's output."""

    def launch(self, batch: ForwardBatch) -> None: ...

    def collect(self) -> StepOutput: ...

    def oldest_done(self) -> bool:
        """Whether ``collect`` would return without waiting."""

    def fill_drafts(self, ids: list[int]) -> None:
        """Input ids of the last launched batch's ``draft_rows``; its forward runs once they come."""

    def sample_masked(self, bitmask: bytes) -> None:
        """Allowed tokens for the last launched batch's ``mask_rows``; it samples once they come."""

    def run_task(self, task: WorkerTask) -> WorkerReply:
        """A control-plane task on every rank, with no step in flight (``scheduler.control``)."""


# A launched step: the requests it samples a token for (in row order), the (request, position)
# of each scored prompt row, the token ids scored at each of those rows, and its step number.
# Then: the (request, position) of each row whose routed experts or hidden states come back;
# last, a verify step's drafting requests with their drafts (speculative decoding).
Inflight = tuple[list[Req], list[tuple[Req, int]], list[int], int, list[tuple[Req, int]], Drafts]


class Scheduler:
    def __init__(
        self,
        args: EngineArgs,
        num_pages: int,
        context_len: int,
        vocab_size: int,
        eos_ids: list[int],
        executor: Executor,
        grammar: GrammarBackend | None = None,
        num_host_pages: int = 0,
        storage_fingerprint: str = "",
        page_bytes: int = 0,
        on_gpu: bool = False,
        loras: LoraRegistry | None = None,
        snapshot_rows: list[int] | None = None,
    ):
        """``loras``: the adapters an earlier scheduler over the same workers loaded (else
        --lora-paths are loaded now). ``snapshot_rows``: a hybrid model's state-pool rows that
        the prefix cache keeps snapshots in (None: not a hybrid model)."""
        if snapshot_rows is not None:
            refuse_for_hybrids(args)
        self.args = args
        self.page_size = args.page_size
        self.context_len = context_len
        self.vocab_size = vocab_size
        self.eos_ids = set(eos_ids)
        self.executor = executor
        self.overlap = not args.disable_overlap_schedule
        self.inflight: deque[Inflight] = deque()  # launched steps whose tokens are not back yet
        host = num_host_pages if args.enable_hierarchical_cache else 0
        disk = (
            DiskStore(args.storage_dir, storage_fingerprint, args.tp_size)
            if host and args.hicache_storage_backend == "file"
            else None
        )
        self.memory = Memory(
            args.page_size,
            num_pages,
            args.max_running_requests,
            args.disable_radix_cache,
            host,
            args.hicache_write_policy,
            disk,
            page_bytes,
            snapshot_rows,
        )
        self.cache, self.allocator = self.memory.cache, self.memory.allocator
        # lpm without a prefix cache has no hits to order by: arrival order.
        policy = "fcfs" if args.schedule_policy == "lpm" and not self.cache.reuses_prefixes else args.schedule_policy
        self.waiting = WaitingQueue(policy, args.page_size)
        self.counters = Counters()
        self.loras = (
            loras
            if loras is not None or not args.lora_enabled
            else LoraRegistry(args.max_loras_per_batch, args.max_loaded_loras)
        )
        self.prefill = PrefillPlanner(args, context_len, self.memory, self.counters, self.loras)
        self.decode = DecodePlanner(
            self.memory,
            not args.disable_cascade_attention and (on_gpu or cascade.ON_CPU),
            args.enable_return_routed_experts or args.enable_return_hidden_states,
            args.speculative_algorithm is not None,
        )
        self.spec: SpecPlanner | None = None
        self._speculate = False  # this step may verify drafts (``SpecRule.wants``)
        self._drained: list[Req] = []  # requests of the steps this step processed before planning
        if args.speculative_algorithm is not None:
            n = (args.speculative_ngram_min_match_window_size, args.speculative_ngram_max_match_window_size)
            if isinstance(self.cache, RadixCacheManager):
                self.cache.ngrams = NgramIndex(*n, args.speculative_ngram_capacity)
            drafter = Drafter(getattr(self.cache, "ngrams", None), *n)
            self.spec = SpecPlanner(
                self.memory,
                self.decode,
                drafter,
                args.speculative_num_draft_tokens,
                args.graph_batch_size,
                args.speculative_disable_by_batch_size,
                late=args.speculative_schedule == "late",
                waits=not self._plans_ahead,
            )
        self.grammar = grammar
        self.compiling: list[Req] = []  # waiting for their grammar; others are scheduled meanwhile
        self.events: list[ReqEvent] = []  # since the last take_events, in order
        self.running: list[Req] = []  # requests holding a slot, oldest first
        self.prefilling: list[Req] = []  # of those, the ones still prefilling, in admission order
        self.decoding: list[Req] = []  # and the ones past their prefill
        self._rng = random.Random(args.seed)
        self._next_rid = 0
        self._retracted_tokens: list[int] = []  # this step's retractions (logged together)
        # At debug level, each launched step's line, logged with its time once its tokens are back.
        self._step_lines: dict[int, tuple[str, float]] = {}
        self._unfrozen = 0  # requests queued since the last gc.freeze()
        self._frozen = False
        self.control = ControlPlane(self)  # pause, weight updates, memory release, adapter loads
        if loras is None and self.loras is not None:
            self.control.load_startup_loras()

    # ---- requests in and out -------------------------------------------------------------------

    def add_request(self, prompt_ids: list[int], params: SamplingParams, options: RequestOptions | None = None) -> Req:
        """Validate and queue a request. Raises ValueError naming what is wrong."""
        opts = options if options is not None else RequestOptions()
        routed_start, think = opts.routed_start, opts.thinks
        if routed_start >= 0 and not self.args.enable_return_routed_experts:
            raise ValueError("return_routed_experts needs a server started with --enable-return-routed-experts")
        if opts.hidden_states and not self.args.enable_return_hidden_states:
            raise ValueError("return_hidden_states needs a server started with --enable-return-hidden-states")
        adapter = self.lora_adapter(opts.lora)
        params.validate(self.vocab_size)
        if params.stop_token_ids and max(params.stop_token_ids) >= self.vocab_size:  # they never match: dropped
            params.stop_token_ids = [t for t in params.stop_token_ids if t < self.vocab_size]
        if opts.logprob_ids and not ids_in_range(opts.logprob_ids, self.vocab_size):
            raise ValueError(f"token_ids_logprob must be in [0, {self.vocab_size})")
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if think:
            if len(opts.think_markers) != 2 or not all(opts.think_markers):
                raise ValueError("max_thinking_tokens and require_reasoning need the reasoning markers known")
            if params.grammar is not None and not opts.require_reasoning:
                raise ValueError(
                    "max_thinking_tokens with structured output needs require_reasoning (a grammar after thinking)"
                )
        if not ids_in_range(prompt_ids, self.vocab_size):
            raise ValueError(f"input_ids must be in [0, {self.vocab_size})")
        if len(prompt_ids) >= self.context_len:
            raise ValueError(context_overflow(self.context_len, len(prompt_ids)))
        if opts.prediction_ids and not ids_in_range(opts.prediction_ids, self.vocab_size):
            raise ValueError(f"prediction token ids must be in [0, {self.vocab_size})")
        max_len = min(len(prompt_ids) + params.max_new_tokens, self.context_len)
        if cdiv(max_len, self.page_size) > self.allocator.num_pages:
            raise ValueError(
                f"the request needs {max_len} tokens of KV cache; the pool holds "
                f"{self.allocator.num_pages * self.page_size}"
            )
        grammar = params.grammar
        if grammar is not None and self.grammar is None:
            raise ValueError("structured output is not available in this scheduler")
        if grammar is not None and not self.grammar.available:
            raise ValueError(
                f"{grammar[0]}: structured output (json_schema, regex, ebnf, response_format, a forced "
                "tool_choice) needs xgrammar, which this install lacks: pip install xgrammar "
                "(from a clone: pip install '.[grammar]')"
            )
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        routed_from = min(routed_start, len(prompt_ids)) if routed_start >= 0 else -1
        req = Req(
            self._next_rid,
            list(prompt_ids),
            params,
            seed,
            max_len,
            opts,
            logprob_start=min(opts.logprob_start, len(prompt_ids)),
            capture_start=0 if opts.hidden_states else routed_from,
            routed_from=routed_from,
            lora_key=adapter.key if adapter else None,
        )
        self._next_rid += 1
        self._unfrozen += 1
        if self._unfrozen >= GC_FREEZE_EVERY:
            gc.freeze()
            self._unfrozen, self._frozen = 0, True
        req.stop_ids = frozenset((params.stop_token_ids or []) + ([] if params.ignore_eos else list(self.eos_ids)))
        req.max_outputs = max_len - len(prompt_ids)
        if think:
            req.think = ThinkBudget.of(req.prompt_ids, opts)
        req.masked = grammar is not None or think
        req.plain = not opts.logprobs and not opts.entropy and not req.masked and params.max_new_tokens > 0
        if adapter is not None and not (params.max_new_tokens == 0 and not req.scores_prompt):
            self.loras.named(req)  # (counted until it ends: its adapter's host copy stays)
        if params.max_new_tokens == 0 and not req.scores_prompt:
            req.finish_reason = "length"
        elif grammar is not None:
            req.grammar_future = self.grammar.compile(*grammar)
            req.grammar_deadline = time.monotonic() + self.args.grammar_compile_timeout_secs
            self.compiling.append(req)
        else:  # max_new_tokens 0 with prompt logprobs: a prefill that scores the prompt, no token
            self._queue(req)
        if req.grammar_future is None:  # else accepted (or refused) once its grammar compiles
            self.events.append(ReqEvent("accepted", req, req.finished))
        return req

    def _queue(self, req: Req, front: bool = False) -> None:
        """Queue a request under the current weights' tree of the cache."""
        self.waiting.rekey(req, self.kv_salt(req))
        self.waiting.push(req, self.counters.steps, front=front)

    def kv_salt(self, req: Req) -> str | None:
        """The cache tree of the request's ``cache_salt`` and LoRA adapter under the current
        weights (the salt itself without an adapter until the first update)."""
        salt = req.options.cache_salt or None
        if req.lora_key is not None:
            salt = f"{salt or ''}\x00{req.lora_key}"
        epoch = self.control.weights_epoch
        if not epoch:
            return salt
        return f"{salt or ''}\x00weights-{epoch}-{self.control.epoch_tag}"

    def lora_adapter(self, name: str | None) -> Adapter | None:
        """The loaded adapter a request names (None: none named); ValueError naming what is wrong."""
        if name is None:
            return None
        if self.loras is None:
            raise LoraError("lora_path needs a server started with --enable-lora (or --lora-paths)")
        return self.loras.get(name)

    def _lora_ended(self, req: Req) -> None:
        """A request under an adapter ended: the adapter's host copy may go if it was unloaded."""
        if req.lora_key is not None and self.loras is not None:
            self.loras.ended(req)

    def finish(self, req: Req, reason: str) -> None:
        """End a request early (abort, stop string): free its slot and cache what it computed."""
        if req.finished:
            return
        req.finish_reason = reason
        self._lora_ended(req)
        req.matcher = None
        if req in self.compiling:
            self.compiling.remove(req)
            self._abandon(req.grammar_future)
            req.grammar_future = None
        self.waiting.remove(req)
        if req.slot is not None:
            self._release(req)

    def flush_cache(self) -> bool:
        """Drop every cached prefix; refused (False) while requests are queued or running."""
        self.drain()
        if self.has_requests:
            return False
        self.allocator.free(self.cache.reset())
        return True

    @property
    def has_requests(self) -> bool:
        return bool(self.waiting or self.running or self.inflight or self.compiling)

    @property
    def has_work(self) -> bool:
        """Requests that may run, steps in flight, or host-tier copies and disk writes still to
        send (a few steps after them)."""
        return (self.has_requests and not self.held) or bool(self.inflight) or self.memory.io_pending

    @property
    def _plans_ahead(self) -> bool:
        """Whether verify steps, and the steps after them, are planned while the steps before
        run (``--speculative-schedule`` late or overlap) rather than after them."""
        return self.args.speculative_schedule != "wait"

    @property
    def held(self) -> bool:
        """No request may run (``ControlPlane.held``)."""
        return self.control.held

    @property
    def settled(self) -> bool:
        """Every request is done and every copy something waits for is sent: what may still be
        in flight are steps of copies only, which the device runs on its own (the next step
        collects them), and what may still be queued are writes that only fill the host tier
        (the next call's batches carry them)."""
        return not (self.waiting or self.running or self.compiling or self.memory.io_urgent) and all(
            not sampled and not scored for sampled, scored, *_ in self.inflight
        )

    def drain(self) -> None:
        """Collect the copy-only steps still in flight, once settled (request events stay for
        the caller's next ``take_events``)."""
        kept = self.take_events()
        while self.inflight and self.settled:
            kept += self.step()
        self.events = kept + self.events

    @property
    def only_compiling(self) -> bool:
        """Nothing to run until a grammar compiles: callers block instead of stepping (a loop
        spinning on the GIL starves the compile threads, whose first job imports torch)."""
        return bool(self.compiling) and not (self.waiting or self.running or self.inflight)

    def wait_compiled(self, timeout: float) -> None:
        """Block until a grammar being compiled is done, a compile's deadline, or ``timeout``
        seconds pass."""
        until = min([r.grammar_deadline for r in self.compiling], default=0.0) - time.monotonic()
        futures.wait([r.grammar_future for r in self.compiling], max(0.0, min(timeout, until)), futures.FIRST_COMPLETED)

    def _abandon(self, fut: futures.Future) -> None:
        """A compile's request is gone: cancel the compile unless another request waits for it."""
        if all(r.grammar_future is not fut for r in self.compiling):
            self.grammar.abandon(fut)

    def take_events(self) -> list[ReqEvent]:
        """The request events since the last call (``step`` returns them too), in order."""
        events, self.events = self.events, []
        return events

    def _admit_compiled(self) -> None:
        now = time.monotonic()
        for req in [r for r in self.compiling if r.grammar_future.done() or now >= r.grammar_deadline]:
            self.compiling.remove(req)
            fut, req.grammar_future = req.grammar_future, None
            if not fut.done():  # (a started compile goes on; the next request with its text waits for it)
                self._abandon(fut)
                kind = req.params.grammar[0]
                req.error = (
                    f"{kind}: the grammar did not compile within --grammar-compile-timeout-secs "
                    f"({self.args.grammar_compile_timeout_secs:g} s)"
                )
                req.finish_reason = "abort"
                self._lora_ended(req)
            else:
                try:
                    req.matcher = self.grammar.matcher(fut.result())
                except ValueError as e:
                    req.error, req.finish_reason = str(e), "abort"
                    self._lora_ended(req)
                else:
                    self._queue(req)
            self.events.append(ReqEvent("accepted", req, req.finished))

    # ---- one step ------------------------------------------------------------------------------

    def step(self) -> list[ReqEvent]:
        """Schedule and launch one batch, then process the oldest batch whose turn has come
        (with overlap, the one before). Returns the request events since the last call: the
        acceptances (also those of ``add_request``), then the outputs of this step."""
        if self.spec is not None:
            self.spec.rule.step_started(time.perf_counter())
        if self.compiling:
            self._admit_compiled()
        self._drained = []
        self._speculate = self.spec is not None and self.spec.wants(len(self.decoding))
        if any(step[5] for step in self.inflight) and not self._plans_ahead:
            # With --speculative-schedule wait the step after a verify step plans from the tokens
            # it kept (and a verify step waits too, in ``_schedule``, once it is one).
            self._drain()
        batch, sampled, scored, routed, decode, drafts = self._schedule()
        got = self._drained
        if self.spec is not None:
            self.spec.rule.launched(self._speculate if decode else None, len(self.decoding), bool(drafts))
        if batch is None and self.memory.io_pending:  # host-tier copies (or disk writes) still to send
            batch = ForwardBatch(slots=[], cached_lens=[], new_lens=[], input_ids=[], sample=[])
        if self._retracted_tokens:  # one line per step, however many went back
            logger.info(
                "out of KV pages: retracted %d requests (%d tokens) to the queue",
                len(self._retracted_tokens),
                sum(self._retracted_tokens),
            )
            self._retracted_tokens = []
        if batch is not None:
            got += self._launch(batch, sampled, scored, routed, decode, drafts)
        if len(self.inflight) > (1 if self.overlap and batch is not None else 0):
            got += self._process(self.inflight.popleft())
        if self._frozen and not self.has_work:
            gc.unfreeze()  # idle: collections may take their time again
            self._frozen = False
        self.events += [ReqEvent("output", req) for req in got]
        return self.take_events()

    def _launch(
        self,
        batch: ForwardBatch,
        sampled: list[Req],
        scored: list[tuple[Req, int]],
        routed: list[tuple[Req, int]],
        decode: bool,
        drafts: Drafts,
    ) -> list[Req]:
        """Send the batch to the worker (with its drafts or masks once the steps before it are
        processed: the requests those steps gave a token, returned)."""
        got: list[Req] = []
        if self.memory.host is not None:
            self.memory.take_io(batch)
        if self.loras is not None:
            self.loras.stamp(batch)
        self.executor.launch(batch)
        self.inflight.append((sampled, scored, batch.score_logprob_ids, self.counters.steps, routed, drafts))
        if batch.draft_rows:
            # Its drafts follow every token so far: the steps before it are processed first
            # (the worker loads this step's inputs and plans its attention meanwhile).
            while len(self.inflight) > 1:
                got += self._process(self.inflight.popleft())
            self.executor.fill_drafts(self.spec.redraft(drafts, self.counters.steps))
        if batch.mask_rows:
            # The batch samples once its constrained rows' masks come, and a matcher must
            # first see every token sampled before: process the batch before this one (its
            # device work is done or nearly; this batch's forward runs meanwhile).
            while len(self.inflight) > 1:
                got += self._process(self.inflight.popleft())
            rows = [sampled[i] for i in batch.mask_rows]
            self.executor.sample_masked(
                masks(
                    [(r.matcher if grammar_on(r) else None, r.params.json_schema is not None, r.think) for r in rows],
                    self.grammar,
                    self.vocab_size,
                )
            )
        if logger.isEnabledFor(logging.DEBUG):
            kind = ("verify" if drafts else "decode") if decode else "mixed" if batch.prefill_reqs else "prefill"
            kind = kind if batch.slots else "host-tier copies"
            self._step_lines[self.counters.steps] = (
                f"step {self.counters.steps}: {kind} batch of {len(batch.slots)} requests, "
                f"{len(batch.input_ids)} tokens; {len(self.running)} running, {len(self.waiting)} queued, "
                f"{self.allocator.num_free} free pages",
                time.perf_counter(),
            )
        self.counters.steps += 1
        return got

    def _schedule(
        self,
    ) -> tuple[ForwardBatch | None, list[Req], list[tuple[Req, int]], list[tuple[Req, int]], bool, Drafts]:
        """The next batch (prefill chunks if any can run, else a decode or verify step), the
        request of each row it samples, the prompt positions it scores, the positions whose
        experts come back, whether it decodes, and a verify step's drafts."""
        c = self.counters
        if self.held:
            return None, [], [], [], False, []
        while True:
            # Those decoding before this step's last chunks join them (a mixed step decodes them).
            decoders = list(self.decoding) if self.args.enable_mixed_chunk else []
            entries, admitted = self.prefill.schedule(
                self.prefilling, self.waiting, c.steps, len(self.decoding), reserve=len(decoders)
            )
            for req in admitted:
                self.waiting.remove(req)
                self.running.append(req)
                self.prefilling.append(req)
            if entries:
                return self._prefill_step(entries, decoders)
            retract = lambda: self._retract(self.running[-1])  # noqa: E731
            if self._speculate:
                # Waiting, a verify step drafts from every token so far; overlapped, from the
                # steps already back (the GPU ahead of a host-bound model).
                self._drain(done_only=self._plans_ahead)
                verify = self.spec.schedule(self.decoding, retract, c.steps)
                if verify is not None:
                    batch, rows, drafts, routed = verify
                    c.decode_steps += 1
                    c.cascade_steps += bool(batch.group_sizes)
                    return batch, rows, [], routed, True, drafts
            batch = self.decode.schedule(self.decoding, retract)
            if batch is not None:
                c.decode_steps += 1
                c.cascade_steps += bool(batch.group_sizes)
                return batch, self.decode.order.reqs, [], self.decode.routed(batch), True, []
            if not self.running or self.inflight:
                return None, [], [], [], False, []
            # Every running request is mid-prefill and none could get pages: make room.
            self._retract(self.running[-1])

    def _prefill_step(
        self, entries: list, decoders: list[Req]
    ) -> tuple[ForwardBatch, list[Req], list[tuple[Req, int]], list[tuple[Req, int]], bool, Drafts]:
        """``_schedule``'s answer for a step of prefill chunks (``entries``), with a decode row
        for each of ``decoders`` (--enable-mixed-chunk)."""
        c = self.counters
        for req, _, done in entries:
            if done:  # its last chunk: it decodes from the next step on
                self.prefilling.remove(req)
                self.decoding.append(req)
        if self.memory.host is not None:
            self.memory.host.wait_for_loads()
        batch, scored, routed = prefill_batch(entries, self.eos_ids)
        c.prefill_tokens += len(batch.input_ids)
        sampled = [req for req, _, sample in entries if sample]
        if decoders:
            # No retraction for them: the newest request may be in this very chunk.
            decode = self.decode.schedule(decoders, None)
            if decode is not None:
                routed += self.decode.routed(decode)
                batch = mixed_batch(batch, decode)
                sampled += self.decode.order.reqs
                c.mixed_steps += 1
        return batch, sampled, scored, routed, False, []

    def _drain(self, done_only: bool = False) -> None:
        """Process every step in flight, or only those whose tokens are back (their requests in
        ``_drained``, this step's events)."""
        while self.inflight and (not done_only or self.executor.oldest_done()):
            self._drained += self._process(self.inflight.popleft())

    def _process(self, inflight: Inflight) -> list[Req]:
        sampled, scored, score_ids, step, routed, drafts = inflight
        if self.memory.host is not None:
            self.memory.host.done(step)  # the worker sends a step's tokens once its copies are done
        out = self.executor.collect()
        line = self._step_lines.pop(step, None)
        if line is not None:  # (the time includes waiting for the steps launched before it)
            logger.debug("%s; tokens back %.1f ms after launch", line[0], 1e3 * (time.perf_counter() - line[1]))
        if routed:
            record_captures(routed, out)
        if drafts:
            sampled = self.spec.accept(sampled, drafts, out, step)
            return list(dict.fromkeys(apply_output(sampled, scored, score_ids, out, self.finish)))
        return apply_output(sampled, scored, score_ids, out, self.finish)

    # ---- giving pages back ---------------------------------------------------------------------

    def _release(self, req: Req) -> None:
        req.verify_step, req.verify_draft = -1, []  # (a verify step in flight finds it gone: its pages went back here)
        self.memory.release(req)
        if self.loras is not None:
            self.loras.let_go(req)
        self.running.remove(req)
        (self.prefilling if req in self.prefilling else self.decoding).remove(req)

    def _retract(self, req: Req) -> None:
        """Send a running request back to the front of the queue; its outputs so far are kept."""
        self._retracted_tokens.append(req.kv_len)
        self._release(req)
        req.retracted = True
        self._queue(req, front=True)
        self.counters.retractions += 1

    # ---- introspection -------------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        c = self.counters
        return {
            "running_requests": len(self.running),
            "queued_requests": len(self.waiting),
            **self.memory.stats(),
            "prefix_queried_tokens": c.prefix_queried_tokens,
            "prefix_hit_tokens": c.prefix_hit_tokens,
            "cache_hit_rate": c.prefix_hit_tokens / c.prefix_queried_tokens if c.prefix_queried_tokens else 0.0,
            "prefix_host_hit_tokens": c.prefix_host_hit_tokens,
            "retractions": c.retractions,
            "prefill_tokens": c.prefill_tokens,
            "prefill_steps": c.steps - c.decode_steps,
            "decode_steps": c.decode_steps,
            "cascade_steps": c.cascade_steps,
            "mixed_steps": c.mixed_steps,
            **(self.spec.stats() if self.spec is not None else {}),
        }

    def check_integrity(self) -> None:
        """Pages (free, cached or private to one running request), slots and request lists agree."""
        self.memory.check_integrity(self.running)
        assert sorted(map(id, self.running)) == sorted(map(id, self.prefilling + self.decoding)), "request lists"
        assert all(r.prefilling for r in self.prefilling) and not any(r.prefilling for r in self.decoding)
        assert not any(r in self.waiting for r in self.running), "a running request is also queued"
