"""Greedy tokens with cascade attention on and off, on a real checkpoint in bf16 (CUDA).

    python benchmarks/cascade_agreement.py --model SmolLM2-135M-Instruct.Q4_1.gguf

64 chats in 4 groups of 16 share a long system prompt, so every decode step at batch 64 runs
as a cascade (asserted). Plain and cascade steps run on one kernel, a cascade step continuing
each request's pass where its group's shared level stopped, so they should match bit for bit;
the report gives the share of chats whose tokens match and each first divergence (chat, token),
with the same figures for plain steps on FlashInfer's decode against ours and fp16 against bf16
as yardsticks of rounding noise, and a second plain run to show the engine repeats itself
exactly. Two readings: answers as a user gets them (each
stops at its end-of-turn token or --tokens) and --tokens forced past the end of turn, where the
model rambles over flat distributions.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.agreement import agreement  # noqa: E402
from minisgl.llm import LLM  # noqa: E402
from minisgl.wire.sampling import SamplingParams

RULES = [
    "Answer in plain English.",
    "Be brief and precise.",
    "Never invent facts.",
    "Use short sentences.",
    "Explain terms a child would not know.",
    "Prefer examples to abstractions.",
    "Stay polite.",
    "If unsure, say so.",
]
ROLES = ["a patient science teacher", "a ship's navigator", "a museum guide", "a friendly librarian"]
QUESTIONS = [
    "Why is the sky blue?",
    "How do tides work?",
    "What is a star?",
    "Why do leaves fall?",
    "How does a compass work?",
    "What is rain made of?",
    "How do birds fly?",
    "What is a volcano?",
    "Why is the sea salty?",
    "How do plants eat?",
    "What causes wind?",
    "What is an eclipse?",
    "How do fish breathe?",
    "Why do we sleep?",
    "What is thunder?",
    "How big is the moon?",
]


def chats() -> list[list[dict]]:
    out = []
    for role in ROLES:
        system = f"You are {role}. " + " ".join(f"Rule {i + 1}: {r}" for i, r in enumerate(RULES * 6))
        out += [[{"role": "system", "content": system}, {"role": "user", "content": q}] for q in QUESTIONS]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)
    args = ap.parse_args()
    readings = {
        "answers": SamplingParams(temperature=0.0, max_new_tokens=args.tokens),
        "forced": SamplingParams(temperature=0.0, max_new_tokens=args.tokens, ignore_eos=True),
    }
    outs, cascade_steps = {}, 0
    plain = dict(dtype="bfloat16", disable_cascade_attention=True)
    for name, kw in {
        "cascade": dict(dtype="bfloat16"),
        "plain": plain,
        "plain again": plain,
        "plain fp16": dict(dtype="float16", disable_cascade_attention=True),
        "plain, flashinfer decode": dict(plain, decode_attention_backend="flashinfer"),
    }.items():
        llm = LLM(args.model, device="cuda", page_size=args.page_size, max_running_requests=64, **kw)
        launch = llm.runner.launch

        def spy(batch, launch=launch):
            nonlocal cascade_steps
            cascade_steps += bool(batch.group_sizes)
            launch(batch)

        llm.runner.launch = spy
        for reading, params in readings.items():
            outs[name, reading] = [r["output_ids"] for r in llm.chat(chats(), params)]
        del llm, spy, launch
        gc.collect()  # the spy closes over the runner: free its KV pool before the next run
        torch.cuda.empty_cache()
    assert cascade_steps > args.tokens, f"only {cascade_steps} cascade steps"
    report: dict = {"cascade_steps": cascade_steps, "tokens": args.tokens}
    for reading in readings:
        report[reading] = {
            "cascade vs plain (bf16)": agreement(outs["cascade", reading], outs["plain", reading]),
            "plain: flashinfer vs our decode": agreement(
                outs["plain, flashinfer decode", reading], outs["plain", reading]
            ),
            "plain vs plain again": agreement(outs["plain again", reading], outs["plain", reading]),
            "plain fp16 vs plain bf16": agreement(outs["plain fp16", reading], outs["plain", reading]),
            "mean_tokens": sum(map(len, outs["plain", reading])) / 64,
        }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
