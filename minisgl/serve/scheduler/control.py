"""The scheduler's side of the RL control plane: pausing and continuing generation, weight
updates and memory release, loading and unloading LoRA adapters (``scheduler.lora``), and what
each means for requests and for the prefix cache.

A task for the workers (new weights, memory) runs between steps: every step in flight is
collected first, so no batch ever runs on half-updated weights. After new weights the prefix
cache starts a new epoch: requests queued from then on match and fill a tree of their own
(``Req.kv_salt``), so KV computed under older weights is never served, while requests that keep
running in place still publish into the tree of the weights they started under. ``flush_cache``
frees the old epochs' unlocked pages at once instead of leaving them to eviction.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from minisgl.config.args import parse_lora_paths
from minisgl.serve.scheduler.lora import LoraError
from minisgl.serve.scheduler.request import Req, ReqEvent
from minisgl.wire.control import (
    BroadcastWeights,
    CheckWeights,
    DropLoras,
    LoadLora,
    LoadWeights,
    LocalLora,
    LocalTensors,
    MemoryOccupation,
    ReadWeights,
    TensorWeights,
    WorkerReply,
)
from minisgl.wire.steps import WorkerTask

if TYPE_CHECKING:
    from minisgl.serve.scheduler.scheduler import Scheduler

PAUSE_MODES = ("abort", "retract", "in_place")
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
UPDATES = (LoadWeights, TensorWeights, BroadcastWeights, LocalTensors)


class ControlError(ValueError):
    """A control request refused as asked (the message says why); nothing changed."""


class ControlPlane:
    """What the control routes ask of a scheduler, between its steps; the scheduler holds one
    (``Scheduler.control``) and reads ``held`` and ``weights_epoch`` from it."""

    def __init__(self, sched: Scheduler):
        self.sched = sched
        # A pause holds every request where it is; released memory ("weights", "kv_cache") holds
        # them too. Each weight update starts a new epoch of the prefix cache (``kv_salt``),
        # tagged per process so the disk tier never mixes them.
        self.paused = False
        self.released: set[str] = set()
        self.weights_epoch = 0
        self.epoch_tag = os.urandom(4).hex()

    @property
    def held(self) -> bool:
        """No request may run: paused, or the weights or KV pool are released."""
        return self.paused or bool(self.released & {"weights", "kv_cache"})

    def collect_inflight(self) -> None:
        """Process every launched step, so the workers are idle (outputs become events)."""
        got: list[Req] = []
        while self.sched.inflight:
            got += self.sched._process(self.sched.inflight.popleft())
        self.sched.events += [ReqEvent("output", req) for req in got]

    # ---- generation --------------------------------------------------------------------------

    def pause(self, mode: str = "abort") -> int:
        """Stop running requests until ``resume``: ``abort`` ends every request with what it
        produced so far, ``retract`` sends running ones back to the queue (they recompute
        their KV, under new weights if any came), ``in_place`` keeps them and their KV. Requests
        arriving meanwhile wait in the queue. Returns how many requests were held or ended."""
        if mode not in PAUSE_MODES:
            raise ControlError(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        self.collect_inflight()
        self.paused = True
        count = len(self.sched.running) + len(self.sched.waiting) + len(self.sched.compiling)
        if mode == "abort":
            self.abort_all()
        elif mode == "retract":
            for req in reversed(self.sched.running):  # each goes in front: the oldest ends up first
                self.sched._retract(req)
            self.sched._retracted_tokens = []
        return count

    def resume(self) -> None:
        self.paused = False

    def abort_all(self) -> int:
        """End every request (running, queued, compiling) with finish_reason abort and its
        outputs so far; returns how many."""
        self.collect_inflight()
        reqs = [*self.sched.running, *self.sched.waiting.requests(), *self.sched.compiling]
        for req in reqs:
            self.sched.finish(req, "abort")
            self.sched.events.append(ReqEvent("aborted", req))
        return len(reqs)

    # ---- weights and memory ------------------------------------------------------------------

    def run_task(self, task: WorkerTask | LocalTensors, flush_cache: bool = True) -> WorkerReply:
        """Run a worker task between steps; an accepted update starts a new cache epoch. Raises
        ControlError when the engine's state refuses it (the workers never see it)."""
        self.collect_inflight()
        if isinstance(task, MemoryOccupation):
            return self._memory(task)
        if "weights" in self.released and isinstance(task, (*UPDATES, ReadWeights, CheckWeights)):
            raise ControlError("the weights are released: resume_memory_occupation with tag weights first")
        reply = self.sched.executor.run_task(task)
        reset = isinstance(task, CheckWeights) and task.action == "reset_tensors"
        if reply.ok and (isinstance(task, UPDATES) or reset):  # (a reset leaves random weights: new ones too)
            self.new_weights(flush_cache)
        return reply

    def new_weights(self, flush_cache: bool = True) -> None:
        """New weights serve from now on: queued requests move to the new epoch's tree of the
        cache; with ``flush_cache`` every page no running request holds is freed now."""
        self.weights_epoch += 1
        for req in self.sched.waiting.requests():
            self.sched.waiting.rekey(req, self.sched.kv_salt(req))
        if flush_cache:
            self.drop_cache()

    def drop_cache(self) -> None:
        """Free every cached page no running request holds (all of them when none runs)."""
        self.sched.drain()
        if not (self.sched.running or self.sched.inflight):
            self.sched.allocator.free(self.sched.cache.reset())
        else:
            self.sched.allocator.free(self.sched.cache.evict(self.sched.cache.size_info().evictable))

    # ---- LoRA adapters -----------------------------------------------------------------------

    def load_lora(
        self, name: str, path: str, pinned: bool = False, tensors: LoadLora | LocalLora | None = None
    ) -> WorkerReply:
        """Read an adapter (the folder at ``path``, or ``tensors``: its key is set here) into
        every worker's host memory, between steps; a pinned one also takes a device slot for good."""
        if self.sched.loras is None:
            raise ControlError("LoRA adapters need a server started with --enable-lora")
        if not name or not (path or tensors):
            raise ControlError("lora_name and lora_path must both be given")
        self.collect_inflight()
        try:
            adapter = self.sched.loras.new(name, path or "<tensors>", pinned)
        except LoraError as e:
            raise ControlError(str(e)) from None
        task = tensors or LoadLora(adapter.key, path)
        task.key = adapter.key
        reply = self.sched.executor.run_task(task)
        if reply.ok:
            self.sched.loras.add(adapter)
        return reply

    def unload_lora(self, name: str) -> None:
        """Refuse the adapter to new requests; its slot and host copy go once no request names it."""
        if self.sched.loras is None:
            raise ControlError("LoRA adapters need a server started with --enable-lora")
        try:
            self.sched.loras.remove(name)
        except LoraError as e:
            raise ControlError(str(e)) from None
        loras = self.sched.loras
        if loras.drops:  # (no request names it: its host copy goes now, not with the next step)
            self.collect_inflight()
            self.sched.executor.run_task(DropLoras(loras.drops))
            loras.drops = []

    def load_startup_loras(self) -> None:
        """--lora-paths, loaded before the first request."""
        for name, path, pinned in parse_lora_paths(self.sched.args.lora_paths or []):
            reply = self.load_lora(name, path, pinned)
            if not reply.ok:
                raise ValueError(f"--lora-paths {name}={path}: {reply.message}")

    def _memory(self, task: MemoryOccupation) -> WorkerReply:
        unknown = sorted(set(task.tags) - set(MEMORY_TAGS))
        if unknown:
            raise ControlError(f"tags: unknown {unknown} ({', '.join(MEMORY_TAGS)})")
        if task.release and self.sched.running and {"weights", "kv_cache"} & set(task.tags):
            raise ControlError(
                f"{len(self.sched.running)} requests hold KV pages: pause_generation with mode abort or "
                "retract (or let them finish) before releasing memory"
            )
        if task.release and "kv_cache" in task.tags and "kv_cache" not in self.released:
            self.drop_cache()  # the pool's contents go with its memory
        reply = self.sched.executor.run_task(task)
        if reply.ok:
            self.released = (self.released | set(task.tags)) if task.release else (self.released - set(task.tags))
        return reply
