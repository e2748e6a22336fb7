"""Generate from the command line through the offline API (the server arrives with minisgl.launch).

    python -m minisgl.generate --model checkpoints/tiny-llama --prompt "Hello" --prompt "Hi there"
"""

from __future__ import annotations

import argparse
import json

from minisgl.llm import LLM
from minisgl.sampling import SamplingParams
from minisgl.utils import init_logging


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="local checkpoint folder or Hugging Face hub id")
    ap.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--max-total-tokens", type=int, default=None)
    ap.add_argument("--disable-radix-cache", action="store_true")
    ap.add_argument("--log-level", default="warning")
    args = ap.parse_args()
    init_logging(args.log_level)
    llm = LLM(args.model, dtype=args.dtype, device=args.device, load_format=args.load_format,
              page_size=args.page_size, max_total_tokens=args.max_total_tokens,
              disable_radix_cache=args.disable_radix_cache)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    for prompt, result in zip(args.prompt, llm.generate(args.prompt, params)):
        print(json.dumps({"prompt": prompt, **result}, ensure_ascii=False))


if __name__ == "__main__":
    main()
