"""Start the server: ``python -m minisgl.launch --model <hf-id-or-dir>``.

The launcher spawns the tokenizer, scheduler and one worker per tensor-parallel rank, waits
until the model is loaded, then serves HTTP itself (uvicorn). It prints one line when ready.
With ``--nnodes N``, node 0 does all that for its share of the ranks and every other node
(``--node-rank``) runs only its workers, which stop when node 0's scheduler goes away.

Exit codes: 0 after SIGINT/SIGTERM (a clean shutdown), 1 when a server process died or failed to
start (also: the port is taken, or a step outlived ``--watchdog-timeout``), 2 for bad arguments. In
every case the children are stopped before it exits, and a child whose launcher is killed outright
dies with it (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import sys
import threading
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess

import setproctitle
import uvicorn
import zmq

from minisgl.checkpoint.locate import resolve_model_path
from minisgl.config.args import ServerArgs, build_parser, normalize_engine_args
from minisgl.config.sglang_flags import apply_sglang_flags
from minisgl.serve.api.client import EngineClient
from minisgl.serve.api.connections import HeaderTimeoutProtocol
from minisgl.serve.api.server import LOOPBACK, create_app
from minisgl.serve.data_parallel import DataParallelLauncher
from minisgl.serve.scheduler.process import run_scheduler
from minisgl.serve.tokenizer import read_chat_template
from minisgl.serve.tokenizer.process import run_tokenizer
from minisgl.serve.workers import run_worker_process
from minisgl.utils import init_logging
from minisgl.wire.ipc import (
    HEARTBEAT_DIR,
    HEARTBEAT_LIMIT,
    HEARTBEAT_S,
    LAUNCHER,
    Addresses,
    ChildDied,
    Receiver,
    beat,
    heartbeat_age,
    stop_processes,
    wait_ready,
)
from minisgl.wire.requests import EngineInfo

logger = logging.getLogger("minisgl.launch")


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    ap = build_parser()
    ns = ap.parse_args(argv)
    apply_sglang_flags(ns, ap.error)
    if ns.stream_interval < 1:
        ap.error(f"--stream-interval must be >= 1, got {ns.stream_interval}")
    if ns.dp_size < 1:
        ap.error(f"--dp-size must be >= 1, got {ns.dp_size}")
    if ns.dp_size > 1 and ns.nnodes > 1:
        ap.error(
            "--dp-size starts replicas on this host only; for replicas on several hosts, start one server "
            "per host and one smg router over them (README: scale-out)"
        )
    if ns.dp_size > 1 and (ns.base_gpu_id, ns.gpu_id_step) != (0, 1):
        ap.error(
            "--dp-size gives each replica its GPUs in turn: choose them with CUDA_VISIBLE_DEVICES, not --base-gpu-id"
        )
    if ns.enable_weight_update_from_tensor and not ns.api_key and ns.host not in LOOPBACK:
        ap.error(f"--enable-weight-update-from-tensor on {ns.host} needs --api-key: its payload is unpickled")
    normalize_engine_args(ns)
    return ServerArgs(**vars(ns))


# A child silent this long (or --watchdog-timeout, if shorter) ends the server: well past any
# pause of a beating thread on a loaded machine, well short of a client's patience.
HEARTBEAT_LIMIT_S = 20.0


class _Server(uvicorn.Server):
    """uvicorn, plus the one "ready" line once the socket is listening."""

    def __init__(self, config: uvicorn.Config, args: ServerArgs, info: EngineInfo, client: EngineClient):
        super().__init__(config)
        self.args, self.info, self.client = args, info, client

    async def shutdown(self, sockets: list | None = None) -> None:
        self.client.fail_all()  # open streams end with an error event and [DONE], not a cut
        await super().shutdown(sockets)

    async def startup(self, sockets: list | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            print(
                f"minisgl ready: serving {self.args.model_name!r} at http://{self.args.host}:{self.args.port} "
                f"({self.info.num_pages * self.info.page_size} KV tokens, context {self.info.context_len})",
                flush=True,
            )


class Launcher:
    def __init__(self, args: ServerArgs):
        self.args = args
        self.addrs = node_addresses(args)
        ctx = mp.get_context("spawn")
        level = args.log_level
        self.procs: list[BaseProcess] = [
            ctx.Process(
                target=run_tokenizer,
                name="tokenizer",
                args=(self.addrs, args.tokenizer, level),
                kwargs=dict(
                    chat_template=args.chat_template,
                    stream_interval=args.stream_interval,
                    tool_call_parser=args.tool_call_parser,
                    completion_template=args.completion_template,
                    skip_init=args.skip_tokenizer_init,
                ),
            ),
            ctx.Process(target=run_scheduler, args=(args, self.addrs, level, args.watchdog_timeout), name="scheduler"),
        ] + [
            ctx.Process(target=run_worker_process, args=(args, rank, self.addrs, level), name=f"worker-{rank}")
            for rank in range(args.ranks_per_node)
        ]
        self.stopping = False
        self.dead: BaseProcess | None = None
        self.quiet_s = 0.0  # set when the dead process stopped beating rather than exited
        self.heartbeat_limit = min(args.watchdog_timeout, HEARTBEAT_LIMIT_S)

    def _watch(self, server: uvicorn.Server) -> None:
        """Stop serving as soon as any child dies, or stops beating (stopped, frozen) for the
        heartbeat limit: its clients would otherwise hang while /health says 200."""
        limit = self.heartbeat_limit
        while not self.stopping:
            beat(self.addrs.root, LAUNCHER)  # the children exit when this stops (a stopped launcher)
            ready = wait([p.sentinel for p in self.procs], timeout=HEARTBEAT_S)
            if self.stopping:
                return
            if ready:
                self.dead = next(p for p in self.procs if p.sentinel in ready)
                break
            quiet = [p for p in self.procs if heartbeat_age(self.addrs.root, p.name) > limit]
            if quiet:  # a stopped process cannot act on SIGTERM: killed now, not after the 5 s grace
                self.dead, self.quiet_s = quiet[0], limit
                quiet[0].kill()
                break
        server.should_exit = True

    def run(self) -> int:
        inbox: Receiver[EngineInfo] = Receiver(zmq.Context.instance(), self.addrs.launcher, EngineInfo)
        try:
            _check_port(self.args.host, self.args.port)
            logger.info("starting %s (runtime folder %s)", ", ".join(p.name for p in self.procs), self.addrs.root)
            # the children beat there and watch the launcher's beat (ipc.become_child)
            os.environ[HEARTBEAT_DIR], os.environ[HEARTBEAT_LIMIT] = self.addrs.root, str(self.heartbeat_limit)
            try:
                for p in self.procs:
                    p.start()
            finally:
                del os.environ[HEARTBEAT_DIR], os.environ[HEARTBEAT_LIMIT]
            info = wait_ready(inbox.recv, self.procs)
            pids = {"api": os.getpid(), **{p.name: p.pid for p in self.procs if p.pid is not None}}
            client = EngineClient(self.addrs)
            app = create_app(client, info, self.args, pids)
            config = uvicorn.Config(
                app,
                host=self.args.host,
                port=self.args.port,
                log_level=self.args.log_level,
                log_config=None,  # uvicorn's lines go through our handler, in our format
                access_log=False,
                timeout_graceful_shutdown=3,
                http=HeaderTimeoutProtocol,
            )
            server = _Server(config, self.args, info, client)
            threading.Thread(target=self._watch, args=(server,), daemon=True).start()
            server.run()
            if self.dead is not None and self.quiet_s:
                raise ChildDied(
                    f"the {self.dead.name} process has not answered for {self.quiet_s:g} s (stopped or frozen; "
                    f"the limit is --watchdog-timeout, at most {HEARTBEAT_LIMIT_S:g} s)"
                )
            if self.dead is not None:
                raise ChildDied(f"the {self.dead.name} process exited with code {self.dead.exitcode}")
            return 0 if server.started else 1
        except KeyboardInterrupt:
            return 0
        except ChildDied as e:
            logger.error("%s; shutting down", e)
            return 1
        except OSError as e:
            logger.error("cannot serve at %s:%d: %s", self.args.host, self.args.port, e)
            return 1
        finally:
            self.stopping = True
            self._stop_children()
            shutil.rmtree(self.addrs.root, ignore_errors=True)

    def _stop_children(self) -> None:
        stop_processes(self.procs)


def node_addresses(args: ServerArgs) -> Addresses:
    """This node's runtime folder; a TP group over several hosts also meets at --dist-init-addr."""
    if args.nnodes == 1:
        return Addresses.make()
    return Addresses.make(args.dist_init_addr, args.ranks_per_node)


