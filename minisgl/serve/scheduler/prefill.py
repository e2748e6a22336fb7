"""Prefill: which prompt tokens the next step computes.

Requests already prefilling get their next chunk first (oldest first), then waiting requests
are admitted in queue order, while the step's token budget and the free slots last. Whole pages
of a scheduled chunk enter the prefix cache at once (locked by the request), so requests
admitted after it in the same round or the next reuse them: within a step every layer stores
all new K/V before attending.
"""

from __future__ import annotations

from minisgl.config.args import EngineArgs
from minisgl.serve.scheduler.counters import Counters
from minisgl.serve.scheduler.lora import LoraRegistry
from minisgl.serve.scheduler.pages import Memory
from minisgl.serve.scheduler.queue import WaitingQueue
from minisgl.serve.scheduler.request import Req
from minisgl.utils import cdiv

Entry = tuple[Req, int, bool]  # request, new tokens this step, whether it samples a token

# With this many requests decoding, new ones are admitted once 1/ADMIT_TOGETHER_SHARE of the slots
# are free (see PrefillPlanner.schedule).
ADMIT_TOGETHER_FROM = 64
ADMIT_TOGETHER_SHARE = 32


def reusable(req: Req, upto: int) -> int:
    """How many of its first tokens a request may take from the cache: position j's prompt
    logprob needs the hidden state at j - 1, and positions whose experts it returns must run
    through the model, so those positions are computed again."""
    if req.scores_prompt:
        upto = min(upto, max(req.logprob_start - 1, 0))
    return min(upto, req.captured_until)


