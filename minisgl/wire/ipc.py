"""ZeroMQ plumbing shared by every process: socket addresses and typed msgspec sockets.

Each process binds one PULL socket for what it receives and connects PUSH sockets to its peers,
so start-up order does not matter (ZeroMQ queues until the peer binds). Addresses are ``ipc://``
files in a private (0700) runtime folder made by the launcher. A worker on another host
(``--nnodes``) is the one exception: the scheduler binds a TCP port for it on node 0's address
(the port after ``--dist-init-addr``'s, plus the rank) and the worker connects there, so only
node 0's address needs to be known.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any, Generic, TypeVar

import msgspec
import zmq
import zmq.asyncio
import zmq.utils.monitor

T = TypeVar("T")


@dataclass(frozen=True)
class Addresses:
    """Where each process listens."""

    root: str
    dist_init_addr: str | None = None  # host:port of node 0 when the TP group spans hosts
    ranks_per_node: int = 0  # ranks below this run on node 0 (0: every rank does)

    @classmethod
    def make(cls, dist_init_addr: str | None = None, ranks_per_node: int = 0) -> Addresses:
        # mkdtemp creates the folder with mode 0700
        return cls(tempfile.mkdtemp(prefix="minisgl-"), dist_init_addr, ranks_per_node)

    def _ipc(self, name: str) -> str:
        return f"ipc://{os.path.join(self.root, name)}"

    @property
    def launcher(self) -> str:
        return self._ipc("launcher")

    @property
    def api(self) -> str:
        return self._ipc("api")

    @property
    def tokenizer(self) -> str:
        return self._ipc("tokenizer")

    @property
    def scheduler(self) -> str:
        return self._ipc("scheduler")

    @property
    def worker_out(self) -> str:
        return self._ipc("worker-out")

    def worker(self, rank: int) -> str:
        if not self.is_remote(rank):
            return self._ipc(f"worker-{rank}")
        assert self.dist_init_addr is not None
        host, port = self.dist_init_addr.rsplit(":", 1)
        return f"tcp://{socket.gethostbyname(host)}:{int(port) + 1 + rank}"  # ZeroMQ binds numeric addresses

    def is_remote(self, rank: int) -> bool:
        """Whether the rank runs on another host than the scheduler (its link goes over TCP)."""
        return 0 < self.ranks_per_node <= rank

    @property
    def dist_init(self) -> str:
        if self.dist_init_addr is not None:
            return f"tcp://{self.dist_init_addr}"
        return f"file://{os.path.join(self.root, 'dist-init')}"


def _socket(ctx: zmq.Context, kind: int, addr: str, bind: bool, before: Any = None) -> zmq.Socket:
    """A socket bound or connected to ``addr``; ``before(sock)`` runs first (e.g. attach a monitor)."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    if before is not None:
        before(sock)
    sock.bind(addr) if bind else sock.connect(addr)
    return sock


def cpu_worker_threads() -> int:
    """Threads for a CPU worker: every core (the API, tokenizer and scheduler sleep between
    steps and take one thread each). On 2 cores, SmolLM2-135M decoded 84 tok/s at batch 8 and
    15.5 at batch 1 with 2 threads, against 72 and 14.3 with one core left to the others.
    OMP_NUM_THREADS, if set, wins."""
    return max(1, len(os.sched_getaffinity(0)))


class Sender:
    """PUSH socket that encodes msgspec Structs as MessagePack."""

    def __init__(self, ctx: zmq.Context, addr: str, bind: bool = False):
        self.sock = _socket(ctx, zmq.PUSH, addr, bind=bind)
        self._enc = msgspec.msgpack.Encoder()

    def send(self, msg: Any) -> None:
        self.send_encoded(self.encode(msg))

    def encode(self, msg: Any) -> bytes:
        """Encode without sending (raises on what MessagePack cannot carry, sends nothing)."""
        return self._enc.encode(msg)

    def send_encoded(self, payload: bytes) -> None:
        self.sock.send(payload, copy=False)


class Receiver(Generic[T]):
    """PULL socket (bound, or connected with ``bind=False``) that decodes one message type
    (usually a tagged union)."""

    def __init__(self, ctx: zmq.Context, addr: str, kind: Any, bind: bool = True):
        self._monitor: zmq.Socket | None = None
        self.sock = _socket(ctx, zmq.PULL, addr, bind=bind, before=None if bind else self._watch)
        self._dec = msgspec.msgpack.Decoder(kind)

    def _watch(self, sock: zmq.Socket) -> None:
        self._monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)  # before connecting: no event missed

    def peer_gone(self) -> bool:
        """For a connected socket: whether the peer it reached has since closed (a remote
        worker's scheduler stopped). ZeroMQ would otherwise wait for it forever."""
        assert self._monitor is not None, "only a connecting Receiver watches its peer"
        gone = False
        while self._monitor.poll(0):
            gone |= zmq.utils.monitor.recv_monitor_message(self._monitor)["event"] == zmq.EVENT_DISCONNECTED
        return gone

    def recv(self, timeout_ms: int | None = None) -> T | None:
        """The next message; None when ``timeout_ms`` passes first (0 polls)."""
        if timeout_ms is not None and not self.sock.poll(timeout_ms):
            return None
        return self._dec.decode(self.sock.recv(copy=False).buffer)

    def recv_as(self, kind: type[T], timeout_ms: int | None = None) -> T | None:
        """The next message decoded as ``kind`` (a one-off message, such as start-up info);
        None when ``timeout_ms`` passes first."""
        if timeout_ms is not None and not self.sock.poll(timeout_ms):
            return None
        return msgspec.msgpack.decode(self.sock.recv(copy=False).buffer, type=kind)

    def waiting(self) -> bool:
        """Whether a message is here (``recv`` would not block)."""
        return bool(self.sock.poll(0))

    def recv_all(self) -> list[T]:
        """Every message already waiting, without blocking."""
        out: list[T] = []
        while self.sock.poll(0):
            out.append(self._dec.decode(self.sock.recv(copy=False).buffer))
        return out


