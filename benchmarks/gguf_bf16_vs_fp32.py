"""A GGUF model in bf16 on the GPU (FlashInfer, CUDA graphs) against fp32 on the CPU: greedy tokens.

    python benchmarks/gguf_bf16_vs_fp32.py --model model.gguf --reference ref.json            # CPU, fp32: writes
    python benchmarks/gguf_bf16_vs_fp32.py --model model.gguf --reference ref.json --check    # GPU, bf16: compares

bf16 rounding makes near-tied logits flip, so a share of prompts diverge at some token; the
report gives the share that match over all tokens and each first divergence (prompt, token).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.agreement import agreement  # noqa: E402
from minisgl.llm import LLM  # noqa: E402
from minisgl.wire.sampling import SamplingParams

TOPICS = ["the ocean", "a small town", "machine learning", "coffee", "the moon", "music", "rain", "bicycles"]
ASKS = [
    "Write a short poem about {}.",
    "Explain {} to a child.",
    "List three facts about {}.",
    "Tell a story about {}.",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--reference", required=True)
    ap.add_argument("--check", action="store_true", help="run bf16 on CUDA and compare with the reference")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", help="dtype of the --check run")
    ap.add_argument("--attention-backend", default="auto", help="attention of the --check run")
    args = ap.parse_args()
    chats = [[{"role": "user", "content": a.format(t)}] for a in ASKS for t in TOPICS]  # 32
    params = SamplingParams(temperature=0.0, max_new_tokens=args.tokens, ignore_eos=True)
    if not args.check:
        llm = LLM(args.model, device="cpu", dtype="float32")
        Path(args.reference).write_text(json.dumps([r["output_ids"] for r in llm.chat(chats, params)]))
        return
    ref = json.loads(Path(args.reference).read_text())
    llm = LLM(args.model, device="cuda", dtype=args.dtype, attention_backend=args.attention_backend)
    got = [r["output_ids"] for r in llm.chat(chats, params)]
    match = agreement(got, ref)
    print(
        json.dumps(
            {
                "dtype": args.dtype,
                "attention": type(llm.runner.attn).__name__,
                "prompts": len(ref),
                "identical": match["identical"],
                "share": match["identical"] / len(ref),
                "first_divergences": match["first_divergences"],
                "graphs": llm.runner.graphs is not None,
            }
        )
    )


if __name__ == "__main__":
    main()
