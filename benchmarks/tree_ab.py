"""Two checkouts of minisgl on the same workloads: the same greedy tokens, and how fast each is.

    python benchmarks/tree_ab.py --trees /path/old /path/new --model benchmarks/configs/llama3.1-8b

Each tree runs in a process of its own (``PYTHONPATH`` set to the tree, so it imports its own
``minisgl``), with the same dummy weights and the workloads of this script's
``benchmarks/workloads.py``; the trees take turns for ``--rounds`` rounds, so drift in the
machine falls on both. Per workload it prints each tree's median seconds, the ratio to the first
tree, and whether every request's output tokens are the same (a digest over all of them).
Only the offline ``LLM`` API is used (``LLM(model, **args)``, ``generate(prompts, [dict])``),
which every tree since the first has.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def workloads_module():
    """This script's workloads, loaded by file path so the tree under test supplies ``minisgl``."""
    spec = importlib.util.spec_from_file_location("ab_workloads", HERE / "workloads.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def child(model: str, names: list[str], engine_args: dict) -> None:
    """Runs in the tree's process: load once, warm up, time each workload, print one JSON line."""
    from minisgl.llm import LLM

    workloads = workloads_module().WORKLOADS
    llm = LLM(model, load_format="dummy", **engine_args)
    vocab = llm.runner.vocab_size
    params = lambda lens: [dict(temperature=0.0, max_new_tokens=n, ignore_eos=True) for n in lens]  # noqa: E731
    llm.generate([[1 + i for i in range(64)]] * 4, params([16] * 4))  # kernels compiled, graphs warm
    out = {}
    for name in names:
        wl = workloads[name](vocab)
        llm.reset_scheduler()  # an empty prefix cache for each workload
        start = time.perf_counter()
        results = llm.generate(wl.prompts, params(wl.output_lens))
        seconds = time.perf_counter() - start
        digest = hashlib.sha256(json.dumps([r["output_ids"] for r in results]).encode()).hexdigest()[:16]
        out[name] = {"seconds": seconds, "digest": digest, "output_tokens": sum(len(r["output_ids"]) for r in results)}
    print("AB-RESULT " + json.dumps(out), flush=True)


def run_tree(tree: str, args: argparse.Namespace) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree, *filter(None, [os.environ.get("PYTHONPATH")])]))
    cmd = [sys.executable, __file__, "--child", "--model", args.model, "--workloads", *args.workloads]
    cmd += ["--engine-args", json.dumps(args.engine_args)]
    proc = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, timeout=args.timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("AB-RESULT "):
            return json.loads(line.removeprefix("AB-RESULT "))
    raise RuntimeError(f"{tree} gave no result (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", nargs="+", help="checkout roots; the first is the baseline")
    ap.add_argument("--model", required=True)
    ap.add_argument("--workloads", nargs="+", default=["random", "shared-prefix"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--engine-args", type=json.loads, default={}, help="JSON, e.g. '{\"max_running_requests\": 256}'")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per tree process")
    ap.add_argument("--out", default=None, help="JSON path for every round's numbers")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    # (children run in the tree: a relative path would point into it)
    args.model = str(Path(args.model).resolve()) if Path(args.model).exists() else args.model
    if args.child:
        child(args.model, args.workloads, args.engine_args)
        return
    trees = [str(Path(t).resolve()) for t in args.trees]
    runs: dict[str, list[dict]] = {t: [] for t in trees}
    for r in range(args.rounds):
        for tree in trees if r % 2 == 0 else trees[::-1]:
            runs[tree].append(run_tree(tree, args))
            print(f"round {r + 1} {tree}: {json.dumps(runs[tree][-1])}", flush=True)
    base = trees[0]
    for name in args.workloads:
        base_s = statistics.median(x[name]["seconds"] for x in runs[base])
        for tree in trees:
            times = [x[name]["seconds"] for x in runs[tree]]
            digests = {x[name]["digest"] for x in runs[tree]}
            same = digests == {runs[base][0][name]["digest"]}
            print(
                f"{name} {tree}: {statistics.median(times):.2f} s (runs {', '.join(f'{t:.2f}' for t in times)}), "
                f"{base_s / statistics.median(times):.3f}x the first tree, tokens "
                f"{'identical' if same else 'DIFFERENT ' + str(sorted(digests))}"
            )
    if args.out:
        Path(args.out).write_text(json.dumps({"model": args.model, "args": vars(args), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