class AsyncReceiver(Generic[T]):
    def __init__(self, ctx: zmq.asyncio.Context, addr: str, kind: Any):
        self.sock = _socket(ctx, zmq.PULL, addr, bind=True)
        self._dec = msgspec.msgpack.Decoder(kind)

    async def recv(self) -> T:
        return self._dec.decode(await self.sock.recv())


class ChildDied(RuntimeError):
    """A child process exited before its parent stopped it."""


def wait_ready(receive: Callable[[int], T | None], procs: list[BaseProcess], timeout_s: float | None = None) -> T:
    """The first message ``receive(timeout_ms)`` brings, waiting as long as every one of
    ``procs`` lives (ChildDied otherwise) and at most ``timeout_s`` (TimeoutError)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while (msg := receive(200)) is None:
        for p in procs:
            if not p.is_alive():
                raise ChildDied(f"the {p.name} process exited with code {p.exitcode} during start-up")
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"the {procs[0].name} process was not ready in {timeout_s:g} s")
    return msg


def stop_processes(procs: list[BaseProcess]) -> None:
    """SIGTERM each child, then SIGKILL what has not exited after 5 s (children never started,
    as when the port was taken, are skipped)."""
    procs = [p for p in procs if p.pid is not None]
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()


def become_child(threads: int = 1) -> None:
    """Set-up every child process runs first: die with the launcher (even if it is SIGKILLed),
    and leave Ctrl-C to the launcher, which stops the children in order. tqdm gets a thread
    lock instead of its default multiprocessing one, whose semaphore would outlive a killed child.

    ``threads`` caps its CPU threads (torch, OpenMP): only the worker computes; the others
    get one thread each, as their own OpenMP teams contending with the worker's made a CPU
    decode 2.5x slower (see ``cpu_worker_threads``). Its process title names it for ps and top
    (``minisgl::scheduler``, ``minisgl::worker-0``, ...)."""
    import multiprocessing

    import setproctitle
    from tqdm import tqdm

    setproctitle.setproctitle(f"minisgl::{multiprocessing.current_process().name}")

    if "OMP_NUM_THREADS" not in os.environ or threads == 1:
        os.environ["OMP_NUM_THREADS"] = str(threads)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

    tqdm.set_lock(threading.RLock())
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    folder = os.environ.get(HEARTBEAT_DIR)
    if folder:
        limit = float(os.environ.get(HEARTBEAT_LIMIT, "0"))
        name = multiprocessing.current_process().name
        threading.Thread(target=_beat, args=(folder, name, limit), daemon=True, name="heartbeat").start()


# A server's children say they are alive by touching a file of the runtime folder (named in this
# variable by the launcher) every HEARTBEAT_S; the launcher ends the server when one goes quiet. A
# thread beats, so a long model step does not stop it, but a stopped or frozen process does. The
# launcher beats too once it serves, and a child whose launcher stays quiet for the limit exits:
# nobody else could end the server.
HEARTBEAT_DIR = "MINISGL_HEARTBEAT_DIR"
HEARTBEAT_LIMIT = "MINISGL_HEARTBEAT_LIMIT"
HEARTBEAT_S = 1.0
LAUNCHER = "launcher"


def heartbeat_path(folder: str, name: str) -> str:
    return os.path.join(folder, f"{name}.alive")


def beat(folder: str, name: str) -> None:
    """Say that ``name`` is alive now (the file is made by the first beat)."""
    path = heartbeat_path(folder, name)
    try:
        os.utime(path)
    except FileNotFoundError:
        open(path, "a").close()


def _beat(folder: str, name: str, limit: float) -> None:
    while True:
        beat(folder, name)
        if limit and heartbeat_age(folder, LAUNCHER) > limit:
            logging.getLogger(__name__).error("the launcher has not answered for %g s; exiting", limit)
            os._exit(1)
        time.sleep(HEARTBEAT_S)


def heartbeat_age(folder: str, name: str) -> float:
    """Seconds since the process ``name`` last beat (0 before its first beat)."""
    try:
        return max(time.time() - os.stat(heartbeat_path(folder, name)).st_mtime, 0.0)
    except FileNotFoundError:
        return 0.0
