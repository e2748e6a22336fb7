"""Scheduler: continuous batching over a paged KV cache shared through the prefix cache.

Each ``step`` builds one batch: prefill chunks first (requests already prefilling, then new
ones in policy order, up to the chunk budget), otherwise one decode token for every running
request. Prefilled whole pages are inserted into the prefix cache as soon as their chunk is
scheduled (locked by the request), so later requests in the same round reuse them: within a
step every layer stores all new K/V before attending. When pages run out it evicts unlocked
cache, then retracts the newest running requests back to the queue.

With overlap scheduling (the default) the next batch is built and launched before the previous
one's tokens are known: decode inputs come from the worker's own last sampled token, and a
request whose in-flight step may be its last is not scheduled again. A request that turns out
to have finished (EOS, stop string) simply has its extra in-flight token dropped.
"""

from __future__ import annotations

import logging
import random
from collections import deque
from typing import Protocol
from dataclasses import dataclass

from minisgl.args import EngineArgs
from minisgl.kvcache import CacheHandle, PageAllocator, create_cache_manager
from minisgl.messages import ForwardBatch, NewRequest, StepOutput
from minisgl.sampling import SamplingParams
from minisgl.scheduler.cascade import DecodeOrder, plan_cascade
from minisgl.scheduler.policy import order_waiting
from minisgl.scheduler.grammar import GrammarBackend
from minisgl.scheduler.request import PromptScore, Req
from minisgl.utils import cdiv

logger = logging.getLogger(__name__)


class Executor(Protocol):
    """Runs batches in launch order: ``collect`` returns the oldest launched batch's output."""

    def launch(self, batch: ForwardBatch) -> None: ...

    def collect(self) -> StepOutput: ...

    def sample_masked(self, bitmask: bytes) -> None:
        """Allowed tokens for the last launched batch's ``mask_rows``; it samples once they come."""


Entry = tuple[Req, int, bool]  # request, new tokens this step, whether it samples a token


@dataclass
class Counters:
    prefix_queried_tokens: int = 0  # tokens looked up in the prefix cache
    prefix_hit_tokens: int = 0  # of those, tokens served from the cache
    retractions: int = 0
    steps: int = 0
    prefill_tokens: int = 0  # prompt tokens computed (not served from the cache)
    decode_steps: int = 0
    cascade_steps: int = 0  # decode steps that read shared prefixes once per group


def prompt_scores(req: Req) -> tuple[int, list[PromptScore]]:
    """Hand over a request's prompt logprobs once (with its first output token): the first
    position scored (position 0 has nothing before it) and each position's score."""
    first = max(req.logprob_start, 1)
    req.prompt_scores_sent = True
    return first, [req.prompt_scores[j] for j in range(first, len(req.prompt_ids))]


