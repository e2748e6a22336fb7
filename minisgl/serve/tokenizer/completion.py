"""Fill-in-the-middle prompts for /v1/completions' ``suffix``: the code models' special tokens
around the text before and after the hole, in the order each family was trained on.

SGLang's ``--completion-template`` names the format; without it, the first whose three tokens the
tokenizer has is used (the rendered text is tokenized as usual: its special tokens become theirs).
"""

from __future__ import annotations

from typing import Any, NamedTuple


class FimTemplate(NamedTuple):
    prefix: str  # opens the prompt, before the text ahead of the hole
    suffix: str  # before the text after the hole
    middle: str  # where the answer starts
    suffix_last: bool  # prefix, text, middle, suffix text, suffix token (DeepSeek-Coder) vs prefix, suffix, middle


TEMPLATES = {
    "star_coder": FimTemplate("<fim_prefix>", "<fim_suffix>", "<fim_middle>", False),  # StarCoder 1/2, SantaCoder
    "qwen_coder": FimTemplate("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", False),  # Qwen2.5/3-Coder
    "deepseek_coder": FimTemplate("<｜fim▁begin｜>", "<｜fim▁end｜>", "<｜fim▁hole｜>", True),
}


def detect_completion_template(tokenizer: Any) -> str | None:
    """The template whose three tokens are all in the tokenizer's vocabulary (None: none is)."""
    if tokenizer is None:
        return None
    vocab = tokenizer.get_vocab()
    for name, t in TEMPLATES.items():
        if all(tok in vocab for tok in (t.prefix, t.suffix, t.middle)):
            return name
    return None


def fim_prompt(name: str, prompt: str, suffix: str) -> str:
    """The text a ``name`` model completes to fill the hole between ``prompt`` and ``suffix``."""
    t = TEMPLATES[name]
    if t.suffix_last:
        return f"{t.prefix}{prompt}{t.middle}{suffix}{t.suffix}"
    return f"{t.prefix}{prompt}{t.suffix}{suffix}{t.middle}"
