"""Streaming text out of a growing token list: complete characters only, stop strings held back.

``IncrementalDetokenizer`` decodes a short window of recent tokens each time and emits the part
past what it emitted before, holding back while the window ends in an incomplete UTF-8 sequence
(decoded as U+FFFD). ``StopStringFilter`` sits behind it: it holds back any tail that could be
the start of a stop string, so a stop string split across tokens is caught and never shown.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import regex

from minisgl.utils import partial_suffix

if TYPE_CHECKING:
    from minisgl.wire.sampling import SamplingParams

REPLACEMENT = "\ufffd"


def decode_ids(tokenizer: Any, ids: list[int], skip_special_tokens: bool, spaces: bool = True) -> str:
    """Token ids to text, never with ``clean_up_tokenization_spaces``: that clean-up rewrites
    " ." as "." by looking at neighbouring tokens, so a text decoded piece by piece would lose
    the punctuation (Llama-3 sets it under transformers 4.x). Every output text, streamed or
    not, goes through here, so both agree. Fast tokenizers decode in Rust directly:
    transformers' decode() adds ~60 us of Python per call, and streaming calls it per token."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is not None and tokenizer.is_fast:
        return backend.decode(ids, skip_special_tokens=skip_special_tokens)
    extra = {} if spaces else {"spaces_between_special_tokens": False}  # (the default, unsaid)
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False, **extra)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True, spaces: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces = spaces  # spaces_between_special_tokens (slow tokenizers)
        self.ids: list[int] = []
        self._start = 0  # window start: a few tokens of context before the unsent ones
        self._sent = 0  # tokens whose text has been emitted

    def _decode(self, ids: list[int]) -> str:
        return decode_ids(self.tokenizer, ids, self.skip_special_tokens, self.spaces)

    def add(self, ids: list[int], final: bool = False) -> str:
        """Append tokens and return the new text that is safe to show. With ``final`` (the request
        is over) everything left is returned, incomplete characters included."""
        self.ids += ids
        shown = self._decode(self.ids[self._start : self._sent])
        text = self._decode(self.ids[self._start :])
        if len(text) <= len(shown) or (text.endswith(REPLACEMENT) and not final):
            return ""
        self._start, self._sent = self._sent, len(self.ids)
        return text[len(shown) :]


REGEX_WINDOW = 4096  # characters of the text so far a stop regex is searched in (SGLang: a tail too)
# The tokenizer process serves every request, so a request's stop_regex searches get a budget:
# per piece of text (all its patterns together) and over its whole life. A request past either
# ends with an error, rather than slowing every other client (a bound per search alone let 128
# patterns of 0.04 s each hold a 4-token request of another client for 149 s).
REGEX_PIECE_BUDGET_S = 0.05
REGEX_TOTAL_BUDGET_S = 2.0


class StopRegexTooSlow(Exception):
    """A request's stop_regex searches ran past their budget."""


class StopStringFilter:
    """Cuts the text at its first stop string, or ends it at the first match of a stop regex
    (SGLang's ``stop_regex``; searched in the last ``REGEX_WINDOW`` characters after every
    piece, ``$`` meaning the end of the text so far). A stop string is left out of the text
    (kept with ``keep``); a regex match stays in, since a streamed client may have seen its start."""

    def __init__(self, stops: list[str], keep: bool = False, regexes: list[str] | None = None):
        self.stops = [s for s in stops if s]
        self.keep = keep  # show the matched stop string (SGLang's no_stop_trim)
        self.regexes = [(r, regex.compile(r)) for r in regexes or []]
        self.regex_seconds = 0.0  # spent searching, over the request's life
        self._held = ""
        self._tail = ""  # the last shown text, for the regexes
        self.matched: str | None = None  # the stop string (or regex) that ended the text

    def feed(self, text: str, final: bool = False) -> str:
        """The part of ``text`` (appended to what is held) that can be shown. After a match,
        returns the text before the stop string (through it with ``keep``; through a regex's
        match) and sets ``matched``; later calls return ""."""
        if self.matched is not None:
            return ""
        buf = self._held + text
        hits = [(i, s) for i, s in ((buf.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            at, stop = min(hits, key=lambda h: (h[0], -len(h[1])))
            buf = buf[: at + (len(stop) if self.keep else 0)]
        piece_left = REGEX_PIECE_BUDGET_S
        for pattern, compiled in self.regexes:
            left = min(piece_left, REGEX_TOTAL_BUDGET_S - self.regex_seconds)
            start = time.perf_counter()
            try:
                m = compiled.search(self._tail + buf, timeout=max(left, 1e-4))
            except TimeoutError:
                raise StopRegexTooSlow(
                    f"stop_regex searches took over their budget ({REGEX_PIECE_BUDGET_S:g} s per piece of text, "
                    f"{REGEX_TOTAL_BUDGET_S:g} s per request); last pattern searched: {pattern[:80]!r}"
                ) from None
            spent = time.perf_counter() - start
            piece_left -= spent
            self.regex_seconds += spent
            if m is not None and (not hits or m.end() - len(self._tail) <= at):
                self.matched, self._held = pattern, ""
                return buf[: max(m.end() - len(self._tail), 0)]
        if hits:
            self.matched, self._held = stop, ""
            return buf
        keep = 0 if final else partial_suffix(buf, self.stops)
        self._held = buf[len(buf) - keep :] if keep else ""
        shown = buf[: len(buf) - keep]
        if self.regexes:
            self._tail = (self._tail + shown)[-REGEX_WINDOW:]
        return shown


class TextStream:
    """One request's output text: detokenized incrementally, cut at its first stop string."""

    def __init__(
        self,
        tokenizer: Any,
        stops: list[str],
        skip_special_tokens: bool = True,
        keep_stop: bool = False,
        stop_regexes: list[str] | None = None,
        spaces: bool = True,
    ):
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens, spaces)
        self.stops = StopStringFilter(stops, keep_stop, stop_regexes)

    @classmethod
    def of(cls, tokenizer: Any, params: SamplingParams) -> TextStream:
        """The stream a request's sampling parameters ask for (stops, special tokens, trimming)."""
        return cls(
            tokenizer,
            params.stop_strings,
            params.skip_special_tokens,
            params.no_stop_trim,
            params.stop_regexes,
            params.spaces_between_special_tokens,
        )

    def add(self, ids: list[int], final: bool = False) -> str:
        """New text safe to show; ``final`` flushes everything held back."""
        return self.stops.feed(self.detok.add(ids, final), final)

    @property
    def stopped(self) -> bool:
        """A stop string was matched: the request is over, whatever the model does next."""
        return self.stops.matched is not None
