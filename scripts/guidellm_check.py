"""guidellm (``pip install guidellm``) against a minisgl server, unchanged.

    python scripts/guidellm_check.py --model checkpoints/tiny-llama

Runs guidellm's throughput profile on synthetic text (local tokenizer, no hub) through its
``openai_http`` backend, once with chat completions and once with text completions, and
compares its token totals with the server's own counters. Prints one JSON line per run; exits
1 when a request fails or a count differs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

from local_server import compare_counts, serving, token_counters


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--guidellm", default=shutil.which("guidellm") or "guidellm")
    args = ap.parse_args()
    failed = False
    with serving(args.model, "--served-model-name", "m") as url:
        for request_format in ("/v1/chat/completions", "/v1/completions"):
            before = token_counters(url)
            with tempfile.TemporaryDirectory() as tmp:
                report = os.path.join(tmp, "report.json")
                cmd = [
                    args.guidellm,
                    "run",
                    "--backend",
                    f"kind=openai_http,target={url},model=m,request_format={request_format}",
                    "--profile",
                    "kind=throughput,max_concurrency=8",
                    "--constraint",
                    f"kind=max_requests,count={args.requests}",
                    "--tokenizer",
                    f"kind=huggingface_auto,model={args.model}",
                    "--data",
                    "kind=synthetic_text,prompt_tokens=128,output_tokens=16",
                    "--output",
                    f"kind=json,path={report}",
                    "--disable-console",
                ]
                run = subprocess.run(
                    cmd, capture_output=True, text=True, timeout=900, env={**os.environ, "HF_HUB_OFFLINE": "1"}
                )
                row = {"request_format": request_format, "rc": run.returncode}
                if run.returncode != 0 or not os.path.exists(report):
                    row["error"] = (run.stdout + run.stderr)[-2000:]
                    failed = True
                else:
                    metrics = json.load(open(report))["benchmarks"][0]["metrics"]
                    row |= {
                        "requests": metrics["request_totals"],
                        **compare_counts(
                            url,
                            before,
                            metrics["prompt_token_count"]["successful"]["total_sum"],
                            metrics["output_token_count"]["successful"]["total_sum"],
                        ),
                    }
                    failed |= not (row["counts_equal"] and row["requests"]["successful"] == args.requests)
            print(json.dumps(row), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