class PrefillPlanner:
    def __init__(
        self, args: EngineArgs, context_len: int, memory: Memory, counters: Counters, loras: LoraRegistry | None = None
    ):
        self.memory = memory
        self.loras = loras  # LoRA adapters: an admitted request's adapter goes into a device slot
        self.page_size = args.page_size
        self.budget = args.prefill_budget(context_len)
        self.chunk = args.prefill_chunk(context_len)
        self.counters = counters
        self.admit_together = max(1, args.running_limit // ADMIT_TOGETHER_SHARE)
        self.filling = False  # admitting a batch of free slots, over as many steps as it takes

    def count_hit(self, req: Req, tokens: int) -> None:
        """Hits count once per request, on its prompt: a retracted request re-admitted finds
        its own earlier pages, which is no hit."""
        if not req.retracted:
            req.cached_tokens += tokens
            self.counters.prefix_hit_tokens += tokens

    def chunk_of(self, req: Req, budget: int, admitted: bool = False) -> Entry | None:
        """Reserve pages for the request's next prefill chunk (at most ``budget`` tokens).
        ``admitted``: it was matched against the cache just now (nothing to take up since)."""
        memory = self.memory
        snapshots = memory.cache.takes_snapshots  # (a hybrid's state cannot take up pages mid-prompt)
        if memory.cache.reuses_prefixes and not admitted and not snapshots:
            self.count_hit(req, memory.rematch(req, reusable(req, req.prefill_target - 1)))
        target = req.prefill_target
        end = min(target, req.kv_len + budget)
        if end < target:
            end -= end % self.page_size  # chunks end on page boundaries
        # A hybrid's snapshots (``Memory.admit``): the worker saves one inside a chunk, part-way
        # through its forward; a chunk holding two ends at the first.
        inside = [p for p in req.snapshot_at if req.kv_len < p < end] if snapshots else []
        if len(inside) > 1:
            end = inside[0]
        if end <= req.kv_len:
            return None
        pages = memory.alloc(cdiv(end, self.page_size) - len(req.pages))
        if pages is None:
            return None
        req.pages += pages
        start, req.kv_len = req.kv_len, end
        if memory.cache.reuses_prefixes and not req.recomputes_prompt:
            # The request's final token stays out, so that an identical prompt can never produce
            # a duplicate page while both run. (One recomputing its prompt may recompute cached
            # pages: it publishes at release.)
            memory.publish(req, min(end, target - 1))
            if len(inside) == 1:
                req.state_split = (self._snapshot(req, inside[0]), inside[0] - start)
            if end in req.snapshot_at:
                req.state_save = self._snapshot(req, end)
        return req, end - start, end == target

    def _snapshot(self, req: Req, point: int) -> int:
        """A row for the state after the request's first ``point`` tokens, attached to their
        node (-1: no row is free, or the node has a snapshot)."""
        row = self.memory.cache.take()
        if row is not None and self.memory.cache.attach(req.all_ids[:point], row, req.kv_salt):
            return row
        return -1

    def schedule(
        self, prefilling: list[Req], queue: WaitingQueue, step: int, decoding: int, reserve: int = 0
    ) -> tuple[list[Entry], list[Req]]:
        """This step's prefill chunks, and the requests it admitted from the queue (now holding
        a slot; the caller takes them off the queue). ``decoding``: requests past their prefill;
        ``reserve``: tokens of the step's budget its decode rows take (--enable-mixed-chunk), so a
        mixed step keeps near the budget (and the piecewise graphs' sizes).

        While a large batch decodes, new requests wait until a few slots are free together, then
        fill them all (over several steps if the token budget says so): a prefill step costs
        about a decode step whatever it computes, and with thousands of requests finishing a few
        per step, admitting each handful at once made a third of the steps prefills of a few
        tokens (repeated sampling: each sample's last partial page)."""
        # (at most half of it: prefill keeps moving however many requests decode)
        budget, entries, admitted = self.budget - min(reserve, self.budget // 2), [], []
        if self.memory.cache.takes_snapshots:
            self.memory.cache.now = step  # (snapshots this step attaches are written by it)
        for req in prefilling:
            if budget <= 0:
                return entries, admitted
            entry = self.chunk_of(req, min(budget, self.chunk))
            if entry is None:
                return entries, admitted
            entries.append(entry)
            budget -= entry[1]
        memory = self.memory
        if budget <= 0 or not memory.free_slots or not queue:
            return entries, admitted
        if decoding >= ADMIT_TOGETHER_FROM and not self.filling:
            if len(memory.free_slots) < self.admit_together:
                return entries, admitted
            self.filling = True  # from here, admit every step until the slots or the queue run out
        new, admitted = self._admit(queue, step, budget)
        entries += new
        if not memory.free_slots or len(admitted) == len(queue):
            self.filling = False
        return entries, admitted

    def _admit(self, queue: WaitingQueue, step: int, budget: int) -> tuple[list[Entry], list[Req]]:
        """Requests from the queue in its order, each with its first chunk, while the token
        budget and the slots last."""
        memory, loras = self.memory, self.loras
        snapshots, entries, admitted = memory.cache.takes_snapshots, [], []
        for req in queue.order(step, memory.cache):
            if budget <= 0 or not memory.free_slots:
                break
            if loras is not None and not loras.place(req):
                continue  # every adapter slot serves running requests of other adapters: later
            if snapshots and memory.cache.pending(req.all_ids[: len(req.all_ids) - 1], req.kv_salt):
                continue  # a step in flight writes the state of a prefix it shares: start from that
            # Pages coming back from the host tier are copied by this very batch, whose prefill
            # waits for each layer's copies before that layer (online multi-turn on the 8B: 47.3 s
            # against 50.4 s when the prefill waited beside decode steps until they were done).
            shared = queue.shared_depth(req) if snapshots else 0  # (the others sharing it start there)
            loaded = memory.admit(req, reusable(req, len(req.all_ids) - 1), shared)
            matched = req.kv_len
            entry = self.chunk_of(req, min(budget, self.chunk), admitted=True)
            if entry is None:
                memory.release(req)  # not enough pages now: try again after others finish
                req.lora_slot = -1
                break
            if loras is not None:
                loras.hold(req)
            admitted.append(req)
            if not req.retracted:
                self.counters.prefix_queried_tokens += req.prefill_target
                self.counters.prefix_host_hit_tokens += loaded
                req.host_cached_tokens += loaded
            self.count_hit(req, matched)
            entries.append(entry)
            budget -= entry[1]
        return entries, admitted