def run_worker_node(args: ServerArgs) -> int:
    """A node past the first (--node-rank > 0): this host's workers only. They join node 0's
    tensor-parallel group and take batches from its scheduler; when it stops they stop, and so
    does this launcher (exit 0; 1 if a worker failed)."""
    addrs = node_addresses(args)
    first = args.node_rank * args.ranks_per_node
    ctx = mp.get_context("spawn")
    procs: list[BaseProcess] = [
        ctx.Process(target=run_worker_process, args=(args, rank, addrs, args.log_level), name=f"worker-{rank}")
        for rank in range(first, first + args.ranks_per_node)
    ]
    try:
        for p in procs:
            p.start()
        print(
            f"minisgl node {args.node_rank}: ranks {first}-{first + args.ranks_per_node - 1} of {args.tp_size} "
            f"joining node 0 at {args.dist_init_addr}",
            flush=True,
        )
        while alive := [p for p in procs if p.is_alive()]:
            wait([p.sentinel for p in alive])  # a sentinel stays readable once its process has exited
            failed = [p for p in procs if p.exitcode not in (None, 0)]
            if failed:
                logger.error(
                    "the %s process exited with code %s; stopping this node", failed[0].name, failed[0].exitcode
                )
                return 1
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        stop_processes(procs)
        shutil.rmtree(addrs.root, ignore_errors=True)


def _check_port(host: str, port: int) -> None:
    """Fail before loading the model, not after, when the address is taken."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Titles for ps and top; the children name themselves (ipc.become_child).
    role = "node" if args.node_rank > 0 else "dp-launcher" if args.dp_size > 1 else "api"
    setproctitle.setproctitle(f"minisgl::{role}")
    init_logging(args.log_level)
    try:
        args.validate()
        if args.chat_template is not None:
            read_chat_template(args.chat_template)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:  # here, in one line, rather than in a worker's traceback 40 s on (a hub model is fetched once)
        resolve_model_path(args.model, args.load_format, args.revision)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.node_rank > 0:
        signal.signal(signal.SIGTERM, _interrupt)
        return run_worker_node(args)
    if args.dp_size > 1:
        try:
            _check_port(args.host, args.port)
        except OSError as e:
            logger.error("cannot serve at %s:%d: %s", args.host, args.port, e)
            return 1
        return DataParallelLauncher(args, sys.argv[1:] if argv is None else argv).run()
    # Until uvicorn installs its own handlers (and after it restores these), SIGTERM acts like Ctrl-C.
    signal.signal(signal.SIGTERM, _interrupt)
    return Launcher(args).run()


if __name__ == "__main__":
    sys.exit(main())
