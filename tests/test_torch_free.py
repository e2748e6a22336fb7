"""The API, tokenizer and scheduler processes never load torch (only workers and the offline
API do): importing their modules, and a running server's processes, checked from outside."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.server_utils import running_server

MODULES = [
    "minisgl.launch",
    "minisgl.serve.api.server",
    "minisgl.serve.tokenizer.process",
    "minisgl.serve.scheduler.process",
]


@pytest.mark.parametrize("module", MODULES)
def test_importing_a_torch_free_process_loads_no_torch(module: str):
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", f"{module} imports torch"


def _has_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc")
def test_a_serving_server_loads_torch_in_its_workers_only(tiny_llama: Path):
    """After a generation (the tokenizer's transformers tokenizer loaded, the scheduler's
    config and EOS ids read) only the worker has torch; a grammar request then brings it into
    the scheduler, whose grammar backend needs it."""
    with running_server(tiny_llama, "--max-total-tokens", "4096") as srv:
        r = httpx.post(
            f"{srv.url}/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 4}, timeout=60
        )
        assert r.status_code == 200
        pids = srv.server_info()["processes"]
        assert {name: _has_torch(pid) for name, pid in pids.items()} == {
            "api": False,
            "tokenizer": False,
            "scheduler": False,
            "worker-0": True,
        }
        r = httpx.post(
            f"{srv.url}/generate",
            json={"text": "x", "sampling_params": {"max_new_tokens": 3, "regex": "[ab]+"}},
            timeout=120,
        )
        if r.status_code == 200:  # (xgrammar installed)
            assert set(r.json()["text"]) <= {"a", "b"}
            assert _has_torch(pids["scheduler"]) and not _has_torch(pids["tokenizer"])
