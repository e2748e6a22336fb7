"""The smg router (``pip install smg``) in front of two minisgl servers, cache_aware policy.

    python scripts/smg_check.py --model checkpoints/tiny-llama

Checks /generate and the OpenAI routes through the router, then sends 4 groups x 8 requests
that share long prefixes and reads the replicas' own counters: with every group kept on one
replica, each group's prefix is computed once (the fewest misses possible). Prints the
router's warnings about the workers, if any; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import socket
import subprocess
import sys
import time
from contextlib import ExitStack

import httpx
from local_server import serving

from minisgl.serve.data_parallel import find_smg


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--smg", default=find_smg() or "smg")
    args = ap.parse_args()
    with ExitStack() as stack:
        workers = [stack.enter_context(serving(args.model, "--served-model-name", "m")) for _ in range(2)]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        router = subprocess.Popen(
            [
                args.smg,
                "launch",
                "--worker-urls",
                *workers,
                "--policy",
                "cache_aware",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        stack.callback(router.terminate)
        url = f"http://127.0.0.1:{port}"
        for _ in range(120):
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
        checks = {}
        r = httpx.post(f"{url}/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 4}}, timeout=60)
        checks["generate"] = r.status_code == 200 and len(r.json()["output_ids"]) == 4
        r = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": "Hello", "max_tokens": 4}, timeout=60)
        checks["completions"] = r.status_code == 200
        r = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]},
            timeout=60,
        )
        checks["chat"] = r.status_code == 200
        before = [httpx.get(f"{w}/server_info").json()["scheduler"] for w in workers]
        rng = random.Random(0)
        words = "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega".split()
        prefixes = [" ".join(rng.choice(words) for _ in range(150)) for _ in range(4)]
        for member in range(8):
            for g, prefix in enumerate(prefixes):
                body = {"text": f"{prefix} question {g}.{member}:", "sampling_params": {"max_new_tokens": 2}}
                assert httpx.post(f"{url}/generate", json=body, timeout=60).status_code == 200
        after = [httpx.get(f"{w}/server_info").json()["scheduler"] for w in workers]
        hits = sum(a["prefix_hit_tokens"] - b["prefix_hit_tokens"] for a, b in zip(after, before))
        queried = sum(a["prefix_queried_tokens"] - b["prefix_queried_tokens"] for a, b in zip(after, before))
        loads = [httpx.get(f"{w}/v1/loads?include=core").json()["loads"][0] for w in workers]
        router.terminate()
        log = router.communicate(timeout=10)[0]
    # The router's own security-posture notice (metrics port without auth) is not about the workers.
    plain = re.sub(r"\x1b\[[0-9;]*m", "", log)
    warnings = [
        line for line in plain.splitlines() if ("WARN" in line or "ERROR" in line) and "smg::posture" not in line
    ]
    report = {
        **checks,
        "hit_rate": hits / queried,
        "queried_tokens": queried,
        "hit_tokens": hits,
        "prefill_tokens_per_worker": [a["prefill_tokens"] - b["prefill_tokens"] for a, b in zip(after, before)],
        "loads_keys": sorted(loads[0]),
        "router_warnings": warnings[:10],
    }
    print(json.dumps(report))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
