"""Structured output through xgrammar: grammars compile on small thread pools (xgrammar releases
the GIL), cached by their text, so the scheduling loop never waits for one; each constrained
request then carries a matcher that the scheduler advances with every sampled token and asks
for the next step's allowed-token bitmask.

A compile cannot be interrupted, so it is bounded around: a grammar text over ``MAX_GRAMMAR_BYTES``
is refused before any work, small texts compile on threads of their own (never queued behind a
big schema), the scheduler gives up on a request whose grammar is not ready by its deadline
(``--grammar-compile-timeout-secs``), and a compile nobody waits for any more is cancelled if it
has not started.

xgrammar (and with it torch) is imported on the first grammar, so a server that never sees one
keeps its scheduler process small.
"""

from __future__ import annotations

import importlib.util
import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from minisgl.utils import allow_torch

CACHE_SIZE = 256  # compiled grammars kept (by kind and text)
MAX_GRAMMAR_BYTES = 256 << 10  # a longer schema, regex or grammar is refused (a 1 MB regex compiled for minutes)
SMALL_GRAMMAR_BYTES = 8 << 10  # texts up to this compile on the small pool


def structural_tag(text: str) -> str:
    """A structural tag in xgrammar's format: SGLang's older one (``structures`` of begin, JSON
    schema and end, entered at ``triggers``) becomes the triggered tags it means."""
    tag = json.loads(text)
    if not isinstance(tag, dict):
        raise ValueError("a structural tag is a JSON object")
    if "structures" not in tag:
        return text
    structures = tag["structures"]
    if not isinstance(structures, list) or not all(
        isinstance(s, dict) and isinstance(s.get("begin"), str) and isinstance(s.get("end"), str) for s in structures
    ):
        raise ValueError("structures must be a list of {begin, schema, end} with begin and end strings")
    tags = [
        {"begin": s["begin"], "content": {"type": "json_schema", "json_schema": s.get("schema") or {}}, "end": s["end"]}
        for s in structures
    ]
    fmt = {
        "type": "triggered_tags",
        "triggers": tag.get("triggers", []),
        "tags": tags,
        "at_least_one": bool(tag.get("at_least_one", False)),
        "stop_after_first": False,
    }
    return json.dumps({"type": "structural_tag", "format": fmt})


class GrammarBackend:
    def __init__(self, load_tokenizer: Callable[[], Any], vocab_size: int, eos_ids: list[int], threads: int = 2):
        # xgrammar is an extra (minisgl[grammar]): on Linux x86-64 it brings triton, 1 GB a CPU
        # server without structured output does not need.
        self.available = importlib.util.find_spec("xgrammar") is not None
        self._load_tokenizer = load_tokenizer  # called with the first grammar
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        self._small = ThreadPoolExecutor(threads, thread_name_prefix="grammar-small")
        self._big = ThreadPoolExecutor(threads, thread_name_prefix="grammar-big")
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._lock = threading.Lock()
        self._compiler: Any = None
        self._json_ok: Any = None  # bit words: tokens with no control byte (for JSON rows)
        self._batch: Any = None  # xgrammar's BatchGrammarMatcher: fills many rows' masks on C++ threads

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                allow_torch()  # xgrammar needs it: the scheduler loads torch with its first grammar
                import xgrammar

                tokenizer = self._load_tokenizer()
                if tokenizer is None:
                    raise ValueError("structured output needs the checkpoint's tokenizer, and it has none")
                info = xgrammar.TokenizerInfo.from_huggingface(
                    tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.eos_ids
                )
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)
                self._json_ok = self._without_control_bytes(info.decoded_vocab)
                self._batch = xgrammar.BatchGrammarMatcher(max_threads="auto")
            return self._compiler

    def _without_control_bytes(self, vocab: list[bytes]) -> Any:
        """xgrammar's JSON strings admit raw control characters (all but CR and LF), which JSON
        forbids; with compact separators no valid JSON needs a byte below 0x20, so JSON rows
        also ban every token holding one."""
        import torch

        ok = torch.tensor(
            [not any(b < 0x20 for b in t) for t in vocab] + [False] * (self.vocab_size - len(vocab)), dtype=torch.bool
        )
        ok = torch.nn.functional.pad(ok, (0, -self.vocab_size % 32)).view(-1, 32).to(torch.int64)
        words = (ok << torch.arange(32)).sum(dim=1)
        return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)

    def _compile(self, kind: str, text: str) -> Any:
        compiler = self._get_compiler()
        try:
            if kind == "json_schema":
                json.loads(text)  # a clear error for text that is not JSON at all
                compiled = compiler.compile_json_schema(text, any_whitespace=False, strict_mode=True)
            elif kind == "regex":
                compiled = compiler.compile_regex(text)
            elif kind == "structural_tag":
                compiled = compiler.compile_structural_tag(structural_tag(text))
            else:
                compiled = compiler.compile_grammar(text)
        except Exception as e:  # xgrammar raises RuntimeError / ValueError with its parser's message
            raise ValueError(f"invalid {kind}: {str(e).strip().splitlines()[-1] if str(e).strip() else e}") from e
        if not self._allows_a_start(compiled):  # e.g. {"$ref": "#"}: an empty output would "succeed"
            raise ValueError(f"invalid {kind}: no output satisfies it (it allows no first token)")
        return compiled

    def _allows_a_start(self, compiled: Any) -> bool:
        import xgrammar

        mask = xgrammar.allocate_token_bitmask(1, self.vocab_size)
        xgrammar.GrammarMatcher(compiled).fill_next_token_bitmask(mask)
        return bool(mask.any())

    def compile(self, kind: str, text: str) -> Future:
        """A future of the compiled grammar (shared by every request with the same text)."""
        size = len(text.encode())
        if size > MAX_GRAMMAR_BYTES:
            refused: Future = Future()
            refused.set_exception(ValueError(f"invalid {kind}: {size} bytes, over the limit of {MAX_GRAMMAR_BYTES}"))
            return refused
        key = (kind, text)
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None and not fut.cancelled() and not (fut.done() and fut.exception() is not None):
                self._cache.move_to_end(key)
                return fut
            pool = self._small if size <= SMALL_GRAMMAR_BYTES else self._big
            fut = pool.submit(self._compile, kind, text)
            self._cache[key] = fut
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
            return fut

    def abandon(self, fut: Future) -> None:
        """No request waits for ``fut`` any more: cancel it if it has not started (one that runs
        finishes and stays cached for the next request with its text)."""
        fut.cancel()

    @staticmethod
    def matcher(compiled: Any) -> Any:
        import xgrammar

        return xgrammar.GrammarMatcher(compiled)

    def bitmask(self, rows: list[tuple[Any, bool]]) -> bytes:
        """Allowed tokens of each (matcher, is_json) row, as int32 words (bit t % 32 of word
        t // 32); a row whose matcher is None or finished allows everything (its token is
        dropped anyway)."""
        import torch
        import xgrammar

        mask = xgrammar.allocate_token_bitmask(len(rows), self.vocab_size)  # all allowed
        live = [i for i, (m, _) in enumerate(rows) if m is not None and not m.is_terminated()]
        if live:
            self._batch.batch_fill_next_token_bitmask([rows[i][0] for i in live], mask, live)
        json_rows = [i for i in live if rows[i][1]]
        if json_rows:
            index = torch.tensor(json_rows)
            mask[index] &= self._json_ok
        return mask.numpy().tobytes()

    def shutdown(self) -> None:
        for pool in (self._small, self._big):
            pool.shutdown(wait=False, cancel_futures=True)
