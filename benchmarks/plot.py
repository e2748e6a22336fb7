"""Plot the JSON results of the benchmarks into one PNG.

    python benchmarks/plot.py benchmarks/results/*.json --out benchmarks/results/summary.png

Offline runs become bars (seconds per workload and variant), decode runs become step time vs
batch size next to the bandwidth floor, online runs become TTFT / ITL / e2e bars.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "summary.png")
    args = ap.parse_args()
    runs = [(p.stem, json.loads(p.read_text())) for p in args.results]
    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 4), squeeze=False)
    for ax, (name, data) in zip(axes[0], runs):
        if "rows" in data:  # offline
            labels = [f"{r['workload']}\n{r.get('variant', r.get('radix'))}" for r in data["rows"]]
            ax.bar(range(len(labels)), [r["seconds"] for r in data["rows"]])
            ax.set_xticks(range(len(labels)), labels, rotation=60, fontsize=7)
            ax.set_ylabel("seconds")
        elif "steps" in data:  # decode
            bs = [s["batch"] for s in data["steps"]]
            for key, label in [
                ("sync_ms", "step (sync)"),
                ("pipelined_ms", "step (pipelined)"),
                ("floor_ms", "bandwidth floor"),
            ]:
                ax.plot(bs, [s[key] for s in data["steps"]], marker="o", label=label)
            ax.set_xlabel("batch size")
            ax.set_ylabel("ms per decode step")
            ax.legend(fontsize=7)
        else:  # online
            keys = ["ttft_s", "itl_s", "e2e_s"]
            for i, stat in enumerate(["mean", "p50", "p99"]):
                ax.bar([k + i * 0.25 for k in range(3)], [data[k][stat] * 1e3 for k in keys], width=0.25, label=stat)
            ax.set_xticks([k + 0.25 for k in range(3)], ["TTFT", "ITL", "e2e"])
            ax.set_yscale("log")
            ax.set_ylabel("ms")
            ax.legend(fontsize=7)
        ax.set_title(f"{name} ({data.get('gpu', data.get('device', ''))})", fontsize=8)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
