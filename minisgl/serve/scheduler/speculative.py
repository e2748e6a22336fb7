"""Speculative decoding drafted from the radix tree (``--speculative-algorithm NGRAM``).

While few requests decode, each one's last tokens are looked up in an n-gram index over the
radix tree's token paths (the other samples of its prompt, earlier requests: ``NgramIndex``),
over its own tokens and over its predicted output (``Prediction``); what followed them there is
its draft. A verify step is a decode step whose drafting requests each take a run of rows, one
per position (its last token, then its draft), all on its page-table row: each row attends up
to its own position, the run reads the pages before it once as a cascade group, and the step
replays the decode CUDA graphs. Every
row samples by its request's own rule. The worker's sampler draws position p's token from
(seed, p) alone, so the token each row samples is the one a plain decode step would have
sampled there: a draft token is kept while it equals the token sampled before it, and the first
differing sample (or the one after the whole draft) ends the step. Greedy and seeded outputs
equal speculation off token for token, and an unseeded request's distribution is unchanged
(each position is still one draw from the target's distribution, keeping a draft token with
exactly its probability).

A verify step is planned and loaded while the step before it runs, and its draft tokens are
made and sent once that step's tokens are back (``--speculative-schedule late``, ``redraft``),
so drafts follow every token so far. With ``wait`` a verify step waits for the steps in flight
before it is planned, and so does the step after one. Planned beside the step in flight (late
or ``overlap``), a request's last token may still be in flight: its draft is made from the
tokens before it, the first drafted token standing in for the unknown one (``overlap``;
``late`` drafts again once it is known), and its run's first row takes the worker's own last
token (a wrong guess only costs acceptance). A request whose verify run is in flight counts
that draft as kept: it drafts after it (while drafts are kept whole) or takes a plain row, and
the worker lowers those rows' lengths by the rows the run rejected
(``ForwardBatch.resolve_rows``); the pages past the real length go back once the tokens are
here. Whether a step speculates is measured (``spec_rule.SpecRule``).
Requests whose sampling reads earlier outputs on the device (penalties), follow a grammar or
return routed experts or hidden states decode plainly.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from minisgl.serve.cache.ngram_index import NgramIndex, suffix_hashes, window_hashes
from minisgl.serve.scheduler.decode import DecodePlanner
from minisgl.serve.scheduler.pages import Memory
from minisgl.serve.scheduler.prediction import Prediction
from minisgl.serve.scheduler.prefill_batch import append_rows, write_table
from minisgl.serve.scheduler.request import Req
from minisgl.serve.scheduler.spec_rule import SpecRule
from minisgl.utils import cdiv
from minisgl.wire.steps import MAX_CASCADE_GROUPS, ForwardBatch, StepOutput

# A request that had this many verify runs in a row with nothing accepted drafts again only after
# as many plain steps. (Longer rests, or counting tries that found no draft as misses, cut the
# drafting work but kept fewer tokens in replays of SmolLM2's sampled answers: 342 steps of 387
# against 311, ``speculative_h100_2026-11-27.md``.)
MISSES_BEFORE_PAUSE = 2
# New tokens of a request indexed one at a time in Python; more (a prompt) go through numpy.
BULK = 16

Drafts = list[tuple[Req, list[int]]]  # a verify step's drafting requests, each with its draft


def resting(req: Req) -> bool:
    """Whether the request skips drafting this step (counting the step off its pause)."""
    if req.spec_pause > 0:
        req.spec_pause -= 1
        return True
    return False


def count_run(req: Req, kept: bool) -> None:
    """A verify run of the request kept a draft token (or none: ``MISSES_BEFORE_PAUSE`` such runs
    in a row make it rest as many steps)."""
    req.spec_misses = 0 if kept else req.spec_misses + 1
    if req.spec_misses >= MISSES_BEFORE_PAUSE:
        req.spec_pause, req.spec_misses = MISSES_BEFORE_PAUSE, 0


def tokens_at(req: Req, pending: list[int], start: int, stop: int) -> list[int]:
    """Positions [start, stop) of the request's prompt, outputs and then ``pending``, without
    joining them whole (a per-step copy of a long context costs more than the lookups)."""
    prompt, outputs = req.prompt_ids, req.output_ids
    p = len(prompt)
    out = prompt[start:stop] if start < p else []
    if stop > p:
        out += outputs[max(start - p, 0) : stop - p]
        o = p + len(outputs)
        if stop > o:
            out += pending[max(start - o, 0) : stop - o]
    return out


class Drafter:
    """Drafts from the tree's index, each request's own tokens and its predicted output."""

    def __init__(self, index: NgramIndex | None, min_n: int, max_n: int):
        self.index, self.min_n, self.max_n = index, min_n, max_n

    def draft(self, req: Req, count: int, pending: list[int] = ()) -> list[int]:
        """Up to ``count`` tokens to follow ``req``'s tokens and then ``pending`` (a draft of it
        in flight, taken as kept): after its longest recent n-gram found (at each length its
        predicted output first, then its own earlier tokens, then the tree's)."""
        pending = list(pending)
        known = req.num_tokens
        own = self._own_tables(req, known)
        if req.options.prediction_ids and req.prediction is None:
            req.prediction = Prediction(req.options.prediction_ids, self.min_n, self.max_n)
        length = known + len(pending)
        tail = tokens_at(req, pending, max(length - self.max_n, 0), length)
        keys = suffix_hashes(tail, self.max_n)
        if not pending:  # the windows the next step's tables add, if one token comes
            req.ngram_keys, req.ngram_keys_end = keys, length
        for n in range(len(keys), self.min_n - 1, -1):
            key = keys[n - 1]
            if req.prediction is not None:
                found = req.prediction.draft(n, key, tail, count)
                if found:
                    return found
            end = own[n].get(key)
            if end is not None and tokens_at(req, pending, end - n, end) == tail[-n:]:
                return tokens_at(req, pending, end, min(end + count, length))
            if self.index is not None:
                found = self.index.lookup(n, key, tail, count)
                if found:
                    return found
        return []

    def _own_tables(self, req: Req, known: int) -> dict[int, dict[int, int]]:
        """The request's n-gram tables, brought up to all windows of its ``known`` tokens but
        the last (whose continuation is still to come)."""
        if req.ngrams is None:
            req.ngrams = {n: {} for n in range(self.min_n, self.max_n + 1)}
        upto, end = req.ngrams_upto, known - 1
        if 0 < end - upto <= BULK:  # a step's few new tokens: in Python
            for stop in range(upto + 1, end + 1):
                if stop == req.ngram_keys_end:  # hashed as the last step's query
                    keys = req.ngram_keys
                else:
                    keys = suffix_hashes(tokens_at(req, [], max(stop - self.max_n, 0), stop), self.max_n)
                for n, h in enumerate(keys, 1):
                    if n >= self.min_n:
                        req.ngrams[n][h] = stop
            req.ngrams_upto = end
        elif end > upto:
            first = max(upto - self.max_n + 1, 0)
            by_length = window_hashes(np.asarray(tokens_at(req, [], first, end), dtype=np.int64), self.max_n)
            for n, table in req.ngrams.items():
                if n > len(by_length):
                    break
                hashes = by_length[n - 1]
                ends = np.arange(len(hashes), dtype=np.int64) + first + n
                fresh = ends > upto  # windows not indexed before
                table.update(zip(hashes[fresh].tolist(), ends[fresh].tolist()))
            req.ngrams_upto = end
        return req.ngrams


class SpecPlanner:
    """Verify steps: which requests draft, their pages, the batch, and what a step accepted."""

    def __init__(
        self,
        memory: Memory,
        decode: DecodePlanner,
        drafter: Drafter,
        num_draft_tokens: int,
        max_rows: int = 1 << 30,
        max_batch: int = 32,
        late: bool = False,
        waits: bool = False,
    ):
        self.memory, self.decode, self.drafter = memory, decode, drafter
        self.late = late  # drafts sent after the steps before are processed (``redraft``)
        self.k = num_draft_tokens
        self.max_rows = max_rows  # rows a step may have and still replay a captured graph
        self.page_size = memory.page_size
        self.verify_steps = 0
        self.drafted_tokens = 0
        self.accepted_tokens = 0
        self.verify_runs = 0  # drafting requests, summed over verify steps
        self.draft_seconds = 0.0  # host time spent drafting, over
        self.drafting_rows = 0  # the decoding requests it drafted for (summed over steps)
        self.rule = SpecRule(max_batch, waits)  # whether a step speculates

    def wants(self, decoding: int) -> bool:
        """Whether this step may verify drafts: room in the largest captured graph for a draft
        token beside every decoding request, and the rule's say."""
        return decoding < self.max_rows and self.rule.wants(decoding)

    @staticmethod
    def eligible(req: Req) -> bool:
        return req.matcher is None and req.think is None and not req.params.has_penalty and req.capture_start < 0

    def schedule(
        self, decoding: list[Req], retract_newest: Callable[[], None], step: int
    ) -> tuple[ForwardBatch, list[Req], Drafts, list[tuple[Req, int]]] | None:
        """Verify step ``step`` (None: no request has a draft, or no pages for them): its batch,
        the request of each row, each drafting request with its draft, and the (request,
        position) of the plain rows whose routed experts or hidden states come back."""
        start = time.perf_counter()
        drafts: Drafts = []
        spare_rows = self.max_rows - len(decoding)  # a step past the largest captured graph runs eagerly
        tried = 0  # requests that looked for a draft
        for req in decoding:
            # A verify step of it in flight: its draft is taken as kept, if the tokens it was
            # drafted after are known to be right (else a plain row while it comes back).
            pending = req.verify_draft
            if (pending and not req.verify_chain and not self.late) or resting(req):
                continue
            late = req.kv_len + 1 - req.num_tokens - len(pending)  # 1: its last token is in flight
            if late not in (0, 1):  # (defensive: decoding requests are at most one token behind)
                continue
            # Room for the draft and the token after it, within its budget and context (and a
            # whole page before its run, which a cascade group reads), and the step's spare rows.
            outputs = len(req.output_ids) + len(pending) + late
            room = min(self.k, req.max_outputs - outputs - 1, req.max_len - req.kv_len - 2, spare_rows)
            if room > 0 and self.eligible(req) and req.kv_len >= self.page_size:
                tried += 1
                draft = self.drafter.draft(req, room + late, pending)[late:]
                if draft:
                    drafts.append((req, draft))
                    spare_rows -= len(draft)
        self.draft_seconds += time.perf_counter() - start
        self.drafting_rows += len(decoding)
        if not drafts:
            # (no pause when every request waits for its verify step, which drafts again next)
            self.rule.no_drafts(len(decoding), tried > 0)
            return None
        drafting = {id(r) for r, _ in drafts}
        plain = [r for r in decoding if id(r) not in drafting]

        def retract() -> None:
            retract_newest()
            plain[:] = [r for r in plain if r.slot is not None]

        # The plain rows first: a retraction there may take a drafting request back to the queue.
        decode = self.decode.schedule(plain, retract) if plain else None
        drafts = [(r, d) for r, d in drafts if r.slot is not None]
        need = [cdiv(r.kv_len + 1 + len(d), self.page_size) - len(r.pages) for r, d in drafts]
        pages = self.memory.alloc(sum(need)) if drafts else None
        if pages is None:  # (out of pages: the drafting requests wait a step)
            drafts = []
            if decode is None:
                return None
        batch = ForwardBatch(slots=[], cached_lens=[], new_lens=[], input_ids=[], sample=[])
        rows: list[Req] = []
        for (req, draft), n in zip(drafts, need):
            # Its run starts where its tokens end, a draft in flight taken as kept: the worker
            # moves it back by the rows that draft's run rejected (at most the whole draft).
            unsure = len(req.verify_draft)
            here = unsure == 0 and req.num_tokens > req.kv_len  # its last token is on the host
            req.pages += pages[:n]
            pages = pages[n:]
            req.kv_len += 1 + len(draft)
            req.verify_step, req.verify_draft = step, draft
            req.verify_chain = True  # (until the run it was drafted after turns out cut short)
            n, start = 1 + len(draft), req.kv_len - 1 - len(draft)
            if unsure:
                batch.resolve_rows += range(len(batch.slots), len(batch.slots) + n)
            batch.slots += [req.slot] * n
            batch.cached_lens += range(start, start + n)
            batch.new_lens += [1] * n
            if self.late:  # (its draft is made again once the steps before are back)
                batch.draft_rows += range(len(batch.slots) - n + 1, len(batch.slots))
            batch.input_ids += [tokens_at(req, [], start, start + 1)[0] if here else -1, *draft]
            batch.sample += [True] * n
            batch.verify_sizes.append(n)
            if self.decode.cascade:  # its rows read the pages before its draft once, as a group
                batch.group_sizes.append(n)
                batch.group_pages.append((start - unsure + 1) // self.page_size)  # (at its shortest)
            write_table(batch, req)
            rows += [req] * n
        routed: list[tuple[Req, int]] = []
        if decode is not None:
            routed = self.decode.routed(decode)
            append_rows(batch, decode)
            # The plain rows' groups follow (within the step's cap; the rest read as loose rows).
            room = MAX_CASCADE_GROUPS - len(batch.group_sizes)
            batch.group_sizes += decode.group_sizes[:room]
            batch.group_pages += decode.group_pages[:room]
            rows += self.decode.order.reqs
        self.verify_steps += bool(drafts)
        self.verify_runs += len(drafts)
        self.drafted_tokens += sum(len(d) for _, d in drafts)
        return batch, rows, drafts, routed

    def redraft(self, drafts: Drafts, step: int) -> list[int]:
        """The draft tokens of verify step ``step`` (``ForwardBatch.draft_rows``), made once every
        step before it is processed: each run of a request still verifying in it drafts again from
        all its tokens, keeping its length (a shorter draft ends with the planned one's tokens).
        ``drafts`` is updated in place (what ``accept`` compares with)."""
        start = time.perf_counter()
        ids: list[int] = []
        for i, (req, draft) in enumerate(drafts):
            if req.verify_step == step and not req.finished:
                found = self.drafter.draft(req, len(draft))
                draft = found + draft[len(found) :]
                req.verify_draft, drafts[i] = draft, (req, draft)
            ids += draft
        self.draft_seconds += time.perf_counter() - start
        return ids

    def accept(self, rows: list[Req], drafts: Drafts, out: StepOutput, step: int) -> list[Req]:
        """Keep each drafting request's accepted rows of verify step ``step``'s ``out`` (edited
        in place): the draft tokens its samples matched and the sample after them, cut at its
        stop token (its length cannot pass: ``schedule`` left room for the whole draft and one
        more). Gives back the pages of the rejected positions (of a request that still holds the
        slot it verified in); returns the request of each kept row."""
        keep: list[int] = []
        at = step_accepted = 0
        for req, draft in drafts:
            tokens = out.tokens[at : at + len(draft) + 1]
            accepted = 0
            while accepted < len(draft) and tokens[accepted] == draft[accepted]:
                accepted += 1
            take = accepted + 1
            for j, token in enumerate(tokens[:take]):  # what the stop checks will keep
                if token in req.stop_ids:
                    take = j + 1
                    break
            keep += range(at, at + take)
            at += len(draft) + 1
            req.spec_drafted += len(draft)
            req.spec_accepted += take - 1
            self.accepted_tokens += accepted
            step_accepted += accepted
            count_run(req, accepted > 0)
            if req.verify_step >= 0:  # (not aborted or retracted while the step ran)
                if req.verify_step == step:
                    req.verify_step, req.verify_draft = -1, []
                elif accepted < len(draft):  # the run in flight was drafted after this whole draft
                    req.verify_chain = False
                req.kv_len -= len(draft) + 1 - take
                spare = req.pages[cdiv(req.kv_len, self.page_size) :]
                if spare:
                    del req.pages[len(req.pages) - len(spare) :]
                    req.table_len = min(req.table_len, len(req.pages))
                    self.memory.allocator.free(spare)
        decoding = len(drafts) + len(out.tokens) - at  # (each plain row is a request)
        self.rule.verified(decoding, 1 + step_accepted / decoding)
        keep += range(at, len(out.tokens))
        for name in ("tokens", "logprobs", "entropy", "top_ids", "top_logprobs", "id_logprobs"):
            values = getattr(out, name)
            if values is not None:
                setattr(out, name, [values[i] for i in keep])
        return [rows[i] for i in keep]

    def stats(self) -> dict[str, float]:
        return {
            "spec_verify_steps": self.verify_steps,
            "spec_draft_tokens": self.drafted_tokens,
            "spec_accepted_tokens": self.accepted_tokens,
            "spec_accept_rate": self.accepted_tokens / max(self.drafted_tokens, 1),
            # SGLang's accept length: tokens a drafting request gains per verify step
            "spec_accept_length": 1 + self.accepted_tokens / max(self.verify_runs, 1),
            "spec_draft_us_per_request": 1e6 * self.draft_seconds / max(self.drafting_rows, 1),
            # what the rule weighs: tokens a verify step gives per decoding request (moving average)
            "spec_step_gain": self.rule.gain,
        }
