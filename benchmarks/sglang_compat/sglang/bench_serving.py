"""The four helpers SGLang's ``benchmark/hicache/bench_multiturn.py`` imports from
``sglang.bench_serving``, written for this runner: a tokenizer loader, random prompts of a given
length (no ShareGPT: nothing is downloaded), the per-request record it fills, and a prefix strip."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestFuncOutput:
    generated_text: str = ""
    success: bool = False
    latency: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_len: int = 0
    output_len: int = 0
    error: str = ""


@dataclass
class DatasetRow:
    prompt: str
    prompt_len: int
    output_len: int


def get_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def remove_prefix(text: str, prefix: str) -> str:
    return text[len(prefix) :] if text.startswith(prefix) else text


def sample_random_requests(
    input_len: int,
    output_len: int,
    num_prompts: int,
    range_ratio: float,
    tokenizer,
    dataset_path: str = "",
    random_sample: bool = True,
    **_: object,
) -> list[DatasetRow]:
    """``num_prompts`` texts of random ordinary tokens, lengths drawn from
    [input_len * range_ratio, input_len] (numpy's global generator, which the script seeds)."""
    if random_sample or dataset_path:
        raise SystemExit("offline runner: pass --disable-random-sample and no --dataset-path (random prompts only)")
    special = set(tokenizer.all_special_ids)
    vocab = np.array([i for i in range(len(tokenizer)) if i not in special])
    low = max(1, int(input_len * range_ratio))
    rows = []
    for n in np.random.randint(low, input_len + 1, size=num_prompts):
        text = tokenizer.decode(np.random.choice(vocab, size=int(n)).tolist())
        rows.append(DatasetRow(text, int(n), output_len))
    return rows
