"""A minisgl server on a free local port for the client checks in this folder."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx


@contextmanager
def serving(model: str, *extra: str, timeout: float = 180, device: str = "cpu") -> Iterator[str]:
    """Start ``python -m minisgl.launch`` (on CPU unless told), wait for /health, yield its URL, stop it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "minisgl.launch",
            "--model",
            model,
            "--port",
            str(port),
            "--device",
            device,
            "--log-level",
            "warning",
            *extra,
        ]
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, server, timeout)
        yield url
    finally:
        server.terminate()
        server.wait(30)


def alive(pid: int) -> bool:
    """Whether the process runs (a zombie, exited but not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_ready(url: str, server: subprocess.Popen, timeout: float = 180) -> None:
    """Return once the server at ``url`` answers /health; raise if it exits or takes too long."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.2)


def compare_counts(url: str, before: dict[str, float], prompt_tokens: float, output_tokens: float) -> dict:
    """A client's token totals next to the server's counters' growth since ``before``."""
    after = token_counters(url)
    row = {
        "client_prompt_tokens": prompt_tokens,
        "client_output_tokens": output_tokens,
        "server_prompt_tokens": after[TOKEN_COUNTERS[0]] - before[TOKEN_COUNTERS[0]],
        "server_generation_tokens": after[TOKEN_COUNTERS[1]] - before[TOKEN_COUNTERS[1]],
    }
    row["counts_equal"] = (
        prompt_tokens == row["server_prompt_tokens"] and output_tokens == row["server_generation_tokens"]
    )
    return row


TOKEN_COUNTERS = ("sglang:prompt_tokens_total", "sglang:generation_tokens_total")


def token_counters(url: str) -> dict[str, float]:
    """The server's prompt and generation token counters, read from /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = {}
    for name in TOKEN_COUNTERS:
        m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
        out[name] = float(m.group(1)) if m else 0.0
    return out
