"""The smg router (SGLang's cache-aware gateway) in front of two servers, unchanged: /generate and
the OpenAI routes pass through it, it registers the workers without complaint, and 4 groups x 8
requests sharing long prefixes mostly hit each replica's cache (round robin would not)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server_utils import ROOT

# scripts/smg_check.py looks for the binary the same way: beside this Python, else on PATH.
SMG = Path(sys.executable).parent / "smg"
pytestmark = pytest.mark.skipif(not SMG.is_file() and shutil.which("smg") is None,
                                reason="the smg router is not installed (test extra)")


def test_smg_cache_aware_router_over_two_servers(tiny_llama):
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "smg_check.py"), "--model", str(tiny_llama)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["generate"] and report["completions"] and report["chat"]
    assert not report["router_warnings"], report["router_warnings"]
    # Each group's ~550-token prefix is computed once, on the replica the router keeps it on.
    assert report["hit_rate"] > 0.85, report
    assert {"num_running_reqs", "num_waiting_reqs"} <= set(report["loads_keys"]), report["loads_keys"]
