"""The hardening audits' hostile cases (``scripts/hardening_check.py``) against a CPU server:
hostile bodies, damaged checkpoints and adapters on the control plane, stopped processes. Every
case must hold, no answer may be a 5xx, and no process may be left."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.server

ROOT = Path(__file__).resolve().parents[1]


def test_every_hardening_case_holds(tiny_llama, tmp_path):
    out = tmp_path / "rows.json"
    cmd = [sys.executable, str(ROOT / "scripts/hardening_check.py"), "--model", str(tiny_llama), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    rows = json.loads(out.read_text()) if out.exists() else []
    failed = [r for r in rows if not r["ok"]]
    assert proc.returncode == 0 and rows and not failed, (failed, proc.stdout[-3000:], proc.stderr[-3000:])
    assert any(r["case"].startswith("update_weights_from_disk") for r in rows)
