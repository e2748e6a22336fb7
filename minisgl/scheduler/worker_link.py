"""Worker processes as a Scheduler's executor: each batch goes to every tensor-parallel rank,
each step's tokens come back from rank 0.

The scheduler process drives the launcher's workers this way (``WorkerLink``); the offline API
at ``tp_size`` > 1 starts its own ranks (``WorkerGroup``), since one process holds one rank.
"""

from __future__ import annotations

import multiprocessing as mp
import weakref
from pathlib import Path

import zmq

from minisgl.args import EngineArgs
from minisgl.ipc import Addresses, ChildDied, Receiver, Sender, stop_processes, wait_ready
from minisgl.messages import EngineInfo, ForwardBatch, SampleMasks, StepOutput, ToWorker, WorkerReply, WorkerTask


class WorkerLink:
    """Sockets to the workers at ``addrs``: ``launch``, ``sample_masked`` and ``collect``, as a
    ModelRunner has them."""

    def __init__(self, addrs: Addresses, tp_size: int):
        ctx = zmq.Context.instance()
        self.results: Receiver[StepOutput | WorkerReply] = Receiver(ctx, addrs.worker_out, StepOutput | WorkerReply)
        self.ranks = [Sender(ctx, addrs.worker(r), bind=addrs.is_remote(r)) for r in range(tp_size)]

    def broadcast(self, msg: ToWorker) -> None:
        for rank in self.ranks:
            rank.send(msg)

    def launch(self, batch: ForwardBatch) -> None:
        self.broadcast(batch)

    def sample_masked(self, bitmask: bytes) -> None:
        self.broadcast(SampleMasks(bitmask))

    def collect(self) -> StepOutput:
        out = self.results.recv()
        assert isinstance(out, StepOutput)
        return out

    def run_task(self, task: WorkerTask) -> WorkerReply:
        """Every rank runs the task (no step may be in flight); rank 0 answers for all."""
        self.broadcast(task)
        reply = self.results.recv()
        assert isinstance(reply, WorkerReply)
        return reply


def run_worker_process(args: EngineArgs, rank: int, addrs: Addresses, level: str) -> None:
    """A worker process's entry point; torch is imported there only, so the processes that
    spawn workers (the launcher, which serves HTTP; an offline caller) stay small."""
    from minisgl.worker.process import run_worker

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
        self.num_host_pages, self.storage_fingerprint = info.num_host_pages, info.storage_fingerprint
        self.kv_bytes_per_page = info.kv_bytes_per_token * info.page_size
        self.on_gpu = info.device == "cuda"
        args.max_running_requests = info.max_running_requests  # derived from the pool unless given

    def close(self) -> None:
        """Stop the workers (SIGTERM, then SIGKILL after 5 s)."""
        self._stop()
