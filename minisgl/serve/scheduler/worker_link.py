"""Worker processes as a Scheduler's executor (``WorkerLink``): each batch goes to every
tensor-parallel rank, each step's tokens come back from rank 0. The scheduler process drives the
launcher's workers this way; the offline API's own ranks are ``worker.spawn.WorkerGroup``."""

from __future__ import annotations

import zmq

from minisgl.wire.control import WorkerReply
from minisgl.wire.ipc import Addresses, Receiver, Sender
from minisgl.wire.steps import DraftIds, ForwardBatch, SampleMasks, StepOutput, ToWorker, WorkerTask


class WorkerLink:
    """Sockets to the workers at ``addrs``: ``launch``, ``fill_drafts``, ``sample_masked``,
    ``oldest_done`` and ``collect``, as a ModelRunner has them."""

    def __init__(self, addrs: Addresses, tp_size: int):
        ctx = zmq.Context.instance()
        self.results: Receiver[StepOutput | WorkerReply] = Receiver(ctx, addrs.worker_out, StepOutput | WorkerReply)
        self.ranks = [Sender(ctx, addrs.worker(r), bind=addrs.is_remote(r)) for r in range(tp_size)]

    def broadcast(self, msg: ToWorker) -> None:
        for rank in self.ranks:
            rank.send(msg)

    def launch(self, batch: ForwardBatch) -> None:
        self.broadcast(batch)

    def fill_drafts(self, ids: list[int]) -> None:
        self.broadcast(DraftIds(ids))

    def sample_masked(self, bitmask: bytes) -> None:
        self.broadcast(SampleMasks(bitmask))

    def oldest_done(self) -> bool:
        """Whether ``collect`` would return without waiting (rank 0 sent the oldest step's tokens)."""
        return self.results.waiting()

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
