"""Scheduler process: owns the Scheduler (radix cache, pages, batching) and drives the workers.

It takes tokenized requests, aborts and control questions from the tokenizer process, runs one
batch at a time on the worker(s), and sends every step's new tokens back to the tokenizer
process. When idle it blocks on its socket; every few seconds of activity it logs a stats line.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time

import zmq

from minisgl.config.args import EngineArgs
from minisgl.serve.scheduler.control import UPDATES, ControlError
from minisgl.serve.scheduler.grammar import GrammarBackend
from minisgl.serve.scheduler.output import prompt_scores
from minisgl.serve.scheduler.request import Req, ReqEvent
from minisgl.serve.scheduler.scheduler import Scheduler
from minisgl.serve.scheduler.worker_link import WorkerLink
from minisgl.serve.tokenizer import eos_ids, load_tokenizer
from minisgl.utils import init_logging, keep_torch_out
from minisgl.wire.control import CheckWeights, ControlReply, ControlReq, LoadLora, ReadWeights
from minisgl.wire.ipc import Addresses, Receiver, Sender, become_child
from minisgl.wire.requests import AbortReq, EngineInfo, TokenBatch, TokenizedBatch, TokenizedReq, TokenOut, ToScheduler

logger = logging.getLogger(__name__)

STATS_INTERVAL_S = 10.0


class SchedulerProcess:
    def __init__(self, args: EngineArgs, addrs: Addresses):
        self.args = args
        ctx = zmq.Context()
        self.inbox: Receiver[ToScheduler] = Receiver(ctx, addrs.scheduler, ToScheduler)
        self.tokenizer = Sender(ctx, addrs.tokenizer)
        self.workers = WorkerLink(addrs, args.tp_size)
        info = self.workers.results.recv_as(EngineInfo)  # the worker's first message: what it loaded
        tokenizer_path = args.tokenizer or info.model_path
        info.eos_ids = eos_ids(info.model_path, tokenizer_dir=tokenizer_path, overrides=args.model_overrides())
        args.max_running_requests = info.max_running_requests  # derived from the pool unless given
        info.weight_version = args.weight_version
        self.info = info
        # The tokenizer itself is loaded with the first grammar: this process stays torch-free.
        grammar = GrammarBackend(lambda: load_tokenizer(tokenizer_path), info.vocab_size, info.eos_ids)
        self.sched = Scheduler(
            args,
            info.num_pages,
            info.context_len,
            info.vocab_size,
            info.eos_ids,
            self.workers,
            grammar,
            info.num_host_pages,
            info.storage_fingerprint,
            info.kv_bytes_per_token * info.page_size,
            on_gpu=info.device == "cuda",
            snapshot_rows=info.snapshot_rows,
        )
        self.by_rid: dict[str, Req] = {}
        self.rid_of: dict[int, str] = {}
        self.outbox: list[TokenOut] = []
        self._aborted: list[Req] = []
        self._last_log, self._tokens_since_log, self._logged_steps = time.monotonic(), 0, 0
        self._turned = time.monotonic()  # when the main loop last came round
        self._in_control = False  # a control task (new weights, memory) runs: not a hung step
        info.speculative = self.sched.spec is not None
        info.lora_adapters = self.sched.loras.paths() if self.sched.loras is not None else {}
        self.tokenizer.send(info)

    # ---- messages ------------------------------------------------------------------------------

    def _handle(self, msg: ToScheduler) -> None:
        if isinstance(msg, TokenizedBatch):
            for item in msg.reqs:
                self._add(item)
        elif isinstance(msg, AbortReq):
            req = self.by_rid.get(msg.rid)
            if req is not None:
                self.sched.finish(req, msg.reason)
                self._aborted.append(req)  # forgotten once its queued events (its acceptance) are out
        elif isinstance(msg, ControlReq):
            self._in_control = True
            try:
                self.tokenizer.send(self._control(msg))
            finally:
                self._in_control, self._turned = False, time.monotonic()

    def _add(self, msg: TokenizedReq) -> None:
        try:
            req = self.sched.add_request(msg.input_ids, msg.sampling, msg.options)
        except ValueError as e:
            self.outbox.append(TokenOut(msg.rid, error=str(e)))
            return
        self.by_rid[msg.rid], self.rid_of[req.rid] = req, msg.rid

    def _control(self, msg: ControlReq) -> ControlReply:
        cid, sched = msg.cid, self.sched
        try:
            if msg.op == "stats":
                return ControlReply(cid, True, sched.stats())
            if msg.op == "flush_cache":
                ok = sched.flush_cache()
                return ControlReply(
                    cid,
                    ok,
                    {}
                    if ok
                    else {
                        "error": "requests are queued or running; flush when idle (or pause_generation with mode abort)"
                    },
                )
            if msg.op == "profile" and msg.profile is not None:
                self.workers.broadcast(msg.profile)
                return ControlReply(cid, True, {})
            if msg.op == "pause":
                return ControlReply(cid, True, {"num_paused_requests": sched.control.pause(msg.mode)})
            if msg.op == "continue":
                sched.control.resume()
                return ControlReply(cid, True, {})
            if msg.op == "weight_version":
                if msg.weight_version is not None:
                    if msg.abort_all:
                        sched.control.abort_all()
                    self.info.weight_version = msg.weight_version
                return ControlReply(cid, True, {"weight_version": self.info.weight_version})
            if msg.op == "weights" and msg.task is not None:
                return self._weights(msg)
            if msg.op in ("lora_load", "lora_unload"):
                return self._lora(msg)
            if msg.op == "check_weights" and isinstance(msg.task, CheckWeights):
                reply = sched.control.run_task(msg.task)
                data: dict = {"message": reply.message}
                if reply.values is not None:
                    data["ranks"] = reply.values
                return ControlReply(cid, reply.ok, data if reply.ok else {**data, "error": reply.message})
            if msg.op == "read_weights" and isinstance(msg.task, ReadWeights):
                reply = sched.control.run_task(msg.task)
                data = {"parameter": reply.values or []} if reply.ok else {"error": reply.message}
                return ControlReply(cid, reply.ok, data)
        except ControlError as e:
            return ControlReply(cid, False, {"error": str(e)})
        return ControlReply(cid, False, {"error": f"unknown control op {msg.op!r}"})

    def _weights(self, msg: ControlReq) -> ControlReply:
        """A worker task (an update, a memory release or resume) between steps."""
        sched = self.sched
        held = len(sched.running) + len(sched.waiting)
        if msg.abort_all:
            sched.control.abort_all()
        reply = sched.control.run_task(msg.task, msg.flush_cache)
        update = isinstance(msg.task, UPDATES)
        if reply.ok and update:
            if msg.weight_version is not None:
                self.info.weight_version = msg.weight_version
            if msg.keep_pause:
                sched.control.pause("in_place")
        data = {
            "message": reply.message,
            "seconds": reply.seconds,
            "weight_version": self.info.weight_version,
            "num_paused_requests": held,
        }
        return ControlReply(msg.cid, reply.ok, data if reply.ok else {**data, "error": reply.message})

    def _lora(self, msg: ControlReq) -> ControlReply:
        """Load or unload an adapter; the answer lists the loaded ones (JSON, name -> path)."""
        if msg.op == "lora_load":
            tensors = msg.task if isinstance(msg.task, LoadLora) else None  # (/load_lora_adapter_from_tensors)
            reply = self.sched.control.load_lora(msg.lora_name, msg.lora_path, msg.lora_pinned, tensors)
            ok, message = reply.ok, reply.message
        else:
            self.sched.control.unload_lora(msg.lora_name)
            ok, message = True, f"unloaded LoRA adapter {msg.lora_name!r}"
        data = {"message": message, "loaded_adapters": json.dumps(self.sched.loras.paths())}
        return ControlReply(msg.cid, ok, data if ok else {**data, "error": message})

    def _events(self, events: list[ReqEvent]) -> None:
        """Each request event as its message to the tokenizer process, in order: the first one
        says accepted (no tokens) or refused (its error), then one per step's output."""
        for kind, req, ended in events:
            if kind == "accepted":
                self.outbox.append(
                    TokenOut(self.rid_of[req.rid], finish_reason=req.finish_reason if ended else None, error=req.error)
                )
            elif kind == "aborted":  # the engine ended it: nothing new, just the finish
                if req.rid in self.rid_of:
                    self.outbox.append(
                        TokenOut(self.rid_of[req.rid], finish_reason=req.finish_reason, cached_tokens=req.cached_tokens)
                    )
                ended = True
            else:
                out = self._token_out(req)
                self.outbox.append(out)
                self._tokens_since_log += len(out.tokens)
                ended = req.finished
            if ended:
                self._forget(req)

    def _forget(self, req: Req) -> None:
        rid = self.rid_of.pop(req.rid, None)
        if rid is not None and self.by_rid.get(rid) is req:  # (a client may reuse an aborted request's rid)
            del self.by_rid[rid]

    def _token_out(self, req: Req) -> TokenOut:
        """The tokens since its last message: one a step, or several after a verify step."""
        new = slice(req.sent_tokens, None)
        req.sent_tokens = len(req.output_ids)
        out = TokenOut(
            self.rid_of[req.rid],
            req.output_ids[new],
            finish_reason=req.finish_reason,
            cached_tokens=req.cached_tokens,
            host_cached_tokens=req.host_cached_tokens,
            error=req.error,
        )
        if self.sched.spec is not None:  # each decode step gave one token and what it accepted
            out.spec = [len(req.output_ids) - 1 - req.spec_accepted, req.spec_drafted, req.spec_accepted]
        if req.options.top_logprobs >= 0:
            out.logprobs = req.output_logprobs[new]
        if req.options.entropy:
            out.entropy = req.output_entropy[new]
        if req.options.top_logprobs > 0:
            tops = req.output_top_logprobs[new]
            out.top_ids = [[t for t, _ in top] for top in tops]
            out.top_logprobs = [[lp for _, lp in top] for top in tops]
        if req.options.logprob_ids:
            out.id_logprobs = req.output_id_logprobs[new]
        if req.scores_prompt:
            out.input_start, scores = prompt_scores(req)
            out.input_logprobs = [lp for lp, _, _ in scores]
            if req.options.top_logprobs > 0:
                out.input_top_ids = [[t for t, _ in top] for _, top, _ in scores]
                out.input_top_logprobs = [[lp for _, lp in top] for _, top, _ in scores]
            if req.options.logprob_ids:
                out.input_id_logprobs = [ids for _, _, ids in scores]
        if req.capture_start >= 0 and req.finished:
            out.routed_experts, out.hidden_states = req.routed_experts(), req.hidden_states()
        return out

    # ---- main loop -----------------------------------------------------------------------------

    def watchdog(self, timeout: float) -> None:
        """Exit when the loop stops turning while there is work (a hung worker): the launcher
        then shuts the server down, its clients get errors and /health stops answering."""
        while True:
            time.sleep(min(timeout / 4, 5.0))
            stalled = time.monotonic() - self._turned
            if self.sched.has_work and stalled > timeout and not self._in_control:
                logger.error("no model step finished in %.0f s (--watchdog-timeout): exiting", stalled)
                os._exit(1)

    def run(self) -> None:
        while True:
            self._turned = time.monotonic()
            if self.sched.only_compiling:  # block briefly (zmq lets go of the GIL), then step
                first = self.inbox.recv(timeout_ms=5)
                msgs = ([first] if first is not None else []) + self.inbox.recv_all()
            elif self.sched.has_work:
                msgs = self.inbox.recv_all()
            else:
                first = self.inbox.recv(timeout_ms=int(STATS_INTERVAL_S * 1000))
                msgs = ([first] if first is not None else []) + self.inbox.recv_all()
            for msg in msgs:
                self._handle(msg)
            self._events(self.sched.step() if self.sched.has_work else self.sched.take_events())
            for req in self._aborted:
                self._forget(req)
            self._aborted = []
            if self.outbox:
                self.tokenizer.send(TokenBatch(self.outbox))
                self.outbox = []
            self._maybe_log_stats()

    def _maybe_log_stats(self) -> None:
        """Every STATS_INTERVAL_S while there is work, or every --decode-log-interval decode steps."""
        now = time.monotonic()
        every = self.args.decode_log_interval
        if every:
            steps = self.sched.counters.decode_steps
            if steps - self._logged_steps < every:
                return
            self._logged_steps = steps
        elif now - self._last_log < STATS_INTERVAL_S or not (self._tokens_since_log or self.sched.has_work):
            return
        s = self.sched.stats()
        host = ""
        if "host_total_pages" in s:  # the hierarchical cache: its share of the hits and its use
            used = s["host_total_pages"] - s["host_free_pages"]
            host = (
                f" ({100 * s['prefix_host_hit_tokens'] / max(s['prefix_queried_tokens'], 1):.1f}% from host, "
                f"host pool {100 * used / s['host_total_pages']:.1f}% used)"
            )
        if "spec_accept_length" in s:
            host += f", speculative accept length {s['spec_accept_length']:.2f}"
        logger.info(
            "running %d, queued %d, KV usage %.1f%% of %d pages, cache hit rate %.1f%%%s, %.1f tokens/s",
            s["running_requests"],
            s["queued_requests"],
            100 * s["kv_usage"],
            s["total_pages"],
            100 * s["cache_hit_rate"],
            host,
            self._tokens_since_log / (now - self._last_log),
        )
        self._last_log, self._tokens_since_log = now, 0


def run_scheduler(args: EngineArgs, addrs: Addresses, log_level: str, watchdog_timeout: float) -> None:
    """Process entry point (spawned by the launcher)."""
    become_child()
    keep_torch_out()
    init_logging(log_level)
    proc = SchedulerProcess(args, addrs)
    threading.Thread(target=proc.watchdog, args=(watchdog_timeout,), daemon=True, name="watchdog").start()
    proc.run()
