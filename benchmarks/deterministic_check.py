"""Replay one request beside random batches and report whether every bit of it matched.

    python benchmarks/deterministic_check.py --model <dir> [--flag-off] [--rounds 8]

The target (a greedy and a seeded T=0.8 request, with logprobs) runs alone on an engine without
a cache, then inside ``--rounds`` batches of 1-255 random others (random lengths and answers,
some sharing its prefix, some sampled) on an engine with the radix cache, where it also meets
its own cached prefix. Prints, per round, the batch size and whether its tokens and logprobs were
bit-identical; exits 1 on any mismatch. ``--flag-off`` runs without
``--enable-deterministic-inference``, to see what the flag buys.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.multi_turn import engine_kwargs  # noqa: E402
from minisgl.llm import LLM  # noqa: E402
from minisgl.wire.sampling import SamplingParams  # noqa: E402


def batch_around(target: list[int], params: SamplingParams, size: int, rng: random.Random):
    prompts, plist = [], []
    for _ in range(size):
        head = target[: rng.randrange(16, len(target))] if rng.random() < 0.3 else []
        prompts.append(head + [rng.randrange(3, 1000) for _ in range(rng.randrange(4, 400))])
        plist.append(
            SamplingParams(
                max_new_tokens=rng.randrange(1, 64), ignore_eos=True, temperature=rng.choice([0.0, 0.7, 1.0])
            )
        )
    at = rng.randrange(size + 1)
    return prompts[:at] + [target] + prompts[at:], plist[:at] + [params] + plist[at:], at


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 3, 15, 63, 127, 255], help="batch sizes drawn from")
    ap.add_argument("--flag-off", action="store_true")
    ap.add_argument("--engine-args", default="", help="more EngineArgs as k=v,k=v (e.g. device=cpu,dtype=float32)")
    args = ap.parse_args()
    kw = {
        "load_format": args.load_format,
        "enable_deterministic_inference": not args.flag_off,
        **engine_kwargs(args.engine_args),
    }
    rng = random.Random(args.seed)
    target = [rng.randrange(3, 1000) for _ in range(args.prompt_len)]
    requests = {
        "greedy": SamplingParams(max_new_tokens=32, ignore_eos=True, temperature=0.0),
        "seeded": SamplingParams(max_new_tokens=32, ignore_eos=True, temperature=0.8, seed=1234),
    }

    def bits(out: dict) -> tuple:
        return out["output_ids"], out["meta_info"]["output_token_logprobs"]

    alone = LLM(args.model, disable_radix_cache=True, **kw)
    refs = {name: bits(alone.generate([target], p, top_logprobs=0)[0]) for name, p in requests.items()}
    del alone
    llm = LLM(args.model, **kw)
    mismatches = 0
    for r in range(args.rounds):
        size = rng.choice(args.sizes)
        for name, params in requests.items():
            prompts, plist, at = batch_around(target, params, size, rng)
            out = llm.generate(prompts, plist, top_logprobs=0)[at]
            same = bits(out) == refs[name]
            mismatches += not same
            cached = out["meta_info"]["cached_tokens"]
            print(
                f"round {r}: {name} beside {size} others, {cached} cached tokens: {'identical' if same else 'DIFFERS'}"
            )
    print(f"{mismatches} of {2 * args.rounds} replays differed from the request alone")
    sys.exit(1 if mismatches else 0)


if __name__ == "__main__":
    main()
