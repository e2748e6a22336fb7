"""The ForwardBatch message of a prefill step: new tokens, page-table writes, first-time
sampling settings, and the prompt positions whose logprobs (or routed experts) come back."""

from __future__ import annotations

import msgspec

from minisgl.serve.scheduler.prefill import Entry
from minisgl.serve.scheduler.request import Req
from minisgl.serve.scheduler.think_budget import near_budget
from minisgl.wire.steps import ForwardBatch, NewRequest


def prefill_batch(
    entries: list[Entry], eos_ids: set[int]
) -> tuple[ForwardBatch, list[tuple[Req, int]], list[tuple[Req, int]]]:
    """The step's batch, the (request, prompt position) of each row it scores, and those of
    each row whose experts come back."""
    batch = ForwardBatch(slots=[], cached_lens=[], new_lens=[], input_ids=[], sample=[])
    scored: list[tuple[Req, int]] = []
    routed: list[tuple[Req, int]] = []
    row = 0
    for req, new, sample in entries:
        start = req.kv_len - new
        if req.scores_prompt:
            # Row start + k holds the hidden state of position start + k, which predicts
            # position start + k + 1: the chunk scores positions start + 1 .. kv_len.
            for j in range(max(start + 1, req.logprob_start, 1), min(req.kv_len, len(req.prompt_ids) - 1) + 1):
                batch.score_rows.append(row + j - 1 - start)
                batch.score_ids.append(req.prompt_ids[j])
                scored.append((req, j))
            batch.score_top = max(batch.score_top, req.options.top_logprobs)
            if req.options.logprob_ids:
                batch.score_logprob_ids = sorted(set(batch.score_logprob_ids) | set(req.options.logprob_ids))
        if req.capture_start >= 0 and req.kv_len > req.capture_start:
            first = max(start, req.capture_start)
            batch.route_rows += range(row + first - start, row + new)
            routed += [(req, pos) for pos in range(first, req.kv_len)]
        row += new
        batch.slots.append(req.slot)
        batch.cached_lens.append(start)
        batch.new_lens.append(new)
        if sample and (req.matcher is not None or near_budget(req)):
            batch.mask_rows.append(sum(batch.sample))
        batch.sample.append(sample)
        batch.input_ids += req.all_ids[start : req.kv_len]
        if req.table_len == 0:
            batch.new_requests.append(new_request(req, eos_ids))
        if req.state_load >= 0 or req.state_save >= 0 or req.state_split[0] >= 0:
            states(batch, req)
        write_table(batch, req)
    return batch, scored, routed


def states(batch: ForwardBatch, req: Req) -> None:
    """A hybrid model's state copies for the request's chunk: its snapshot in before, the
    state part-way through the chunk and the state after it out to new snapshots."""
    if req.state_load >= 0:
        batch.state_loads += (req.state_load, req.slot)
    if req.state_save >= 0:
        batch.state_saves += (req.slot, req.state_save)
    if req.state_split[0] >= 0:
        batch.state_splits += (req.slot, *req.state_split)
    req.state_load = req.state_save = -1
    req.state_split = (-1, 0)


def mixed_batch(prefill: ForwardBatch, decode: ForwardBatch) -> ForwardBatch:
    """One step of both (--enable-mixed-chunk): the prefill chunk's rows, then the decode step's
    one row per request, which keep their cascade groups (the worker attends to each part apart)."""
    prefill.prefill_reqs = len(prefill.slots)
    prefill.group_sizes, prefill.group_pages = decode.group_sizes, decode.group_pages
    append_rows(prefill, decode)
    return prefill


def append_rows(batch: ForwardBatch, more: ForwardBatch) -> None:
    """``more``'s rows after ``batch``'s: its tokens, page-table writes, and constrained, routed
    and resolved rows (renumbered). Cascade groups are the caller's to join."""
    tokens, sampled, rows = len(batch.input_ids), sum(batch.sample), len(batch.slots)
    batch.slots += more.slots
    batch.cached_lens += more.cached_lens
    batch.new_lens += more.new_lens
    batch.input_ids += more.input_ids
    batch.sample += more.sample
    batch.table_slots += more.table_slots
    batch.table_cols += more.table_cols
    batch.table_pages += more.table_pages
    batch.mask_rows += [sampled + i for i in more.mask_rows]
    batch.route_rows += [tokens + i for i in more.route_rows]
    batch.resolve_rows += [rows + i for i in more.resolve_rows]


def write_table(batch: ForwardBatch, req: Req) -> None:
    """Add the request's pages not yet in the worker's page table to the batch's writes (list
    operations in C: a request's first chunk writes its whole prompt's pages, 8192 tokens' worth
    per step, a quarter of a prefill step's host time as a Python loop)."""
    first, end = req.table_len, len(req.pages)
    if end > first:
        batch.table_slots += [req.slot] * (end - first)
        batch.table_cols += range(first, end)
        batch.table_pages += req.pages[first:]
    req.table_len = end


def new_request(req: Req, eos_ids: set[int]) -> NewRequest:
    """A request's sampling settings for the worker, sent with its first chunk."""
    p = req.params
    penalties = p.has_penalty
    # min_new_tokens: the tokens that would end it are banned until it has that many.
    ban = sorted(set(p.stop_token_ids or []) | (set() if p.ignore_eos else eos_ids)) if p.min_new_tokens else []
    return NewRequest(
        slot=req.slot,
        sampling=p,
        seed=req.seed,
        # (a predicted output only drafts, in the scheduler)
        options=msgspec.structs.replace(req.options, prediction_ids=[]) if req.options.prediction_ids else req.options,
        prompt_ids=req.prompt_ids if penalties else [],
        output_ids=req.output_ids if penalties else [],
        prompt_len=len(req.prompt_ids),
        ban_ids=ban,
        lora_slot=req.lora_slot,
    )
