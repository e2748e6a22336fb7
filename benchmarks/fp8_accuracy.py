"""What FP8 costs in accuracy on the real model: fp16 against FP8 weights (W8A8), FP8 KV and both.

    python benchmarks/fp8_accuracy.py --model path/to/SmolLM2-135M-Instruct.Q4_1.gguf --device cuda

Every figure goes through our own server's ``/v1/completions`` (``echo`` with ``max_tokens`` 0
scores a prompt), one server per mode:

- greedy logprobs: 16 prompts continued greedily by the base server (the model dtype, fp16 by
  default); each mode scores the same
  texts, and the mean absolute difference of the continuation tokens' logprobs from base's is
  reported (teacher-forced, so one flipped token does not derail the rest);
- perplexity on a fixed text: Python's own documentation topics (``pydoc_data.topics``, which
  ships with CPython; the Python version is recorded), in windows of ``--window`` characters;
- multiple choice, scored by loglikelihood: sentences of those topics lose their last four words,
  and the true ending competes with three endings of other sentences (``--items``, seeded).
"""

from __future__ import annotations

import argparse
import math
import random
import re
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workloads import save_result  # noqa: E402
from scripts.local_server import serving  # noqa: E402

MODES = {
    "base": [],
    "fp8-w8a8": ["--quantization", "fp8"],
    "fp8-kv": ["--kv-cache-dtype", "fp8_e4m3"],
    "fp8-both": ["--quantization", "fp8", "--kv-cache-dtype", "fp8_e4m3"],
    "fp8-both-head": ["--quantization", "fp8", "--kv-cache-dtype", "fp8_e4m3", "--quantize-lm-head"],
}
TOPICS = (
    "assignment",
    "exceptions",
    "execmodel",
    "import",
    "types",
    "compound",
    "naming",
    "numbers",
    "attribute-access",
    "specialnames",
    "datamodel",
    "function",
    "class",
    "typesseq",
    "typesmapping",
)
ENDING_WORDS = 4


def corpus() -> str:
    """Prose of Python's documentation topics, grammar blocks left out."""
    from pydoc_data.topics import topics

    paragraphs = []
    for name in TOPICS:
        for para in topics.get(name, "").split("\n\n"):
            lines = [ln for ln in para.splitlines() if ln and not ln.startswith((" ", "*", "="))]
            if len(lines) == len(para.splitlines()) and len(" ".join(lines).split()) >= 8:
                paragraphs.append(" ".join(lines))
    return "\n\n".join(paragraphs)


def choice_items(text: str, count: int, seed: int) -> list[tuple[str, list[str], int]]:
    """(context, four endings, index of the true one) from sentences of at least 12 words."""
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if 12 <= len(s.split()) <= 60]
    rng = random.Random(seed)
    endings = [" " + " ".join(s.split()[-ENDING_WORDS:]) for s in sentences]
    items = []
    for i in rng.sample(range(len(sentences)), min(count, len(sentences))):
        words = sentences[i].split()
        others = rng.sample([e for j, e in enumerate(endings) if j != i and e != endings[i]], 3)
        answer = rng.randrange(4)
        options = others[:answer] + [endings[i]] + others[answer:]
        items.append((" ".join(words[:-ENDING_WORDS]), options, answer))
    return items


