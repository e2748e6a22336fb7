"""How well drafting from the radix tree would do, replayed over recorded samples: acceptance
and decode steps per drafting policy, without running the model again.

    python benchmarks/spec_replay.py record --model SmolLM2-135M-Instruct.Q4_1.gguf --workload code --out code.json
    python benchmarks/spec_replay.py replay code.json

``record`` runs ``spec_bench.py``'s workload once without speculation (seeded samples) and
keeps every prompt and output. Seeded outputs are the same with speculation on (the verify
step samples each position as a plain step would), so a draft token is accepted exactly when
it equals the recorded token there: ``replay`` steps every request in lockstep through the
real ``Drafter`` and ``NgramIndex`` (a finished request's tokens enter a real radix tree, as
release does), and counts decode steps, verify steps and accepted tokens per policy. The
time estimate takes a verify step to cost ``--verify-cost`` plain steps (measured by
``spec_cost.py``: ~1.2 on the 8B shape at batch <= 16, ~2 for SmolLM2's host-bound steps);
``--sit-out`` also replays keeping overlap scheduling by letting a request that verified sit
out the next step. ``--overlap`` replays the engine's verify steps as they run under overlap
scheduling: planned while the step before is in flight, so a draft is made without the tokens
that step brings (its first token standing in for the one in flight) and after a draft still
being verified (taken as kept); every step costs a plain one, except that a step with rows
whose length the worker finds waits for the step before (``--verify-cost`` prices those).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minisgl.config.args import EngineArgs
from minisgl.serve.cache.ngram_index import NgramIndex
from minisgl.serve.cache.radix_manager import RadixCacheManager
from minisgl.serve.scheduler import spec_rule, speculative
from minisgl.serve.scheduler.request import Req
from minisgl.wire.sampling import SamplingParams


def record(args: argparse.Namespace) -> None:
    from benchmarks.spec_bench import run, setup

    llm, prompts, params = setup(args, None)
    reqs, result = run(llm, prompts, params)
    print(f"recorded {len(reqs)} samples, mean length {result['mean_output_len']:.1f}, {result['seconds']:.1f} s")
    # (each distinct prompt once: the samples of one prompt follow each other)
    distinct = prompts[:: args.samples]
    data = {"args": vars(args), "prompts": distinct, "samples": args.samples, "outputs": [r.output_ids for r in reqs]}
    Path(args.out).write_text(json.dumps(data))


@dataclass
class Replayed:
    steps: int = 0
    verify_steps: int = 0
    plain_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    runs: int = 0  # drafting requests summed over verify steps
    p90_step: int = 0
    resolve_steps: int = 0  # (overlap) steps with rows whose length the worker finds
    finished: int = 0  # requests done so far


class TreeDrafts:
    """The engine's drafting: ``Drafter`` over each request's own tokens and a real radix tree
    (with its ``NgramIndex``) that a finished request's computed tokens enter, as release does."""

    def __init__(self) -> None:
        self.page = EngineArgs.page_size
        self.cache = RadixCacheManager(page_size=self.page)
        self.cache.ngrams = NgramIndex(
            EngineArgs.speculative_ngram_min_match_window_size,
            EngineArgs.speculative_ngram_max_match_window_size,
            EngineArgs.speculative_ngram_capacity,
        )
        self.drafter = speculative.Drafter(self.cache.ngrams, self.cache.ngrams.min_n, self.cache.ngrams.max_n)
        self.next_page = 0

    def cached(self, ids: list[int], live: bool = False) -> None:
        n = len(ids) // self.page
        self.cache.insert_prefix(ids, list(range(self.next_page, self.next_page + n)))
        self.next_page += n

    def advanced(self, req: Req) -> None:
        pass

    def draft(self, req: Req, room: int, pending: list[int] = ()) -> list[int]:
        return self.drafter.draft(req, room, pending)


