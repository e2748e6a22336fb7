"""Step times by kind from a server's debug log: how long prefill, mixed, decode and verify steps
take from launch to tokens, to find which steps make the tail of inter-token latency.

    python -m minisgl.launch --model ... --log-level debug 2> server.log
    python benchmarks/step_times.py server.log

Reads the scheduler's one line per step (``step N: KIND batch of R requests, T tokens; ...;
tokens back M ms after launch``) and prints, per kind, the count, the mean and p50/p99 of the
time and of the tokens per step. With overlap scheduling a step's time includes waiting for
the step launched before it.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.online_serving import summary  # noqa: E402

LINE = re.compile(r"step \d+: (.+?) batch of (\d+) requests, (\d+) tokens; .* tokens back ([\d.]+) ms after launch")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log")
    args = ap.parse_args()
    times: dict[str, list[float]] = defaultdict(list)
    tokens: dict[str, list[int]] = defaultdict(list)
    with open(args.log, errors="replace") as f:
        for line in f:
            m = LINE.search(line)
            if m:
                times[m[1]].append(float(m[4]))
                tokens[m[1]].append(int(m[3]))
    print(f"{'kind':18s} {'steps':>7s} {'mean ms':>8s} {'p50 ms':>8s} {'p99 ms':>8s} {'tokens p50':>10s} {'p99':>6s}")
    for kind in sorted(times, key=lambda k: -len(times[k])):
        t, n = summary(times[kind]), summary(tokens[kind])
        print(
            f"{kind:18s} {len(times[kind]):7d} {t['mean']:8.2f} {t['p50']:8.2f} {t['p99']:8.2f} "
            f"{n['p50']:10d} {n['p99']:6d}"
        )


if __name__ == "__main__":
    main()
