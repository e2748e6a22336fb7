"""Start our HTTP server for a benchmark and wait until it serves."""

from __future__ import annotations

import subprocess
import sys
import threading


def start_server(model: str, port: int, flags: list[str], load_format: str = "auto") -> tuple[subprocess.Popen, str]:
    """``python -m minisgl.launch`` with ``flags``; returns the process and its URL once it says
    it is ready (its output goes on to ours)."""
    cmd = [
        sys.executable,
        "-m",
        "minisgl.launch",
        "--model",
        model,
        "--load-format",
        load_format,
        "--port",
        str(port),
        "--log-level",
        "warning",
        *flags,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        print(line, end="")
        if line.startswith("minisgl ready"):
            # keep draining the pipe: a server blocked on a full pipe would stall the benchmark
            threading.Thread(target=lambda: [print(x, end="") for x in proc.stdout], daemon=True).start()
            return proc, f"http://127.0.0.1:{port}"
    raise RuntimeError("the server exited before it was ready")
