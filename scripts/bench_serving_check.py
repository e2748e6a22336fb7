"""SGLang's own benchmark client (``sglang.bench_serving``) against a minisgl server, unchanged.

    python scripts/bench_serving_check.py --model checkpoints/tiny-llama

Runs ``bench_serving`` with the ``sglang``, ``sglang-oai`` and ``vllm`` backends on the
``random`` (sampled from a local ShareGPT-shaped file of random words, as no hub is reachable)
and ``generated-shared-prefix`` datasets, and compares the client's token counts
with the server's own counters (``sglang:prompt_tokens_total``, ``sglang:generation_tokens_total``).
Prints one JSON line per run; exits 1 when a run fails or a count differs.

Install (the client only; sglang's full dependency set pulls a CUDA torch):
``pip install --no-deps sglang`` plus the pure-Python modules it imports (see the note of
session 7). On a CPU machine torchvision's PyPI wheel is a CUDA build that does not load; the
benchmark never touches images, so ``bench`` mode answers sglang's multimodal imports of
torchvision with empty placeholder modules.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import types

from local_server import compare_counts, serving, token_counters


class _Placeholder(types.ModuleType):
    """A module whose every attribute is another placeholder (and which can be called)."""

    def __getattr__(self, name: str) -> "_Placeholder":
        if name.startswith("__"):
            raise AttributeError(name)
        full = f"{self.__name__}.{name}"
        return sys.modules.setdefault(full, _Placeholder(full))

    def __call__(self, *args, **kwargs) -> "_Placeholder":
        return self


class _TorchvisionFinder:
    """Serves placeholders for ``torchvision`` imports made after transformers checked for it."""

    def find_spec(self, name, path=None, target=None):
        from importlib.machinery import ModuleSpec

        if name.split(".")[0] != "torchvision":
            return None

        class Loader:
            def create_module(self, spec):
                return _Placeholder(spec.name)

            def exec_module(self, module):
                module.__path__ = []

        return ModuleSpec(name, Loader(), is_package=True)


def _bench(argv: list[str]) -> None:
    import transformers.utils.import_utils  # noqa: F401  (records torchvision as absent first)

    sys.meta_path.insert(0, _TorchvisionFinder())
    from sglang.bench_serving import cli_main

    sys.argv = ["bench_serving", *argv]
    cli_main()


def main() -> int:
    if sys.argv[1:2] == ["bench"]:
        _bench(sys.argv[2:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--backends", nargs="+", default=["sglang", "sglang-oai", "vllm"])
    ap.add_argument("--datasets", nargs="+", default=["random", "generated-shared-prefix"])
    args = ap.parse_args()
    dataset_args = {
        "random": ["--random-input-len", "128", "--random-output-len", "16", "--random-range-ratio", "0.5"],
        "generated-shared-prefix": [
            "--gsp-num-groups",
            "4",
            "--gsp-prompts-per-group",
            str(args.num_prompts // 4),
            "--gsp-system-prompt-len",
            "256",
            "--gsp-question-len",
            "32",
            "--gsp-output-len",
            "16",
        ],
    }
    failed = False
    rng = random.Random(0)
    words = "the of and a to in is you that it he was for on are as with his they at be this have from".split()
    conversations = [
        {
            "conversations": [
                {"from": "human", "value": " ".join(rng.choices(words, k=200))},
                {"from": "gpt", "value": " ".join(rng.choices(words, k=60))},
            ]
        }
        for _ in range(64)
    ]
    source = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    json.dump(conversations, source)
    source.close()
    dataset_args["random"] += ["--dataset-path", source.name]
    with serving(args.model, "--served-model-name", "m") as url:
        for backend in args.backends:
            for dataset in args.datasets:
                before = token_counters(url)
                with tempfile.NamedTemporaryFile(suffix=".jsonl") as out:
                    cmd = [
                        sys.executable,
                        __file__,
                        "bench",
                        "--backend",
                        backend,
                        "--base-url",
                        url,
                        "--model",
                        "m",
                        "--tokenizer",
                        args.model,
                        "--dataset-name",
                        dataset,
                        "--num-prompts",
                        str(args.num_prompts),
                        "--output-file",
                        out.name,
                        "--seed",
                        "1",
                        "--warmup-requests",
                        "0",
                        "--flush-cache",
                        *dataset_args[dataset],
                    ]
                    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
                    lines = open(out.name).read().splitlines()
                row = {"backend": backend, "dataset": dataset, "rc": run.returncode}
                if run.returncode != 0 or not lines:
                    row["error"] = run.stderr[-2000:]
                    failed = True
                else:
                    res = json.loads(lines[-1])
                    row |= {
                        "completed": res["completed"],
                        "output_throughput": round(res["output_throughput"], 1),
                        **compare_counts(url, before, res["total_input_tokens"], res["total_output_tokens"]),
                    }
                    failed |= not (row["counts_equal"] and res["completed"] == args.num_prompts)
                print(json.dumps(row), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