class Scheduler:
    def __init__(
        self, args: EngineArgs, num_pages: int, context_len: int, vocab_size: int,
        eos_ids: list[int], executor: Executor, grammar: GrammarBackend | None = None,
    ):
        self.args = args
        self.page_size = args.page_size
        self.context_len = context_len
        self.vocab_size = vocab_size
        self.eos_ids = set(eos_ids)
        self.executor = executor
        self.overlap = not args.disable_overlap_schedule
        # Launched batches whose tokens are not back yet, with the prompt positions they score.
        # Launched steps: entries, the (request, position) of each scored prompt row, and the
        # token ids scored at each of those rows.
        self.inflight: deque[tuple[list[Entry], list[tuple[Req, int]], list[int]]] = deque()
        self.cache = create_cache_manager(args.page_size, args.disable_radix_cache)
        self.allocator = PageAllocator(num_pages)
        self.free_slots = list(range(args.max_running_requests - 1, -1, -1))
        self.waiting: deque[Req] = deque()
        self.grammar = grammar
        self.compiling: list[Req] = []  # waiting for their grammar; others are scheduled meanwhile
        self.compiled: list[Req] = []  # grammar done (or failed: req.error) since take_compiled
        self.running: list[Req] = []  # requests holding a slot, oldest first
        self.counters = Counters()
        self._rng = random.Random(args.seed)
        self._next_rid = 0
        self._groups = DecodeOrder([])  # the last decode step's order and cascade groups
        self._groups_key: tuple = ()  # what they were computed from (tree lock epoch, requests)

    # ---- requests in and out -------------------------------------------------------------------

    def add_request(
        self, prompt_ids: list[int], params: SamplingParams, top_logprobs: int = -1, logprob_start: int = -1,
        logprob_ids: list[int] | None = None,
    ) -> Req:
        """Validate and queue a request. Raises ValueError naming what is wrong."""
        params.validate(self.vocab_size)
        if logprob_ids and any(not 0 <= t < self.vocab_size for t in logprob_ids):
            raise ValueError(f"token_ids_logprob must be in [0, {self.vocab_size})")
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if any(not 0 <= t < self.vocab_size for t in prompt_ids):
            raise ValueError(f"input_ids must be in [0, {self.vocab_size})")
        if len(prompt_ids) >= self.context_len:
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens; the context length is {self.context_len}"
            )
        max_len = min(len(prompt_ids) + params.max_new_tokens, self.context_len)
        if cdiv(max_len, self.page_size) > self.allocator.num_pages:
            raise ValueError(f"the request needs {max_len} tokens of KV cache; the pool holds "
                             f"{self.allocator.num_pages * self.page_size}")
        grammar = params.grammar
        if grammar is not None and self.grammar is None:
            raise ValueError("structured output is not available in this scheduler")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        req = Req(self._next_rid, list(prompt_ids), params, seed, max_len, top_logprobs,
                  queued_step=self.counters.steps, logprob_start=min(logprob_start, len(prompt_ids)),
                  logprob_ids=list(logprob_ids or []) if top_logprobs >= 0 else [])
        self._next_rid += 1
        if params.max_new_tokens == 0 and not req.scores_prompt:
            req.finish_reason = "length"
        elif grammar is not None:
            req.grammar_future = self.grammar.compile(*grammar)
            self.compiling.append(req)
        else:  # max_new_tokens 0 with prompt logprobs: a prefill that scores the prompt, no token
            self.waiting.append(req)
        return req

    def finish(self, req: Req, reason: str) -> None:
        """End a request early (abort, stop string): free its slot and cache what it computed."""
        if req.finished:
            return
        req.finish_reason = reason
        req.matcher = None
        if req in self.compiling:
            self.compiling.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        if req.slot is not None:
            self._release(req)

    def flush_cache(self) -> bool:
        """Drop every cached prefix; refused (False) while requests are queued or running."""
        if self.has_work:
            return False
        self.allocator.free(self.cache.reset())
        return True

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.inflight or self.compiling)

    def take_compiled(self) -> list[Req]:
        """Requests whose grammar compiled (now queued) or failed (``error`` set, finished)
        since the last call."""
        done, self.compiled = self.compiled, []
        return done

    def _admit_compiled(self) -> None:
        for req in [r for r in self.compiling if r.grammar_future.done()]:
            self.compiling.remove(req)
            try:
                req.matcher = self.grammar.matcher(req.grammar_future.result())
            except ValueError as e:
                req.error, req.finish_reason = str(e), "abort"
            else:
                self.waiting.append(req)
            req.grammar_future = None
            self.compiled.append(req)

    # ---- one step ------------------------------------------------------------------------------

    def step(self) -> list[Req]:
        """Schedule and launch one batch, then process the oldest batch whose turn has come
        (with overlap, the one before). Returns the requests that got a token."""
        if self.compiling:
            self._admit_compiled()
        entries, decode = self._schedule()
        got: list[Req] = []
        if entries:
            batch, scored = self._build_batch(entries, decode, self._groups if decode else None)
            self.executor.launch(batch)
            self.inflight.append((entries, scored, batch.score_logprob_ids))
            if batch.mask_rows:
                # The batch samples once its constrained rows' masks come, and a matcher must
                # first see every token sampled before: process the batch before this one (its
                # device work is done or nearly; this batch's forward runs meanwhile).
                while len(self.inflight) > 1:
                    got += self._process(*self.inflight.popleft(), self.executor.collect())
                sampled = [req for req, _, sample in entries if sample]
                self.executor.sample_masked(self.grammar.bitmask(
                    [(sampled[i].matcher, sampled[i].params.json_schema is not None) for i in batch.mask_rows]))
            self._count_step(entries, decode)
            logger.debug(
                "step %d: %s batch of %d requests, %d tokens; %d running, %d queued, %d free pages",
                self.counters.steps, "decode" if decode else "prefill", len(entries),
                sum(n for _, n, _ in entries), len(self.running), len(self.waiting), self.allocator.num_free,
            )
        if len(self.inflight) > (1 if self.overlap and entries else 0):
            got += self._process(*self.inflight.popleft(), self.executor.collect())
        return got

    def _count_step(self, entries: list[Entry], decode: bool) -> None:
        c = self.counters
        c.steps += 1
        if decode:
            c.decode_steps += 1
            c.cascade_steps += bool(self._groups.group_sizes)
        else:
            c.prefill_tokens += sum(n for _, n, _ in entries)

    def _schedule(self) -> tuple[list[Entry], bool]:
        while True:
            entries = self._schedule_prefill()
            if entries:
                return entries, False
            entries = self._schedule_decode()
            if entries or not self.running or self.inflight:
                return entries, True
            # Every running request is mid-prefill and none could get pages: make room.
            self._retract(self.running[-1])

    def _alloc(self, n: int) -> list[int] | None:
        """n free pages, evicting unlocked cache if needed; None if even that is not enough."""
        short = n - self.allocator.num_free
        if short > 0:
            if short > self.cache.size_info().evictable:
                return None
            self.allocator.free(self.cache.evict(short))
        return self.allocator.alloc(n)

    @staticmethod
    def _reusable(req: Req, upto: int) -> int:
        """How many of its first tokens a request may take from the cache: position j's prompt
        logprob needs the hidden state at j - 1, so those positions are computed again."""
        return min(upto, max(req.logprob_start - 1, 0)) if req.scores_prompt else upto

    def _admit(self, req: Req) -> None:
        """Give a waiting request a slot and lock the longest cached prefix of its tokens."""
        ids = req.all_ids
        handle, pages = self.cache.match_prefix(ids[: self._reusable(req, len(ids) - 1)])
        self.cache.lock_handle(handle)
        req.slot, req.handle, req.pages = self.free_slots.pop(), handle, pages
        req.kv_len, req.table_len, req.prefill_target = handle.cached_len, 0, len(ids)
        self.running.append(req)

    def _count_hit(self, req: Req, tokens: int) -> None:
        """Hits count once per request, on its prompt: a retracted request re-admitted finds
        its own earlier pages, which is no hit."""
        if not req.retracted:
            req.cached_tokens += tokens
            self.counters.prefix_hit_tokens += tokens

    def _rematch(self, req: Req) -> None:
        """A prefilling request picks up pages another request cached since its last chunk."""
        handle, pages = self.cache.match_prefix(req.all_ids[: self._reusable(req, req.prefill_target - 1)])
        if handle.cached_len > req.kv_len:
            self.cache.lock_handle(handle)
            self.cache.lock_handle(req.handle, unlock=True)
            self._count_hit(req, handle.cached_len - req.kv_len)
            req.handle, req.pages, req.kv_len = handle, pages, handle.cached_len

    def _schedule_chunk(self, req: Req, budget: int) -> Entry | None:
        """Reserve pages for the request's next prefill chunk (at most ``budget`` tokens)."""
        if self.cache.reuses_prefixes:
            self._rematch(req)
        target = req.prefill_target
        end = min(target, req.kv_len + budget)
        if end < target:
            end -= end % self.page_size  # chunks end on page boundaries
        if end <= req.kv_len:
            return None
        pages = self._alloc(cdiv(end, self.page_size) - len(req.pages))
        if pages is None:
            return None
        req.pages += pages
        start, req.kv_len = req.kv_len, end
        if self.cache.reuses_prefixes and not req.scores_prompt:
            # Publish the whole pages at once; the request's final token stays out so that an
            # identical prompt can never produce a duplicate page while both are running. (A
            # request scoring its prompt may recompute cached pages: it publishes at release.)
            upto = min(end, target - 1)
            req.handle, _, duplicates = self.cache.commit(req.all_ids[:upto], req.pages, req.handle)
            assert not duplicates, "pages were cached between a match and its commit"
        return req, end - start, end == target

    def _schedule_prefill(self) -> list[Entry]:
        budget, entries = self.args.prefill_budget(self.context_len), []
        chunk = self.args.prefill_chunk(self.context_len)
        for req in [r for r in self.running if r.prefilling]:
            if budget <= 0:
                return entries
            entry = self._schedule_chunk(req, min(budget, chunk))
            if entry is None:
                return entries
            entries.append(entry)
            budget -= entry[1]
        if budget <= 0 or not self.free_slots or not self.waiting:
            return entries
        for req in order_waiting(self.waiting, self.cache, self.args.schedule_policy, self.counters.steps):
            if budget <= 0 or not self.free_slots:
                break
            self._admit(req)
            matched = req.kv_len
            entry = self._schedule_chunk(req, min(budget, chunk))
            if entry is None:
                self._release(req)  # not enough pages now: try again after others finish
                break
            self.waiting.remove(req)
            if not req.retracted:
                self.counters.prefix_queried_tokens += req.prefill_target
            self._count_hit(req, matched)
            entries.append(entry)
            budget -= entry[1]
        return entries

    def _schedule_decode(self) -> list[Entry]:
        """One token for every request past its prefill; retracts the newest when pages run out."""
        while True:
            # kv_len + 1 tokens exist once the in-flight step (if any) samples; stop at max_len.
            decoding = [r for r in self.running if not r.prefilling and r.kv_len + 1 < r.max_len]
            needy = [r for r in decoding if r.kv_len % self.page_size == 0]
            pages = self._alloc(len(needy))
            if pages is not None:
                break
            self._retract(self.running[-1])
        for req, page in zip(needy, pages):
            req.pages.append(page)
        for req in decoding:
            req.kv_len += 1
        key = (self.cache.epoch, *map(id, decoding))
        if key != self._groups_key:  # locks and requests unchanged: last step's groups still hold
            self._groups_key = key
            self._groups = plan_cascade(decoding, self.cache, self.page_size, not self.args.disable_cascade_attention)
        return [(req, 1, True) for req in self._groups.reqs]

    def _build_batch(
        self, entries: list[Entry], decode: bool, groups: DecodeOrder | None
    ) -> tuple[ForwardBatch, list[tuple[Req, int]]]:
        """The step's batch, and the (request, prompt position) of each row it scores."""
        batch = ForwardBatch(slots=[], cached_lens=[], new_lens=[], input_ids=[], sample=[])
        if groups is not None:
            batch.group_sizes, batch.group_pages = groups.group_sizes, groups.group_pages
        scored: list[tuple[Req, int]] = []
        row = 0
        for req, new, sample in entries:
            start = req.kv_len - new
            if req.scores_prompt and not decode:
                # Row start + k holds the hidden state of position start + k, which predicts
                # position start + k + 1: the chunk scores positions start + 1 .. kv_len.
                for j in range(max(start + 1, req.logprob_start, 1), min(req.kv_len, len(req.prompt_ids) - 1) + 1):
                    batch.score_rows.append(row + j - 1 - start)
                    batch.score_ids.append(req.prompt_ids[j])
                    scored.append((req, j))
                batch.score_top = max(batch.score_top, req.top_logprobs)
                if req.logprob_ids:
                    batch.score_logprob_ids = sorted(set(batch.score_logprob_ids) | set(req.logprob_ids))
            row += new
            batch.slots.append(req.slot)
            batch.cached_lens.append(start)
            batch.new_lens.append(new)
            if sample and req.matcher is not None:
                batch.mask_rows.append(sum(batch.sample))
            batch.sample.append(sample)
            if decode:
                batch.input_ids.append(-1)  # the worker feeds back the token it sampled last step
            else:
                batch.input_ids += req.all_ids[start : req.kv_len]
            if req.table_len == 0:
                batch.new_requests.append(self._new_request_msg(req))
            for col in range(req.table_len, len(req.pages)):
                batch.table_slots.append(req.slot)
                batch.table_cols.append(col)
                batch.table_pages.append(req.pages[col])
            req.table_len = len(req.pages)
        return batch, scored

    def _new_request_msg(self, req: Req) -> NewRequest:
        p = req.params
        penalties = p.has_penalty
        # min_new_tokens: the tokens that would end it are banned until it has that many.
        ban = sorted(set(p.stop_token_ids or []) | (set() if p.ignore_eos else self.eos_ids)) if p.min_new_tokens else []
        return NewRequest(
            slot=req.slot, sampling=p, seed=req.seed, top_logprobs=req.top_logprobs,
            prompt_ids=req.prompt_ids if penalties else [], output_ids=req.output_ids if penalties else [],
            prompt_len=len(req.prompt_ids), ban_ids=ban, logprob_ids=req.logprob_ids,
        )

    def _process(
        self, entries: list[Entry], scored: list[tuple[Req, int]], score_ids: list[int], out: StepOutput
    ) -> list[Req]:
        column = {t: c for c, t in enumerate(score_ids)}
        for k, (req, j) in enumerate(scored):
            top = list(zip(out.score_top_ids[k], out.score_top_logprobs[k])) if out.score_top_ids else []
            ids = [out.score_id_logprobs[k][column[t]] for t in req.logprob_ids] if req.logprob_ids else []
            req.prompt_scores[j] = (out.score_logprobs[k], top[: max(req.top_logprobs, 0)], ids)
        sampled = [req for req, _, sample in entries if sample]
        got = []
        for i, req in enumerate(sampled):
            if req.finished:  # finished while this batch was in flight: drop the extra token
                continue
            if req.params.max_new_tokens == 0:  # it only scored its prompt
                self.finish(req, "length")
                got.append(req)
                continue
            token = out.tokens[i]
            req.output_ids.append(token)
            if out.logprobs is not None:
                req.output_logprobs.append(out.logprobs[i])
            if out.top_ids is not None:
                req.output_top_logprobs.append(list(zip(out.top_ids[i], out.top_logprobs[i])))
            if req.logprob_ids:
                req.output_id_logprobs.append(out.id_logprobs[i])
            reason = self._finish_reason(req, token)
            if req.matcher is not None:
                req.matcher.accept_token(token)
                if reason is None and req.matcher.is_terminated():
                    reason = "stop"  # the grammar is complete (its last token was a stop token)
            if reason is not None:
                self.finish(req, reason)
            got.append(req)
        return got

    def _finish_reason(self, req: Req, token: int) -> str | None:
        p = req.params
        if (p.stop_token_ids and token in p.stop_token_ids) or (not p.ignore_eos and token in self.eos_ids):
            return "stop"
        if len(req.prompt_ids) + len(req.output_ids) >= req.max_len:
            return "length"
        return None

    # ---- giving pages back ---------------------------------------------------------------------

    def _release(self, req: Req) -> None:
        """Cache the request's computed whole pages, free the rest and its slot."""
        computed = req.all_ids[: req.kv_len]
        handle, _, duplicates = self.cache.commit(computed, req.pages, req.handle)
        self.cache.lock_handle(handle, unlock=True)
        tail = req.pages[self.cache.aligned(len(computed)) // self.page_size :]
        self.allocator.free(duplicates + tail)
        self.free_slots.append(req.slot)
        self.running.remove(req)
        req.slot, req.handle, req.pages, req.kv_len, req.table_len = None, CacheHandle(0), [], 0, 0

    def _retract(self, req: Req) -> None:
        """Send a running request back to the front of the queue; its outputs so far are kept."""
        logger.info("out of KV pages: retracting request %d (%d tokens)", req.rid, req.kv_len)
        self._release(req)
        req.retracted = True
        self.waiting.appendleft(req)
        self.counters.retractions += 1

    # ---- introspection -------------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        info = self.cache.size_info()
        c = self.counters
        return {
            "running_requests": len(self.running),
            "queued_requests": len(self.waiting),
            "total_pages": self.allocator.num_pages,
            "free_pages": self.allocator.num_free,
            "evictable_pages": info.evictable,
            "protected_pages": info.protected,
            "used_pages": self.allocator.num_pages - self.allocator.num_free,
            # Pages that eviction cannot reclaim now: private to requests or locked by them.
            "kv_usage": (self.allocator.num_pages - self.allocator.num_free - info.evictable) / self.allocator.num_pages,
            "prefix_queried_tokens": c.prefix_queried_tokens,
            "prefix_hit_tokens": c.prefix_hit_tokens,
            "cache_hit_rate": c.prefix_hit_tokens / c.prefix_queried_tokens if c.prefix_queried_tokens else 0.0,
            "retractions": c.retractions,
            "prefill_tokens": c.prefill_tokens,
            "prefill_steps": c.steps - c.decode_steps,
            "decode_steps": c.decode_steps,
            "cascade_steps": c.cascade_steps,
        }

    def check_integrity(self) -> None:
        """Every page is exactly one of: free, cached, or private to one running request."""
        self.cache.check_integrity()
        free = self.allocator.free_pages()
        cached = set(self.cache.all_pages())
        private: list[int] = []
        for req in self.running:
            assert cdiv(req.kv_len, self.page_size) <= len(req.pages), f"request {req.rid} lacks pages"
            private += [p for p in req.pages if p not in cached]
        assert len(set(free)) == len(free), "a page is free twice"
        assert len(set(private)) == len(private), "a page is private to two requests"
        assert not set(free) & cached and not set(free) & set(private), "a used page is also free"
        info = self.cache.size_info()
        assert len(free) + info.total + len(private) == self.allocator.num_pages, (
            f"free {len(free)} + cached {info.total} + private {len(private)} != {self.allocator.num_pages}"
        )
