"""Cost of constrained decoding per decode step, against unconstrained, at several batch sizes.

    python benchmarks/grammar_bench.py --model benchmarks/configs/llama3.1-8b --tokenizer <dir>

Dummy weights in the model's real shapes; the tokenizer (any Hugging Face tokenizer folder, for
example the SmolLM2 checkpoint the GGUF loader converts) only drives xgrammar. Each batch runs
``--tokens`` decode steps twice with the same prompts: free (EOS ignored) and with every request
under a grammar (``--grammar``: a regex of letters and spaces, or a JSON list of records);
``min_new_tokens`` keeps EOS out and a logit bias keeps every token holding "]" out (so the list
never closes), so both runs take exactly the same number of steps.
Reports the decode step time of each and their ratio.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from minisgl.llm import LLM
from minisgl.wire.sampling import SamplingParams


def _records(bounded: bool) -> str:
    """A list of records, as structured-output users ask for; ``bounded`` caps the name's length
    (xgrammar expands bounded repetition, which makes its masks far costlier to fill)."""
    name = {"type": "string", "maxLength": 16} if bounded else {"type": "string"}
    item = {
        "type": "object",
        "properties": {"name": name, "age": {"type": "integer"}, "city": {"enum": ["Paris", "Lima", "Oslo", "Kyoto"]}},
        "required": ["name", "age", "city"],
        "additionalProperties": False,
    }
    return json.dumps({"type": "array", "items": item})


GRAMMARS = {
    "regex": {"regex": "[a-z ]+"},
    "json": {"json_schema": _records(False)},
    "json-bounded": {"json_schema": _records(True)},
}


def _never_closing(llm: LLM) -> dict[str, float]:
    return {str(t): -100.0 for t in range(len(llm.tokenizer)) if "]" in llm.tokenizer.decode([t])}


def _run(llm: LLM, batch: int, tokens: int, constraint: dict) -> float:
    """Seconds per decode step (prefill excluded) for ``batch`` requests of ``tokens`` tokens."""
    prompts = [[(7 * i + j) % 1000 + 10 for j in range(32)] for i in range(batch)]
    extra = constraint or {"ignore_eos": True}
    short = SamplingParams(max_new_tokens=1, temperature=0.0, **extra)
    full = SamplingParams(max_new_tokens=tokens, min_new_tokens=tokens, temperature=0.0, **extra)
    llm.generate(prompts, short)  # compile the grammar, warm the shapes
    start = time.perf_counter()
    llm.generate(prompts, short)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    out = llm.generate(prompts, full)
    elapsed = time.perf_counter() - start
    assert all(len(r["output_ids"]) == tokens for r in out)
    return (elapsed - prefill) / (tokens - 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--grammar", choices=list(GRAMMARS), nargs="+", default=["json"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    llm = LLM(args.model, load_format="dummy", tokenizer=args.tokenizer, context_length=1024)
    rows = []
    bias = _never_closing(llm)
    for batch in args.batches:
        free = min(_run(llm, batch, args.tokens, {}) for _ in range(args.repeats))
        for name in args.grammar:
            grammar = {**GRAMMARS[name], "logit_bias": bias}
            constrained = min(_run(llm, batch, args.tokens, grammar) for _ in range(args.repeats))
            rows.append(
                {
                    "batch": batch,
                    "grammar": name,
                    "free_step_ms": round(free * 1e3, 3),
                    "constrained_step_ms": round(constrained * 1e3, 3),
                    "ratio": round(constrained / free, 3),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    result = {"model": args.model, "tokenizer": args.tokenizer, "tokens": args.tokens, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
