"""Run SGLang's own multi-turn benchmark against our server, unchanged.

    python benchmarks/sglang_multiturn.py --script ~/sglang/benchmark/hicache/bench_multiturn.py \
        --model <model> [--server-args "--enable-hierarchical-cache --max-total-tokens 4096"] \
        -- --num-clients 8 --max-parallel 4 --num-rounds 3 --request-length 128 --output-length 16

``--script`` is ``benchmark/hicache/bench_multiturn.py`` from a SGLang checkout, read where it
is. It imports four helpers from ``sglang.bench_serving``; SGLang's package has since moved them
and brings its GPU stack along, so the script finds ``benchmarks/sglang_compat`` first (random
prompts only: ``--disable-random-sample`` is added). This starts our server, runs the script with
``--port``, ``--model-path`` (the tokenizer: ``--tokenizer`` or the model) and
``--disable-auto-run`` filled in, prints our cache's hit rate by tier, then stops the server. The
script prints its summary and appends it to its ``--log-file``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.server import start_server  # noqa: E402

COMPAT = Path(__file__).resolve().parent / "sglang_compat"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--script", required=True, help="SGLang's benchmark/hicache/bench_multiturn.py")
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokenizer", default=None, help="for the script's prompts (default: the model)")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--port", type=int, default=30124)
    ap.add_argument("--server-args", default="", help="more flags for our server, one string")
    ap.add_argument("rest", nargs=argparse.REMAINDER, help="after --: the script's own flags")
    args = ap.parse_args()
    rest = [a for a in args.rest if a != "--"]
    proc, url = start_server(args.model, args.port, shlex.split(args.server_args), args.load_format)
    try:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(COMPAT), os.environ.get("PYTHONPATH", "")])}
        cmd = [
            sys.executable,
            args.script,
            "--port",
            str(args.port),
            "--host",
            "127.0.0.1",
            "--model-path",
            args.tokenizer or args.model,
            "--disable-auto-run",
            "--disable-random-sample",
            *rest,
        ]
        code = subprocess.run(cmd, env=env).returncode
        with urllib.request.urlopen(f"{url}/get_server_info", timeout=30) as r:
            stats = json.load(r)["scheduler"]
        queried = max(stats["prefix_queried_tokens"], 1)
        print(
            f"our server: prefix hit rate {stats['prefix_hit_tokens'] / queried:.3f} "
            f"(host tier {stats.get('prefix_host_hit_tokens', 0) / queried:.3f}), "
            f"prefill tokens {stats['prefill_tokens']}"
        )
    finally:
        proc.terminate()
        proc.wait(30)
    sys.exit(code)


if __name__ == "__main__":
    main()
