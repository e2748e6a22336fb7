"""``--dp-size N``: N replicas of the server behind SGLang's smg router, as one process tree.

Each replica is a plain ``minisgl.launch`` on an internal port of 127.0.0.1 (on GPUs with its
own ``--tp-size`` devices through CUDA_VISIBLE_DEVICES); the router (``smg``, the ``router``
extra) takes the public host and port and sends each request to the replica whose radix cache
holds its prefix (``cache_aware``; ``--router-policy`` picks another of smg's policies). The
ready line comes once every replica and the router answer. A replica that dies is reported and
the others keep serving; the launcher then exits 1 when stopped. SIGTERM stops everything.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from minisgl.config.args import ServerArgs
from minisgl.serve.api.response_store import ResponseStore

logger = logging.getLogger("minisgl.launch")
# Flags the data-parallel launcher handles itself (and every --router-*); the rest go to every
# replica unchanged.
OWN_FLAGS = {"--dp-size", "--data-parallel-size", "--host", "--port"}


def find_smg() -> str | None:
    """The smg binary: beside this Python (pip's scripts folder, on PATH or not), else on PATH."""
    beside = Path(sys.executable).parent / "smg"
    return str(beside) if beside.is_file() else shutil.which("smg")


def replica_argv(argv: list[str]) -> list[str]:
    """The command line without the flags this launcher owns (``--flag value`` or ``--flag=value``)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in OWN_FLAGS or name.startswith("--router-"):
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """Run in each child before it starts: SIGTERM reaches it if this launcher dies, even by SIGKILL."""
    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def replica_envs(args: ServerArgs) -> list[dict[str, str]]:
    """Each replica's environment additions: CUDA_VISIBLE_DEVICES naming its own tp_size GPUs;
    on CPU, its share of the cores (each replica's worker would otherwise take them all)."""
    gpus = _cuda_count() if args.device == "auto" or args.device.startswith("cuda") else 0
    if not (args.device.startswith("cuda") or gpus > 0):
        if "OMP_NUM_THREADS" in os.environ:
            return [{} for _ in range(args.dp_size)]
        share = max(1, (len(os.sched_getaffinity(0)) - 1) // args.dp_size)
        return [{"OMP_NUM_THREADS": str(share)} for _ in range(args.dp_size)]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(gpus)]
    if len(ids) < args.dp_size * args.tp_size:
        raise ValueError(
            f"--dp-size {args.dp_size} x --tp-size {args.tp_size} needs "
            f"{args.dp_size * args.tp_size} GPUs; {len(ids)} are visible"
        )
    tp = args.tp_size
    return [{"CUDA_VISIBLE_DEVICES": ",".join(ids[i * tp : (i + 1) * tp])} for i in range(args.dp_size)]


def _cuda_count() -> int:
    """GPUs on this machine, asked of nvidia-smi so this process never imports torch."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU ") for line in out.splitlines())


def _relay(proc: subprocess.Popen, prefix: str) -> None:
    """A replica's output on this launcher's stderr, each line marked with the replica."""
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stderr.write(prefix + line)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except (OSError, ValueError):
        return False


class DataParallelLauncher:
    def __init__(self, args: ServerArgs, argv: list[str]):
        self.args = args
        self.argv = replica_argv(argv)
        # The replicas share one store of /v1/responses, so a follow-up the router sends to
        # another replica finds its previous_response_id. It is made here, once, before any
        # replica opens it.
        self.folder: str | None = None
        store = args.responses_store
        if store is None:
            self.folder = tempfile.mkdtemp(prefix="minisgl-dp-")
            store = os.path.join(self.folder, "responses.sqlite")
            self.argv += ["--responses-store", store]
        ResponseStore(store).close()
        self.replicas: list[subprocess.Popen] = []
        self.urls: list[str] = []
        self.router: subprocess.Popen | None = None
        self.stop = threading.Event()
        self.died: list[str] = []

    def run(self) -> int:
        smg = find_smg()
        if smg is None:
            logger.error("--dp-size needs the smg router: pip install 'minisgl[router]'")
            return 1
        try:
            envs = replica_envs(self.args)
        except ValueError as e:
            logger.error("%s", e)
            return 1
        signal.signal(signal.SIGTERM, lambda *_: self.stop.set())
        signal.signal(signal.SIGINT, lambda *_: self.stop.set())
        try:
            self._start_replicas(envs)
            if not self._wait(self.urls, self.replicas, "replica"):
                return 1
            self._start_router(smg)
            public = f"http://{self.args.host}:{self.args.port}"
            if not self._wait([public], [self.router], "router"):
                return 1
            print(
                f"minisgl ready: serving {self.args.model!r} at {public} ({self.args.dp_size} replicas behind "
                f"smg {self.args.router_policy}: {', '.join(self.urls)})",
                flush=True,
            )
            self._watch()
            return 1 if self.died else 0
        finally:
            self._stop_all()

    def _start_replicas(self, envs: list[dict[str, str]]) -> None:
        for i, extra in enumerate(envs):
            port = _free_port()
            cmd = [sys.executable, "-m", "minisgl.launch", *self.argv, "--host", "127.0.0.1", "--port", str(port)]
            env = {**os.environ, **extra}
            proc = subprocess.Popen(
                cmd, env=env, preexec_fn=_die_with_parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
            threading.Thread(target=_relay, args=(proc, f"[replica {i}] "), daemon=True).start()
            self.replicas.append(proc)
            self.urls.append(f"http://127.0.0.1:{port}")
        logger.info("starting %d replicas at %s", len(self.urls), ", ".join(self.urls))

    def _start_router(self, smg: str) -> None:
        cmd = [
            smg,
            "launch",
            "--worker-urls",
            *self.urls,
            "--policy",
            self.args.router_policy,
            "--host",
            self.args.host,
            "--port",
            str(self.args.port),
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(_free_port()),
            "--log-level",
            "warn" if self.args.log_level in ("warning", "error", "critical") else "info",
            "--balance-abs-threshold",
            str(self.args.router_balance_abs_threshold),
            "--balance-rel-threshold",
            str(self.args.router_balance_rel_threshold),
        ]
        if self.args.api_key:  # the router checks clients' keys and passes the key on to the replicas
            cmd += ["--api-key", self.args.api_key]
        self.router = subprocess.Popen(cmd, preexec_fn=_die_with_parent)

    def _wait(self, urls: list[str], procs: list, what: str) -> bool:
        """Until every url answers /health; False when one of procs exits or we are stopped."""
        pending = set(range(len(urls)))
        while pending:
            for i in list(pending):
                if procs[i].poll() is not None:
                    logger.error("the %s at %s exited with code %s during start-up", what, urls[i], procs[i].returncode)
                    return False
                if _healthy(urls[i]):
                    pending.discard(i)
            if self.stop.wait(0.5):
                return False
        return True

    def _watch(self) -> None:
        """Serve until stopped; a dead replica is reported (the others keep serving), a dead
        router or the last replica's death ends the run."""
        alive = set(range(len(self.replicas)))
        while not self.stop.wait(0.5):
            for i in list(alive):
                code = self.replicas[i].poll()
                if code is not None:
                    alive.discard(i)
                    self.died.append(f"replica {i} ({self.urls[i]}) exited with code {code}")
                    logger.error("%s; %d of %d replicas still serving", self.died[-1], len(alive), len(self.replicas))
            assert self.router is not None
            if self.router.poll() is not None:
                self.died.append(f"the router exited with code {self.router.returncode}")
                logger.error("%s; shutting down", self.died[-1])
                return
            if not alive:
                logger.error("no replica is left; shutting down")
                return

    def _stop_all(self) -> None:
        procs = [p for p in [self.router, *self.replicas] if p is not None]
        for p in procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + 20
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
