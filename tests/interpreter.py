"""Running Triton kernels on CPU: the interpreter must be on before triton loads, so a check runs
in a child process with ``TRITON_INTERPRET=1``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def run_interpreted(code: str, timeout: int = 900) -> None:
    """Run ``code`` (Python, importing from ``tests``) under Triton's interpreter; fail with its
    stderr if it fails. Skips where triton is not installed."""
    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(root))
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stderr[-3000:]