class CountedDrafts:
    """An n-gram model of every token seen (cached paths; with ``live``, running requests' tokens
    too, their own included): each draft token is the most frequent continuation of the longest
    context found, the draft growing one token at a time (Python dicts: acceptance only)."""

    def __init__(self, live: bool, min_n: int = 2, max_n: int = 6) -> None:
        self.live, self.min_n, self.max_n = live, min_n, max_n
        self.counts: dict[tuple[int, ...], dict[int, int]] = {}
        self.seen: dict[int, int] = {}  # request -> tokens counted so far

    def _count(self, ids: list[int], start: int) -> None:
        for end in range(max(start, 1), len(ids)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                nxt = self.counts.setdefault(tuple(ids[end - n : end]), {})
                nxt[ids[end]] = nxt.get(ids[end], 0) + 1

    def cached(self, ids: list[int], live: bool = False) -> None:
        if not (self.live and live):  # (a live request's tokens were counted as they came)
            self._count(ids, 0)

    def advanced(self, req: Req) -> None:
        if self.live:
            ids = req.all_ids
            self._count(ids, self.seen.get(req.rid, 0))
            self.seen[req.rid] = len(ids)

    def draft(self, req: Req, room: int) -> list[int]:
        ctx = req.all_ids[-self.max_n :]
        out: list[int] = []
        while len(out) < room:
            for n in range(min(self.max_n, len(ctx)), self.min_n - 1, -1):
                nxt = self.counts.get(tuple(ctx[-n:]))
                if nxt:
                    best = max(nxt, key=nxt.__getitem__)
                    out.append(best)
                    ctx = ctx[1:] + [best]
                    break
            else:
                break
        return out


POLICIES = {
    "tree": TreeDrafts,
    "counted": lambda: CountedDrafts(live=False),
    "counted-live": lambda: CountedDrafts(live=True),
}


def _requests(prompts: list[list[int]], outputs: list[list[int]], source: TreeDrafts | CountedDrafts) -> list[Req]:
    """A request per recorded sample, its prompt in the drafts' tree (served before)."""
    for p in {tuple(p) for p in prompts}:
        source.cached(list(p))
    reqs = []
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        req = Req(i, prompt, SamplingParams(max_new_tokens=len(out)), 0, 1 << 20)
        req.max_outputs = len(out)
        reqs.append(req)
    return reqs


def _retire(
    running: list[Req], done: dict[int, bool], source: TreeDrafts | CountedDrafts, r: Replayed, total: int
) -> list[Req]:
    """The requests still running; those ``done`` enter the tree as release caches them (all
    but the last token), and the step at which 90% of ``total`` are done is noted."""
    still = []
    for req in running:
        if done[req.rid]:
            source.cached(req.all_ids[:-1], live=True)
            r.finished += 1
            if r.finished >= 0.9 * total and not r.p90_step:
                r.p90_step = r.steps
        else:
            still.append(req)
    return still


def replay_once(
    prompts: list[list[int]],
    outputs: list[list[int]],
    k: int,
    max_batch: int,
    source: TreeDrafts | CountedDrafts,
    sit_out: bool = False,
) -> Replayed:
    """All requests decode from step 0 (their prompts cached), lockstep, with the engine's
    rules: verify steps while at most ``max_batch`` decode, the per-request pause after misses,
    the plain steps after a step that found no draft. ``sit_out``: instead of a verify step
    waiting for the steps in flight, a request that verified sits out the step after it (whose
    start cannot know how many tokens it kept), so every step keeps overlap scheduling."""
    reqs = _requests(prompts, outputs, source)
    for req, out in zip(reqs, outputs):
        req.output_ids = [out[0]]  # the prefill samples the first token
    r = Replayed()
    idle = 0
    running = [req for req in reqs if len(req.output_ids) < req.max_outputs]
    r.finished = len(reqs) - len(running)
    resting: set[int] = set()  # (sit_out) requests that verified in the step before
    while running:
        r.steps += 1
        drafts: dict[int, list[int]] = {}
        speculate = idle == 0 and len(running) <= max_batch
        idle = max(idle - 1, 0)
        active = [req for req in running if req.rid not in resting]
        if speculate:
            for req in active:
                if speculative.resting(req):
                    continue
                room = min(k, req.max_outputs - len(req.output_ids) - 1)
                if room > 0:
                    draft = source.draft(req, room)
                    if draft:
                        drafts[req.rid] = draft
            if not drafts:
                idle = spec_rule.IDLE_AFTER_NO_DRAFT
        r.verify_steps += bool(drafts)
        r.plain_steps += not drafts
        resting = set(drafts) if sit_out else set()
        for req in active:
            truth = outputs[req.rid]
            at = len(req.output_ids)
            draft = drafts.get(req.rid, [])
            accepted = 0
            while accepted < len(draft) and truth[at + accepted] == draft[accepted]:
                accepted += 1
            if draft:
                r.drafted += len(draft)
                r.accepted += accepted
                r.runs += 1
                speculative.count_run(req, accepted > 0)
            req.output_ids = truth[: at + accepted + 1]
            source.advanced(req)
        running = _retire(running, {q.rid: len(q.output_ids) >= q.max_outputs for q in running}, source, r, len(reqs))
    return r


def replay_overlap(prompts: list[list[int]], outputs: list[list[int]], k: int, max_batch: int) -> Replayed:
    """The engine's drafts (``TreeDrafts``) under overlap scheduling, lockstep: when a step is
    planned the host knows each request's tokens up to the step in flight. A request whose step
    in flight is a plain row (or its prefill) drafts ``k + 1`` tokens after what it knows and
    drops the first (standing in for the token in flight); one whose verify run is in flight
    drafts after that run's draft taken as kept (and a stand-in for the token after it) if that
    draft was made after right tokens, else takes a plain row. The device has the true tokens:
    a draft is kept as far as it equals the recorded continuation at the request's real length."""
    source = TreeDrafts()
    reqs = _requests(prompts, outputs, source)
    # Per request, its step in flight: its draft (empty: a plain row or the prefill), its real
    # output length before it, how much of the draft the device kept, and whether the draft was
    # made after right tokens.
    flight = {req.rid: ([], 0, 0, True) for req in reqs}
    real = {req.rid: 1 for req in reqs}  # outputs on the device (the prefill samples one)
    r = Replayed()
    idle = 0
    running = [req for req in reqs if req.max_outputs > 1]
    r.finished = len(reqs) - len(running)
    while running:
        r.steps += 1
        speculate = idle == 0 and len(running) <= max_batch
        idle = max(idle - 1, 0)
        r.resolve_steps += any(flight[req.rid][0] for req in running)
        launched, tried = {}, 0
        for req in running:
            pending, before, _, right = flight[req.rid]
            req.output_ids = outputs[req.rid][:before]  # what the host knows
            draft: list[int] = []
            if speculate and (right or not pending) and not speculative.resting(req):
                room = min(k, req.max_outputs - before - len(pending) - 2)
                if room > 0:
                    tried += 1
                    draft = source.draft(req, room + 1, pending)[1:]
            truth, at = outputs[req.rid], real[req.rid]
            kept = 0
            while kept < len(draft) and at + kept < len(truth) and truth[at + kept] == draft[kept]:
                kept += 1
            # Made after right tokens: after known ones, or after a whole draft the device kept.
            made_right = not pending or (right and flight[req.rid][2] == len(pending))
            launched[req.rid] = (draft, at, kept, made_right)
            real[req.rid] = min(at + kept + 1, len(truth))
            if draft:
                r.drafted += len(draft)
                r.accepted += kept
                r.runs += 1
                speculative.count_run(req, kept > 0)
        if speculate and tried and not any(d for d, *_ in launched.values()):
            idle = spec_rule.IDLE_AFTER_NO_DRAFT
        verifying = any(d for d, *_ in launched.values())
        r.verify_steps += verifying
        r.plain_steps += not verifying
        flight.update(launched)
        done = {q.rid: real[q.rid] >= q.max_outputs for q in running}
        for req in running:
            if done[req.rid]:
                req.output_ids = outputs[req.rid][: req.max_outputs]
        running = _retire(running, done, source, r, len(reqs))
    return r


def replay(args: argparse.Namespace) -> None:
    data = json.loads(Path(args.recorded).read_text())
    samples = data["samples"]
    prompts = [p for p in data["prompts"] for _ in range(samples)]
    outputs = data["outputs"]
    base = max(len(o) for o in outputs)
    print(
        f"{len(outputs)} samples, mean length {sum(map(len, outputs)) / len(outputs):.1f}, "
        f"longest {base}: {base - 1} decode steps without speculation"
    )
    rows = []
    modes = ["waiting"] + ["sit-out"] * args.sit_out
    runs = [(p, k, b, m) for p in args.policies for k in args.num_draft_tokens for b in args.max_batch for m in modes]
    if args.overlap:
        runs += [("tree", k, b, "overlap") for k in args.num_draft_tokens for b in args.max_batch]
    for policy, k, max_batch, mode in runs:
        if mode == "overlap":
            r = replay_overlap(prompts, outputs, k, max_batch)
        else:
            r = replay_once(prompts, outputs, k, max_batch, POLICIES[policy](), mode == "sit-out")
        row = {
            "policy": policy + ("" if mode == "waiting" else f" {mode}"),
            "k": k,
            "max_batch": max_batch,
            **vars(r),
            "accept_length": 1 + r.accepted / max(r.runs, 1),
            "fewer_steps": (base - 1) / r.steps,
        }
        for c in args.verify_cost:
            cost = {  # sitting out keeps every step overlapped; under overlap a step that resolves waits
                "waiting": r.plain_steps + c * r.verify_steps,
                "sit-out": r.steps,
                "overlap": r.steps + (c - 1) * r.resolve_steps,
            }[mode]
            row[f"speedup_at_cost_{c}"] = (base - 1) / cost
        rows.append(row)
        costs = "  ".join(f"x{row[f'speedup_at_cost_{c}']:.2f} at cost {c}" for c in args.verify_cost)
        print(
            f"{row['policy']} k={k} max batch {max_batch}: {r.steps} steps ({row['fewer_steps']:.2f}x fewer; "
            f"{r.verify_steps} verify), "
            f"accept length {row['accept_length']:.2f}, accepted {r.accepted}/{r.drafted}; last 10% of samples "
            f"{r.steps - r.p90_step} steps; {costs}"
        )
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": rows}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("--model", required=True)
    rec.add_argument("--workload", default="repeated")
    rec.add_argument("--prompts", type=int, default=8)
    rec.add_argument("--samples", type=int, default=64)
    rec.add_argument("--max-new-tokens", type=int, default=1024)
    rec.add_argument("--temperature", type=float, default=0.8)
    rec.add_argument("--device", default=None)
    rec.add_argument("--dtype", default="auto")
    rec.add_argument("--seed", type=int, default=0)
    rec.add_argument("--max-running-requests", type=int, default=None, help="default: every sample at once")
    rec.add_argument("--out", required=True)
    rep = sub.add_parser("replay")
    rep.add_argument("recorded")
    rep.add_argument("--num-draft-tokens", type=int, nargs="+", default=[2, 4, 8])
    rep.add_argument("--policies", nargs="+", choices=list(POLICIES), default=list(POLICIES))
    rep.add_argument("--max-batch", type=int, nargs="+", default=[EngineArgs.speculative_disable_by_batch_size])
    rep.add_argument("--verify-cost", type=float, nargs="+", default=[1.2, 2.0])
    rep.add_argument(
        "--sit-out", action="store_true", help="also replay each with verified requests sitting out a step"
    )
    rep.add_argument(
        "--overlap",
        action="store_true",
        help="also replay the engine's drafts under overlap scheduling (--verify-cost then prices a "
        "step that waits for the one before)",
    )
    rep.add_argument("--out", default=None)
    args = ap.parse_args()
    record(args) if args.command == "record" else replay(args)


if __name__ == "__main__":
    main()
