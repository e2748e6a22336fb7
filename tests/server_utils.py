"""Running the real server in a subprocess for tests, and looking at its process tree."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from scripts.local_server import alive  # noqa: F401  (the tests import it from here, beside descendants)

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    out, stack = set(), [pid]
    while stack:
        for c in children.get(stack.pop(), []):
            out.add(c)
            stack.append(c)
    return out


class ServerProcess:
    """``python -m minisgl.launch`` on a free port; ``start`` waits for the ready line."""

    def __init__(self, model: Path, *extra: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable,
            "-m",
            "minisgl.launch",
            "--model",
            str(model),
            "--port",
            str(self.port),
            "--device",
            "cpu",
            "--log-level",
            "warning",
            *extra,
        ]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("minisgl ready"):
                self._ready.set()

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("server did not start:\n" + "".join(self.lines))

    def server_info(self, **headers: str) -> dict:
        return httpx.get(f"{self.url}/get_server_info", headers=headers, timeout=30).json()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    @property
    def output(self) -> str:
        return "".join(self.lines)


@contextmanager
def running_server(model: Path, *extra: str) -> Iterator[ServerProcess]:
    """A ready server for one test; killed (SIGKILL) afterwards whatever happened."""
    srv = ServerProcess(model, *extra)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop(signal.SIGKILL)
