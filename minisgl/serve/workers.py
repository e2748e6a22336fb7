"""Starting worker processes: their entry point (``run_worker_process``, importable without
torch by the launcher that spawns them) and the offline API's own ranks at ``tp_size`` > 1
(``WorkerGroup``), driven as the server's scheduler drives its workers."""

from __future__ import annotations

import multiprocessing as mp
import weakref
from pathlib import Path

from minisgl.config.args import EngineArgs
from minisgl.serve.scheduler.worker_link import WorkerLink
from minisgl.wire.ipc import Addresses, ChildDied, stop_processes, wait_ready
from minisgl.wire.requests import EngineInfo


def run_worker_process(args: EngineArgs, rank: int, addrs: Addresses, level: str) -> None:
    """A worker process's entry point; torch is imported there only, so the processes that
    spawn workers (the launcher, which serves HTTP; an offline caller) stay small."""
    from minisgl.device.worker.process import run_worker

    run_worker(args, rank, addrs, level)


class WorkerGroup(WorkerLink):
    """``args.tp_size`` worker processes of this process's own, with what rank 0 loaded
    (``model_dir``, ``vocab_size``, ``num_pages``, ``context_len``) for the caller's scheduler.
    They stop with ``close``, when the group is collected, or with this process."""

    def __init__(self, args: EngineArgs, log_level: str = "warning", start_timeout_s: float = 1800.0):
        addrs = Addresses.make()
        super().__init__(addrs, args.tp_size)
        ctx = mp.get_context("spawn")
        self.procs = [
            ctx.Process(target=run_worker_process, args=(args, rank, addrs, log_level), name=f"worker-{rank}")
            for rank in range(args.tp_size)
        ]
        for p in self.procs:
            p.start()
        self._stop = weakref.finalize(self, stop_processes, self.procs)  # on close, collection or exit
        try:
            info = wait_ready(lambda ms: self.results.recv_as(EngineInfo, ms), self.procs, start_timeout_s)
        except (ChildDied, TimeoutError):
            self.close()
            raise
        self.model_dir = Path(info.model_path)
        self.vocab_size, self.num_pages, self.context_len = info.vocab_size, info.num_pages, info.context_len
        self.hidden_size = info.hidden_size
        self.num_host_pages, self.storage_fingerprint = info.num_host_pages, info.storage_fingerprint
        self.kv_bytes_per_page = info.kv_bytes_per_token * info.page_size
        self.on_gpu = info.device == "cuda"
        self.snapshot_rows = info.snapshot_rows
        args.max_running_requests = info.max_running_requests  # derived from the pool unless given

    def close(self) -> None:
        """Stop the workers (SIGTERM, then SIGKILL after 5 s)."""
        self._stop()
