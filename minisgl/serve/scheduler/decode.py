"""Decode: one more token for every request past its prefill, with the pages that takes.

A request whose in-flight step may be its last is not scheduled again (``kv_len + 1`` tokens
exist once that step samples). A request gets a page when its next token starts one; when the
pool runs dry even after evicting unlocked cache, the caller retracts its newest request and
the step is planned again. The batch order and cascade groups come from the radix tree and are
planned again only when a lock or the set of requests changed.
"""

from __future__ import annotations

from collections.abc import Callable

from minisgl.serve.scheduler.cascade import DecodeOrder, plan_cascade
from minisgl.serve.scheduler.pages import Memory
from minisgl.serve.scheduler.prefill_batch import write_table
from minisgl.serve.scheduler.request import Req
from minisgl.serve.scheduler.think_budget import near_budget
from minisgl.wire.steps import ForwardBatch


class DecodePlanner:
    def __init__(self, memory: Memory, cascade: bool, routing: bool = False, speculative: bool = False):
        self.memory = memory
        self.routing = routing  # requests may return routed experts or hidden states: find their rows
        self.speculative = speculative  # requests may have a verify step in flight: find their rows
        self.page_size = memory.page_size
        self.cascade = cascade
        self.order = DecodeOrder([])  # the last step's order and cascade groups
        self._key: tuple = ()  # what they were computed from (tree lock epoch, requests)

    def schedule(self, decoding: list[Req], retract_newest: Callable[[], None] | None) -> ForwardBatch | None:
        """The decode step's batch (None: nothing to decode), reserving pages for it. Without
        ``retract_newest`` (a mixed step's decode rows) it is None too when pages are short,
        with nothing changed."""
        page = self.page_size
        while True:
            reqs = [r for r in decoding if r.kv_len + 1 < r.max_len]
            needy = [r for r in reqs if r.kv_len % page == 0]
            pages = self.memory.alloc(len(needy))
            if pages is not None:
                break
            if retract_newest is None:
                return None
            retract_newest()
        if not reqs:
            return None
        for req, p in zip(needy, pages):
            req.pages.append(p)
        for req in reqs:
            req.kv_len += 1
        key = (self.memory.cache.epoch, *map(id, reqs))
        if key != self._key:  # locks and requests unchanged: last step's groups still hold
            self._key = key
            self.order = plan_cascade(reqs, self.memory.cache, page, self.cascade)
        return self._batch(self.order, needy, self.speculative)

    def routed(self, batch: ForwardBatch) -> list[tuple[Req, int]]:
        """The (request, position) of the step's rows whose experts or hidden states come back
        (``route_rows``)."""
        if not self.routing:
            return []
        reqs = self.order.reqs
        batch.route_rows = [i for i, r in enumerate(reqs) if 0 <= r.capture_start < r.kv_len]
        return [(reqs[i], reqs[i].kv_len - 1) for i in batch.route_rows]

    @staticmethod
    def _batch(order: DecodeOrder, needy: list[Req], speculative: bool) -> ForwardBatch:
        reqs, n = order.reqs, len(order.reqs)
        batch = ForwardBatch(
            slots=[r.slot for r in reqs],
            cached_lens=[r.kv_len - 1 for r in reqs],
            new_lens=[1] * n,
            input_ids=[-1] * n,  # the worker feeds back the token each slot sampled last step
            sample=[True] * n,
            group_sizes=order.group_sizes,
            group_pages=order.group_pages,
            mask_rows=[i for i, r in enumerate(reqs) if r.masked and (r.matcher is not None or near_budget(r))],
            resolve_rows=[i for i, r in enumerate(reqs) if r.verify_step >= 0] if speculative else [],
        )
        for req in needy:
            write_table(batch, req)
        return batch
