"""Where bf16's divergence from fp32 comes from, on the CPU: greedy tokens of the GGUF model in
fp32 with only its weights rounded (to bf16, to fp16) against the plain fp32 reference, next to
the whole model in bf16. If rounding the weights alone already changes most answers, no engine
can serve this checkpoint in bf16 and match fp32; the rest is the arithmetic.

    python benchmarks/gguf_bf16_vs_fp32.py --model model.gguf --reference ref.json   # the fp32 reference
    python benchmarks/bf16_sources.py --model model.gguf --reference ref.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.agreement import agreement  # noqa: E402
from benchmarks.gguf_bf16_vs_fp32 import ASKS, TOPICS  # noqa: E402
from minisgl.llm import LLM  # noqa: E402
from minisgl.wire.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--reference", required=True, help="fp32 tokens from gguf_bf16_vs_fp32.py")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    ref = json.loads(Path(args.reference).read_text())
    chats = [[{"role": "user", "content": a.format(t)}] for a in ASKS for t in TOPICS]
    params = SamplingParams(temperature=0.0, max_new_tokens=args.tokens, ignore_eos=True)
    report = {}
    llm = LLM(args.model, device="cpu", dtype="float32")
    exact = {n: p.detach().clone() for n, p in llm.runner.model.named_parameters()}
    report["fp32 (the reference again)"] = agreement([r["output_ids"] for r in llm.chat(chats, params)], ref)
    for dtype in (torch.bfloat16, torch.float16):
        for name, p in llm.runner.model.named_parameters():
            p.data.copy_(exact[name].to(dtype).float())
        llm.reset_scheduler()
        report[f"fp32 arithmetic, weights rounded to {dtype}"] = agreement(
            [r["output_ids"] for r in llm.chat(chats, params)], ref
        )
    del llm, exact
    for dtype in ("bfloat16", "float16"):
        llm = LLM(args.model, device="cpu", dtype=dtype)
        report[f"all {dtype} (CPU, torch attention)"] = agreement(
            [r["output_ids"] for r in llm.chat(chats, params)], ref
        )
        del llm
    for k, v in report.items():
        print(f"{v['identical']:3d}/{v['of']}  {k}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
