"""Launcher lifecycle: the ready line, API keys, SIGTERM, a dying child, bad arguments.
Each case starts its own server and checks that no process of it survives."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.server_utils import ROOT, ServerProcess, alive, descendants


def _all_gone(pids: set[int], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(alive(p) for p in pids)


def test_sigterm_stops_everything(tiny_llama: Path):
    srv = ServerProcess(tiny_llama, "--api-key", "s3cret")
    try:
        srv.wait_ready()
        assert sum(line.startswith("minisgl ready") for line in srv.lines) == 1
        assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200  # open for probes
        r = httpx.get(f"{srv.url}/v1/models", timeout=10)
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
        r = httpx.get(f"{srv.url}/v1/models", headers={"Authorization": "Bearer wrong"}, timeout=10)
        assert r.status_code == 401
        auth = {"Authorization": "Bearer s3cret"}
        r = httpx.post(f"{srv.url}/generate", headers=auth, timeout=30,
                       json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 200
        procs = srv.server_info(**auth)["processes"]
        children = descendants(srv.proc.pid)
        assert procs.pop("api") == srv.proc.pid  # the launcher serves the API itself
        assert set(procs.values()) <= children
        start = time.monotonic()
        code = srv.stop(signal.SIGTERM)
        assert code == 0, srv.output
        assert time.monotonic() - start < 10
        assert _all_gone(children), [p for p in children if alive(p)]
    finally:
        srv.stop(signal.SIGKILL)


def test_dead_worker_stops_everything(tiny_llama: Path):
    srv = ServerProcess(tiny_llama)
    try:
        srv.wait_ready()
        worker = srv.server_info()["processes"]["worker-0"]
        children = descendants(srv.proc.pid)
        os.kill(worker, signal.SIGKILL)
        code = srv.proc.wait(20)
        assert code == 1, srv.output
        assert "worker-0 process exited with code -9" in srv.output
        assert _all_gone(children), [p for p in children if alive(p)]
    finally:
        srv.stop(signal.SIGKILL)


def test_failed_start_and_bad_arguments(tmp_path: Path):
    run = [sys.executable, "-m", "minisgl.launch", "--device", "cpu"]
    bad = subprocess.run(run + ["--model", str(tmp_path), "--page-size", "0"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "page_size must be >= 1" in bad.stderr
    missing = subprocess.run(run + ["--model", str(tmp_path / "nope")], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 1
    assert "does not exist" in missing.stderr and "exited with code 1 during start-up" in missing.stderr


def test_tensor_parallel_on_cpu_matches_one_rank(tiny_llama: Path):
    """Two worker processes (gloo all-reduce) give the same greedy tokens as the offline engine."""
    from minisgl.llm import LLM

    want = LLM(str(tiny_llama), device="cpu").generate("Hello world", {"max_new_tokens": 16, "temperature": 0})
    srv = ServerProcess(tiny_llama, "--tp-size", "2")
    try:
        srv.wait_ready()
        assert set(srv.server_info()["processes"]) == {"api", "tokenizer", "scheduler", "worker-0", "worker-1"}
        r = httpx.post(f"{srv.url}/generate", timeout=60,
                       json={"text": "Hello world", "sampling_params": {"max_new_tokens": 16, "temperature": 0}})
        assert r.json()["output_ids"] == want[0]["output_ids"]
        assert srv.stop() == 0
    finally:
        srv.stop(signal.SIGKILL)