def score(client: httpx.Client, url: str, prompts: list[str], batch: int = 64) -> list[dict]:
    """Each prompt's tokens, logprobs and text offsets (echo, nothing generated)."""
    out = []
    for i in range(0, len(prompts), batch):
        body = {
            "model": "m",
            "prompt": prompts[i : i + batch],
            "max_tokens": 0,
            "echo": True,
            "logprobs": 1,
            "temperature": 0.0,
        }
        r = client.post(f"{url}/v1/completions", json=body)
        r.raise_for_status()
        out += [c["logprobs"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
    return out


def tail_logprob(lp: dict, start: int) -> float:
    """Sum of the logprobs of the tokens that begin at or after character ``start``."""
    return sum(x for x, off in zip(lp["token_logprobs"], lp["text_offset"]) if off >= start and x is not None)


def windows(text: str, chars: int) -> list[str]:
    """The text in pieces of whole paragraphs, about ``chars`` characters each."""
    pieces, current = [], ""
    for para in text.split("\n\n"):
        current = f"{current}\n\n{para}" if current else para
        if len(current) >= chars:
            pieces.append(current)
            current = ""
    return pieces + ([current] if current else [])


def evaluate(url: str, greedy_texts: list[str], continuations: list[str], ppl_texts: list[str], items) -> dict:
    with httpx.Client(timeout=600) as client:
        scored = score(client, url, [p + c for p, c in zip(greedy_texts, continuations)])
        greedy = [
            [x for x, off in zip(lp["token_logprobs"], lp["text_offset"]) if off >= len(p)]
            for lp, p in zip(scored, greedy_texts)
        ]
        ppl_lps = [x for lp in score(client, url, ppl_texts, batch=8) for x in lp["token_logprobs"][1:]]
        flat = [(ctx, opt) for ctx, opts, _ in items for opt in opts]
        mc = score(client, url, [ctx + opt for ctx, opt in flat])
        picks = [max(range(4), key=lambda k: tail_logprob(mc[4 * i + k], len(items[i][0]))) for i in range(len(items))]
    return {
        "perplexity": math.exp(-sum(ppl_lps) / len(ppl_lps)),
        "ppl_tokens": len(ppl_lps),
        "mc_accuracy": sum(p == it[2] for p, it in zip(picks, items)) / len(items),
        "mc_items": len(items),
        "greedy_logprobs": greedy,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--items", type=int, default=600)
    ap.add_argument("--window", type=int, default=2000, help="characters per perplexity window")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    text = corpus()
    items = choice_items(text, args.items, args.seed)
    prompts = [s for s in re.split(r"\n\n", text)[:64:4]][:16]
    extra = [
        "--dtype",
        args.dtype,
        "--max-running-requests",
        "64",
        "--cuda-graph-max-bs",
        "16",
        "--served-model-name",
        "m",
    ]
    if args.device == "cpu":
        extra = ["--dtype", args.dtype, "--max-running-requests", "64", "--served-model-name", "m"]
    rows, continuations, ppl_texts = {}, None, None
    for mode in args.modes:
        with serving(args.model, *extra, *MODES[mode], device=args.device, timeout=600) as url:
            if continuations is None:  # the first mode (base by default) writes the continuations
                with httpx.Client(timeout=600) as client:
                    body = {"model": "m", "prompt": prompts, "max_tokens": 32, "temperature": 0.0}
                    r = client.post(f"{url}/v1/completions", json=body)
                    if r.status_code != 200:
                        raise RuntimeError(f"generation failed: {r.text}")
                    r = r.json()
                    continuations = [c["text"] for c in sorted(r["choices"], key=lambda c: c["index"])]
                ppl_texts = windows(text, args.window)
            rows[mode] = evaluate(url, prompts, continuations, ppl_texts, items)
        base = rows[args.modes[0]]["greedy_logprobs"]
        got = rows[mode]["greedy_logprobs"]
        diffs = [abs(a - b) for x, y in zip(base, got) for a, b in zip(x, y)]
        rows[mode]["greedy_logprob_mad"] = sum(diffs) / max(len(diffs), 1)
        r = rows[mode]
        print(
            f"{mode:10s} perplexity {r['perplexity']:.4f}  mc accuracy {r['mc_accuracy']:.4f} "
            f"({r['mc_items']} items)  greedy logprob MAD vs {args.modes[0]} {r['greedy_logprob_mad']:.4f}",
            flush=True,
        )
    for r in rows.values():
        r.pop("greedy_logprobs")
    save_result(
        {
            "model": args.model,
            "device": args.device,
            "dtype": args.dtype,
            "text": "pydoc_data.topics",
            "python": sys.version.split()[0],
            "topics": TOPICS,
            "rows": rows,
        },
        args.out,
        "fp8_accuracy",
    )


if __name__ == "__main__":
    main()
