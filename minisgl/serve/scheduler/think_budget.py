"""Thinking budgets (SGLang's ``max_thinking_tokens``): a reasoning model thinks for at most that
many tokens, then its end-of-thinking marker is forced, token by token, and it answers. With
SGLang's ``require_reasoning`` the output starts in the thinking and a grammar constrains only the
tokens after its close marker (``grammar_on``).

The thinking opens at the start of the output when the prompt left it open (the template wrote
the open marker last, or the reasoning parser says the model always starts there), else when the
model writes the open marker. Forcing goes through the constrained-sampling path: the step's row
is a masked row whose mask allows one token. A row is masked only from shortly before the budget
runs out (``near``), so a budgeted request keeps the batch overlapped the rest of the time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from minisgl.wire.options import RequestOptions


class ThinkBudget:
    """One request's thinking: whether it is open, its tokens so far, and the marker's progress."""

    def __init__(self, budget: int, open_ids: list[int], close_ids: list[int], open_at_start: bool, done: bool = False):
        self.budget = budget if budget >= 0 else NO_BUDGET
        self.open_ids, self.close_ids = open_ids, close_ids
        self.thinking = open_at_start and not done
        self.done = done  # the marker closed it (thinking happens once)
        self.used = 0  # tokens inside the thinking so far
        self.recent: list[int] = []  # the last tokens, enough to see either marker end

    @classmethod
    def of(cls, prompt: list[int], opts: RequestOptions) -> ThinkBudget:
        """A request's thinking (its RequestOptions): open at the start when the prompt left it
        open, the model always starts there, or require_reasoning says it thinks first; with
        require_reasoning a prompt that already closed it (a template that turned thinking off)
        has done its thinking."""
        open_ids, close_ids = opts.think_markers
        thinks_first = opts.think_open or opts.require_reasoning or cls.open_in(prompt, open_ids, close_ids)
        done = opts.require_reasoning and cls.closed_in(prompt, open_ids, close_ids)
        return cls(opts.think_budget, open_ids, close_ids, thinks_first, done)

    @staticmethod
    def open_in(prompt: list[int], open_ids: list[int], close_ids: list[int]) -> bool:
        """Whether the prompt's last open marker comes after its last close marker."""
        return _last(prompt, open_ids) > _last(prompt, close_ids)

    @staticmethod
    def closed_in(prompt: list[int], open_ids: list[int], close_ids: list[int]) -> bool:
        """Whether the prompt already holds a whole thinking section (a template that turned the
        thinking off writes an empty one)."""
        return _last(prompt, close_ids) > _last(prompt, open_ids) >= 0

    def accept(self, token: int) -> None:
        width = max(len(self.open_ids), len(self.close_ids))
        self.recent = (self.recent + [token])[-width:]
        if self.done:
            return
        if not self.thinking:
            if _ends_with(self.recent, self.open_ids):
                self.thinking = True
            return
        if _ends_with(self.recent, self.close_ids):
            self.thinking, self.done = False, True
        else:
            self.used += 1

    def forced(self) -> int | None:
        """The token the next step must take (the marker's next one once the budget is spent),
        None when it is free."""
        if not self.thinking or self.used < self.budget:
            return None
        for k in range(min(len(self.close_ids) - 1, len(self.recent)), 0, -1):  # a marker begun
            if self.recent[-k:] == self.close_ids[:k]:
                return self.close_ids[k]
        return self.close_ids[0]

    def near(self, ahead: int) -> bool:
        """Whether the budget may run out within ``ahead`` more tokens (those already launched):
        from then on its rows are masked, the mask deciding once the tokens before are known."""
        return self.thinking and self.used + ahead >= self.budget


NO_BUDGET = 1 << 62  # (require_reasoning alone: the thinking is followed, never cut)


def grammar_on(req: Any) -> bool:
    """Whether a request's grammar constrains its next token: at once, or with require_reasoning
    (``think`` set beside a grammar) once its thinking has closed."""
    return req.think is None or req.think.done


# Tokens of a request that may be launched but not yet seen when a step is built (overlap keeps
# one step in flight; one more for margin).
LOOKAHEAD = 2


def near_budget(req: Any) -> bool:
    """Whether a request's next sampled row must be masked for its thinking budget."""
    return req.think is not None and req.think.near(LOOKAHEAD)


def _ends_with(tokens: list[int], marker: list[int]) -> bool:
    return bool(marker) and tokens[-len(marker) :] == marker


def _last(tokens: list[int], marker: list[int]) -> int:
    """The index after the last occurrence of ``marker`` in ``tokens`` (-1: none)."""
    n = len(marker)
    for end in range(len(tokens), n - 1, -1):
        if tokens[end - n : end] == marker:
            return end
    return -1


def masks(rows: list[tuple[Any, bool, ThinkBudget | None]], grammar: Any, vocab_size: int) -> bytes:
    """Allowed tokens of each masked row, as int32 words (bit t % 32 of word t // 32): a
    grammar's (a matcher, is_json) through ``grammar``, or one forced token of a thinking budget;
    a row with neither allows everything."""
    if any(m is not None for m, _, _ in rows):
        words = np.frombuffer(bytearray(grammar.bitmask([(m, j) for m, j, _ in rows])), dtype=np.int32)
        words = words.reshape(len(rows), -1)
    else:
        words = np.full((len(rows), (vocab_size + 31) // 32), -1, dtype=np.int32)
    for i, (_, _, think) in enumerate(rows):
        token = think.forced() if think is not None else None
        if token is not None:
            words[i] = 0
            words[i, token // 32] = np.int32(np.uint32(1 << (token % 32)).view(np.int32))
    return words.tobytes()
