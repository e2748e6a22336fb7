"""Tensor parallelism on GPUs: greedy tokens at tp=2 against tp=1, and decode throughput.

    NCCL_NVLS_ENABLE=0 python benchmarks/tp_check.py agreement --out results.json
    NCCL_NVLS_ENABLE=0 python benchmarks/tp_check.py throughput --model benchmarks/configs/llama3.1-8b

``agreement`` serves a tiny head-dim-128 Llama at tp=1 and tp=2, in fp32 (tokens must be equal)
and bf16 (a different summation order of the all-reduce flips near-ties: the share that match
and each first divergence are reported), 64 prompts x 48 greedy tokens through /generate.
``throughput`` serves dummy weights in the model's shapes and times decode at batch 64 with
1024-token prompts: the prompts are prefilled once (max_new_tokens 1), then run again from the
cache for 256 tokens, so the time is decode.

Each tp=2 variant is one way to all-reduce: ``nccl`` (--disable-custom-all-reduce), ``one-shot``
(the symmetric-memory kernel for decode-sized tensors) and ``fp32`` (partial sums all-reduced in
float32 before rounding to the model's dtype, --enable-fp32-all-reduce). ``profile`` traces 40
decode steps of each (tp=1 first) through /start_profile and prints rank 0's kernel table.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from benchmarks.agreement import agreement  # noqa: E402
from local_server import serving  # noqa: E402


def generate(url: str, prompts: list[list[int]], max_new: int) -> tuple[list[list[int]], float]:
    body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}
    start = time.perf_counter()
    r = httpx.post(f"{url}/generate", json=body, timeout=600)
    r.raise_for_status()
    return [o["output_ids"] for o in r.json()], time.perf_counter() - start


VARIANTS = {  # tp=2 all-reduce variants: extra server flags
    "nccl": ["--disable-custom-all-reduce"],
    "one-shot": [],
    "fp32": ["--enable-fp32-all-reduce"],
}


def run_agreement(variants: list[str]) -> dict:
    from scripts.make_tiny_model import make_tiny_model

    model = make_tiny_model("llama", Path(tempfile.mkdtemp()) / "tiny-hd128", overrides={"head_dim": 128})
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randrange(8, 200))] for _ in range(64)]
    report = {}
    for dtype in ("float32", "bfloat16"):
        with serving(str(model), "--device", "cuda", "--dtype", dtype, timeout=600) as url:
            reference = generate(url, prompts, 48)[0]
        for name in variants:
            with serving(str(model), "--device", "cuda", "--dtype", dtype, "--tp-size", "2", *VARIANTS[name],
                         timeout=600) as url:
                report[f"{dtype} {name}"] = agreement(generate(url, prompts, 48)[0], reference)
    return report


def warmed_servers(model: str, batch: int, prompt_len: int, variants: list[str]) -> Iterator[tuple[str, str, list]]:
    """For tp=1 and then each tp=2 variant: a dummy-weight server whose ``batch`` random prompts
    are already cached and whose decode shapes are warm; yields (variant, url, prompts)."""
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 100000) for _ in range(prompt_len)] for _ in range(batch)]
    for name in ["tp1", *variants]:
        tp = "1" if name == "tp1" else "2"
        with serving(model, "--device", "cuda", "--load-format", "dummy", "--tp-size", tp,
                     "--context-length", "4096", *VARIANTS.get(name, []), timeout=900) as url:
            generate(url, prompts, 1)  # prefill once; later runs read the prompts from the cache
            generate(url, prompts, 8)  # warm
            yield name, url, prompts


def run_throughput(model: str, batch: int, prompt_len: int, new_tokens: int, variants: list[str]) -> dict:
    report = {}
    for name, url, prompts in warmed_servers(model, batch, prompt_len, variants):
        _, seconds = generate(url, prompts, new_tokens)
        report[name] = {"seconds": seconds, "decode_tok_per_s": batch * new_tokens / seconds}
        if name != "tp1":
            report[name]["speedup"] = report[name]["decode_tok_per_s"] / report["tp1"]["decode_tok_per_s"]
    return report


def run_profile(model: str, batch: int, prompt_len: int, variants: list[str], out_dir: Path) -> dict:
    """Kernel tables of 40 decode steps per variant (through /start_profile), and how busy the
    GPU was: a step that leaves the GPU idle is bound by the host, not by the kernels."""
    report = {}
    for name, url, prompts in warmed_servers(model, batch, prompt_len, variants):
        where = out_dir / name
        httpx.post(f"{url}/start_profile", json={"output_dir": str(where), "num_steps": 40, "activities": ["GPU"]},
                   timeout=30)
        generate(url, prompts, 48)
        deadline = time.monotonic() + 60
        while not (tables := sorted(where.glob("*/rank*.txt"))) and time.monotonic() < deadline:
            time.sleep(0.5)
        report[name] = {t.stem: t.read_text().splitlines()[0] for t in tables}
        print(f"== {name}\n" + "\n".join(tables[0].read_text().splitlines()[:22]) if tables else f"== {name}: no table")
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["agreement", "throughput", "profile"])
    ap.add_argument("--model", default=str(ROOT / "benchmarks" / "configs" / "llama3.1-8b"))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.mode == "agreement":
        report = run_agreement(args.variants)
    elif args.mode == "throughput":
        report = run_throughput(args.model, args.batch, args.prompt_len, args.new_tokens, args.variants)
    else:
        out_dir = Path(args.out).parent if args.out else Path(tempfile.mkdtemp())
        report = run_profile(args.model, args.batch, args.prompt_len, args.variants, out_dir / "profiles")
    print(json.dumps(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
