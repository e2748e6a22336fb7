"""A step's output applied to its requests: tokens, logprobs, prompt scores, grammar matchers
and finish reasons. Requests without logprobs or a grammar take a short path (an append and a
stop check), since at thousands of running requests this runs for each of them every step."""

from __future__ import annotations

from collections.abc import Callable

from minisgl.serve.scheduler.request import PromptScore, Req
from minisgl.serve.scheduler.think_budget import grammar_on
from minisgl.wire.steps import StepOutput


def prompt_scores(req: Req) -> tuple[int, list[PromptScore]]:
    """Hand over a request's prompt logprobs once (with its first output token): the first
    position scored (position 0 has nothing before it) and each position's score."""
    first = max(req.logprob_start, 1)
    req.prompt_scores_sent = True
    return first, [req.prompt_scores[j] for j in range(first, len(req.prompt_ids))]


def record_captures(captured: list[tuple[Req, int]], out: StepOutput) -> None:
    """Give each (request, position) its row of the step's routed experts and hidden states; a
    position already recorded (recomputed after a retraction) keeps its first record."""
    experts, hidden = out.routed_experts, out.hidden_states
    e, h = len(experts) // len(captured), len(hidden) // len(captured)
    for i, (req, pos) in enumerate(captured):
        if pos == req.captured_until:
            req.captures.append((experts[i * e : (i + 1) * e], hidden[i * h : (i + 1) * h]))


def record_scores(scored: list[tuple[Req, int]], score_ids: list[int], out: StepOutput) -> None:
    """Prompt positions' logprobs (``scored``: request and position of each score row)."""
    column = {t: c for c, t in enumerate(score_ids)}
    for k, (req, j) in enumerate(scored):
        top = list(zip(out.score_top_ids[k], out.score_top_logprobs[k])) if out.score_top_ids else []
        wanted = req.options.logprob_ids
        ids = [out.score_id_logprobs[k][column[t]] for t in wanted] if wanted else []
        req.prompt_scores[j] = (out.score_logprobs[k], top[: max(req.options.top_logprobs, 0)], ids)


def record_logprobs(req: Req, out: StepOutput, i: int) -> None:
    """Row ``i``'s logprobs, top logprobs, asked-for ids' logprobs and entropy, as ``req`` asked."""
    if out.logprobs is not None:
        req.output_logprobs.append(out.logprobs[i])
    if req.options.entropy:
        req.output_entropy.append(out.entropy[i])
    if out.top_ids is not None:
        req.output_top_logprobs.append(list(zip(out.top_ids[i], out.top_logprobs[i])))
    if req.options.logprob_ids:
        req.output_id_logprobs.append(out.id_logprobs[i])


def apply_output(
    sampled: list[Req],
    scored: list[tuple[Req, int]],
    score_ids: list[int],
    out: StepOutput,
    finish: Callable[[Req, str], None],
) -> list[Req]:
    """Record the step's results (``sampled``: the requests of its token rows); ``finish`` ends
    a request. Returns the requests that got a token (or, scoring only, finished)."""
    if scored:
        record_scores(scored, score_ids, out)
    got = []
    for i, (req, token) in enumerate(zip(sampled, out.tokens)):
        if req.finish_reason is not None:  # finished while this batch was in flight: drop the extra token
            continue
        got.append(req)
        if req.plain:
            outputs = req.output_ids
            outputs.append(token)
            if token in req.stop_ids:
                finish(req, "stop")
            elif len(outputs) >= req.max_outputs:
                finish(req, "length")
            continue
        if req.params.max_new_tokens == 0:  # it only scored its prompt
            finish(req, "length")
            continue
        req.output_ids.append(token)
        constrained = req.matcher is not None and grammar_on(req)  # (the close marker itself is free)
        if req.think is not None:
            req.think.accept(token)
        record_logprobs(req, out, i)
        reason = "stop" if token in req.stop_ids else "length" if len(req.output_ids) >= req.max_outputs else None
        if constrained:
            if not req.matcher.accept_token(token):  # sampled under its mask, so never expected
                kind = req.params.grammar[0] if req.params.grammar else "grammar"
                req.error = (
                    f"{kind}: the grammar rejected sampled token {token} after {len(req.output_ids) - 1} "
                    f"tokens; the output cannot follow it"
                )
                finish(req, "abort")
                continue
            if reason is None and req.matcher.is_terminated():
                reason = "stop"  # the grammar is complete (its last token was a stop token)
        if reason is not None:
            finish(req, reason)
    return got
