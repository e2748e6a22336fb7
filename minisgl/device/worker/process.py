"""GPU-worker process: one per tensor-parallel rank. Receives ForwardBatch messages from the
scheduler, runs them on its ModelRunner, and (rank 0 only) sends back the sampled tokens.

While a step runs the worker spins between its socket and the step's CUDA event, so a batch that
arrives meanwhile is launched behind it with no gap. Sampled tokens stay on the device as each
slot's ``last_token``, so the scheduler never has to send decode inputs back; all ranks sample
identically (the same all-reduced argmax in greedy steps, else the same logits after the all-gather
and the same counter-based noise), so only rank 0 reports.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import zmq

from minisgl.config.args import EngineArgs
from minisgl.device.distributed import set_tp_info
from minisgl.device.worker.model_runner import ModelRunner
from minisgl.device.worker.profiler import StepProfiler
from minisgl.utils import init_logging
from minisgl.wire.ipc import Addresses, Receiver, Sender, become_child, cpu_worker_threads
from minisgl.wire.requests import EngineInfo
from minisgl.wire.steps import DraftIds, ForwardBatch, ProfileReq, SampleMasks, ToWorker, WorkerTask

logger = logging.getLogger(__name__)


def _init_distributed(args: EngineArgs, rank: int, addrs: Addresses) -> None:
    if args.tp_size == 1:
        return
    on_gpu = args.device.startswith("cuda") or (args.device == "auto" and torch.cuda.is_available())
    device = None
    if on_gpu:
        args.device = f"cuda:{args.gpu_index(rank % args.ranks_per_node)}"  # this host's GPUs
        device = torch.device(args.device)  # NCCL binds its communicator here instead of guessing
    dist.init_process_group(
        "nccl" if on_gpu else "gloo",
        init_method=addrs.dist_init,
        rank=rank,
        world_size=args.tp_size,
        device_id=device,
    )
    set_tp_info(rank, args.tp_size, args.enable_fp32_all_reduce)


def engine_info(runner: ModelRunner) -> EngineInfo:
    """What the scheduler and the server learn of the engine once it is up (rank 0 sends it)."""
    return EngineInfo(
        model_path=str(runner.model_dir),
        num_pages=runner.num_pages,
        page_size=runner.page_size,
        context_len=runner.context_len,
        vocab_size=runner.vocab_size,
        max_running_requests=runner.args.max_running_requests,
        kv_cache_dtype=str(runner.kv_dtype).removeprefix("torch."),
        kv_bytes_per_token=runner.kv_bytes_per_page // runner.page_size,
        quantization=runner.config.quant.source if runner.config.quant is not None else None,
        num_host_pages=runner.num_host_pages,
        storage_fingerprint=runner.storage_fingerprint,
        device=runner.device.type,
        hidden_size=runner.hidden_size,
        **hybrid_info(runner),
    )


def hybrid_info(runner: ModelRunner) -> dict[str, int]:
    """A hybrid model's EngineInfo fields: where the snapshots' rows start and how many."""
    rows = runner.snapshot_rows
    if rows is None:
        return {}
    shape = runner.states.shape
    return {
        "state_snapshots": len(rows),
        "state_snapshot_row": rows[0] if rows else 0,
        "state_bytes_per_request": shape.bytes_per_slot(runner.states.ssm.dtype, runner.states.conv.dtype),
    }


def run_worker(args: EngineArgs, rank: int, addrs: Addresses, log_level: str) -> None:
    """Process entry point (spawned by the launcher)."""
    become_child(threads=cpu_worker_threads() // args.ranks_per_node or 1)
    # Each node's first rank speaks for its node; the others log only warnings, so each event is
    # one line.
    init_logging(log_level if rank % args.ranks_per_node == 0 else "warning")
    _init_distributed(args, rank, addrs)
    runner = ModelRunner(args)
    ctx = zmq.Context()
    remote = addrs.is_remote(rank)  # on another host: connects to the scheduler over TCP
    inbox: Receiver[ToWorker] = Receiver(ctx, addrs.worker(rank), ToWorker, bind=not remote)
    outbox = Sender(ctx, addrs.worker_out) if rank == 0 else None
    if outbox is not None:
        outbox.send(engine_info(runner))
    profiler = StepProfiler(rank, runner.device)
    while True:
        # Launch every batch as soon as it arrives (the scheduler sends step N+1 while step N
        # runs), and hand back each step's tokens once its device work is done.
        idle = not runner.pending
        msg = inbox.recv(timeout_ms=0 if not idle else 1000 if remote else None)
        if msg is None and idle:  # a remote rank's poll: is node 0 still there?
            if inbox.peer_gone():
                logger.info("rank %d: the scheduler at %s has gone; stopping", rank, addrs.worker(rank))
                return
            continue
        if isinstance(msg, ForwardBatch):
            runner.launch(msg)
            profiler.step()
        elif isinstance(msg, DraftIds):
            runner.fill_drafts(msg.ids)
        elif isinstance(msg, SampleMasks):
            runner.sample_masked(msg.bitmask)
        elif isinstance(msg, ProfileReq):
            profiler.handle(msg)
        elif isinstance(msg, WorkerTask):
            # The scheduler sends one once it has every step's tokens; ranks past 0 may not
            # have collected their last steps yet.
            while runner.pending:
                runner.collect()
            reply = runner.run_task(msg)
            if outbox is not None:
                outbox.send(reply)
        elif runner.oldest_done():
            result = runner.collect()
            if outbox is not None:
                outbox.send(result)
