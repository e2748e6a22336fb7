"""Incremental detokenization and stop strings, against the tiny byte-level BPE tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minisgl.serve.tokenizer import load_tokenizer
from minisgl.serve.tokenizer.detokenizer import IncrementalDetokenizer, StopStringFilter


@pytest.fixture(scope="module")
def tok(tiny_llama: Path):
    return load_tokenizer(tiny_llama)


def _stream(tok, ids: list[int], chunks: list[int], skip: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tok, skip)
    pieces, i = [], 0
    for n in chunks:
        pieces.append(detok.add(ids[i : i + n]))
        i += n
    pieces.append(detok.add(ids[i:], final=True))
    return pieces


def test_multibyte_characters_never_split(tok):
    text = "naïve café → 東京 🙂🙂 done"
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([t]) for t in ids), "the test needs tokens that split a character"
    pieces = _stream(tok, ids, [1] * len(ids))
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_pieces_add_up_to_the_full_decode(tok, data):
    text = data.draw(st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=40))
    special = data.draw(st.booleans())
    ids = tok.encode(text) + ([tok.eos_token_id] if special else [])
    chunks = data.draw(st.lists(st.integers(1, 4), max_size=len(ids)))
    for skip in (True, False):
        pieces = _stream(tok, ids, chunks, skip)
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)


def _feed(f: StopStringFilter, text: str, cuts: list[int]) -> tuple[str, list[int]]:
    """``text`` fed in the pieces ``cuts`` make (then flushed, unless a stop matched): what was
    shown, and the piece boundaries."""
    bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    shown = ""
    for a, b in zip(bounds, bounds[1:]):
        shown += f.feed(text[a:b])
        if f.matched:
            return shown, bounds
    return shown + f.feed("", final=True), bounds


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc", max_size=30),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=6),
)
def test_stop_filter_cuts_at_the_first_completed_stop_and_never_leaks(text, stops, cuts):
    f = StopStringFilter(stops)
    shown, _ = _feed(f, text, cuts)
    ends = [text.find(s) + len(s) for s in stops if s in text]
    assert (f.matched is not None) == bool(ends)
    assert f.matched is None or f.matched in stops
    if not ends:
        assert shown == text
        return
    # Cut right before a stop string, no later than where the first stop string completes.
    assert any(text.startswith(s, len(shown)) for s in stops)
    assert len(shown) < min(ends)
    assert not any(s in shown for s in stops)


class Transformers4Cleanup:
    """A slow tokenizer that cleans up spaces the way transformers 4.x does by default (5.x
    ignores the setting for BPE, so the real tokenizer cannot show the bug here)."""

    is_fast = False
    clean_up_tokenization_spaces = True

    def __init__(self, tok):
        self.tok = tok

    def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=None):
        text = self.tok.decode(ids, skip_special_tokens=skip_special_tokens)
        if self.clean_up_tokenization_spaces if clean_up_tokenization_spaces is None else clean_up_tokenization_spaces:
            for a, b in [(" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't")]:
                text = text.replace(a, b)
        return text


def test_clean_up_setting_never_drops_punctuation_in_streams(tiny_llama: Path):
    """With clean_up_tokenization_spaces (Llama-3 under transformers 4.x), decoding " return",
    " ", ".", " value" piece by piece dropped the "."; streamed text must equal the whole text."""
    from minisgl.serve.tokenizer.detokenizer import TextStream, decode_ids

    real = load_tokenizer(tiny_llama)
    tok = Transformers4Cleanup(real)
    ids = [
        t
        for piece in [" return", " ", ".", " value", " ,", " end", " !"]
        for t in real.encode(piece, add_special_tokens=False)
    ]
    whole = decode_ids(tok, ids, skip_special_tokens=True)
    assert whole == decode_ids(real, ids, skip_special_tokens=True) == " return . value , end !"
    stream = TextStream(tok, [])
    pieces = [stream.add([t]) for t in ids] + [stream.add([], final=True)]
    assert "".join(pieces) == whole


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc.", max_size=30),
    pattern=st.sampled_from([r"ab+c", r"\.", r"c\.?$", r"(a|b)c"]),
    cuts=st.lists(st.integers(0, 30), max_size=6),
)
def test_stop_regex_ends_the_text_through_its_first_match_however_it_is_split(text, pattern, cuts):
    """SGLang's stop_regex: the text ends where the pattern first matches the text so far (the
    match is kept, as a stream may have shown its start); ``matched`` is the pattern."""
    import re

    f = StopStringFilter([], regexes=[pattern])
    shown, bounds = _feed(f, text, cuts)
    if f.matched is None:
        assert shown == text
        # no prefix the pieces ended at matched (a `$` pattern may match only a longer text)
        assert not any(re.search(pattern, text[:b]) for b in bounds[1:])
        return
    assert f.matched == pattern and text.startswith(shown) and re.search(pattern, shown)
    assert not any(re.search(pattern, text[:b]) for b in bounds[1:] if b < len(shown))


def test_stop_regex_and_out_of_vocabulary_stop_ids_in_the_offline_api(tiny_llama):
    """stop_regex ends a request with finish "stop" (its text holds the match); a stop token id
    past the vocabulary is accepted and never matches (SGLang's tests send one model's ids to
    every model); a bad pattern is refused by name."""
    import re

    from minisgl.llm import LLM

    llm = LLM(str(tiny_llama), device="cpu", max_total_tokens=4096)
    free = llm.generate("Hello", {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True})[0]
    target = free["text"][4:8]
    pattern = re.escape(target)
    out = llm.generate("Hello", {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True, "stop_regex": pattern})[0]
    assert (
        out["meta_info"]["finish_reason"] == "stop"
        and out["text"].endswith(target)
        and free["text"].startswith(out["text"])
    )
    far = llm.generate(
        "Hello", {"max_new_tokens": 6, "temperature": 0, "stop_token_ids": [10**6], "min_new_tokens": 2}
    )[0]
    assert far["output_ids"] == free["output_ids"][: len(far["output_ids"])]
    with pytest.raises(ValueError, match="stop_regex"):
        llm.generate("Hello", {"max_new_tokens": 4, "stop_regex": "(unclosed"})


def test_slow_stop_regexes_end_their_request_within_the_budget():
    """Many patterns that each stay under a per-search bound: the request's budget per piece
    of text ends it at once (StopRegexTooSlow) instead of holding the tokenizer process."""
    import time

    from minisgl.serve.tokenizer.detokenizer import REGEX_PIECE_BUDGET_S, StopRegexTooSlow, StopStringFilter

    slow = r"(?:.|\n){0,10}(?:.|\n){0,10}(?:.|\n){0,10}[\ue000\ue001]"
    f = StopStringFilter([], regexes=[slow] * 128)
    start = time.perf_counter()
    with pytest.raises(StopRegexTooSlow, match="stop_regex"):
        for _ in range(200):
            f.feed("word " * 200)
    assert time.perf_counter() - start < 20 * REGEX_PIECE_BUDGET_S


def test_spaces_between_special_tokens_reaches_slow_tokenizers(tiny_llama):
    """SGLang's spaces_between_special_tokens: a slow tokenizer is told (it is the one that
    spaces special tokens apart); a fast one decodes the same either way, as in transformers."""
    from minisgl.llm import LLM
    from minisgl.serve.tokenizer.detokenizer import decode_ids

    class Slow:
        is_fast = False

        def decode(self, ids, **kw):
            self.kw = kw
            return " ".join(map(str, ids)) if kw.get("spaces_between_special_tokens", True) else "".join(map(str, ids))

    slow = Slow()
    assert decode_ids(slow, [1, 2], False, spaces=False) == "12" and decode_ids(slow, [1, 2], False) == "1 2"
    llm = LLM(str(tiny_llama), device="cpu", max_total_tokens=2048)
    params = {"max_new_tokens": 8, "temperature": 0, "skip_special_tokens": False}
    spaced = llm.generate([1, 2, 3], params)[0]["text"]
    assert llm.generate([1, 2, 3], {**params, "spaces_between_special_tokens": False})[0]["text"] == spaced
