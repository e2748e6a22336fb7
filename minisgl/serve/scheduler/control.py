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

from typing import TYPE_CHECKING

from minisgl.config.args import parse_lora_paths
from minisgl.serve.scheduler.lora import Adapter, LoraError
from minisgl.serve.scheduler.request import Req, ReqEvent
from minisgl.wire.control import (
    BroadcastWeights,
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
    """Mixed into ``Scheduler``."""

    def _queue(self: Scheduler, req: Req, front: bool = False) -> None:
        """Queue a request under the current weights' tree of the cache."""
        self.waiting.rekey(req, self.kv_salt(req))
        self.waiting.push(req, self.counters.steps, front=front)

    def kv_salt(self: Scheduler, req: Req) -> str | None:
        """The cache tree of the request's ``cache_salt`` and LoRA adapter under the current
        weights (the salt itself without an adapter until the first update)."""
        salt = req.options.cache_salt or None
        if req.lora_key is not None:
            salt = f"{salt or ''}\x00{req.lora_key}"
        if not self.weights_epoch:
            return salt
        return f"{salt or ''}\x00weights-{self.weights_epoch}-{self._epoch_tag}"

    def collect_inflight(self: Scheduler) -> None:
        """Process every launched step, so the workers are idle (outputs become events)."""
        got: list[Req] = []
        while self.inflight:
            got += self._process(self.inflight.popleft())
        self.events += [ReqEvent("output", req) for req in got]

    # ---- generation --------------------------------------------------------------------------

    def pause(self: Scheduler, mode: str = "abort") -> int:
        """Stop running requests until ``resume``: ``abort`` ends every request with what it
        produced so far, ``retract`` sends running ones back to the queue (they recompute
        their KV, under new weights if any came), ``in_place`` keeps them and their KV. Requests
        arriving meanwhile wait in the queue. Returns how many requests were held or ended."""
        if mode not in PAUSE_MODES:
            raise ControlError(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        self.collect_inflight()
        self.paused = True
        count = len(self.running) + len(self.waiting) + len(self.compiling)
        if mode == "abort":
            self.abort_all()
        elif mode == "retract":
            for req in reversed(self.running):  # each goes in front: the oldest ends up first
                self._retract(req)
            self._retracted_tokens = []
        return count

    def resume(self: Scheduler) -> None:
        self.paused = False

    def abort_all(self: Scheduler) -> int:
        """End every request (running, queued, compiling) with finish_reason abort and its
        outputs so far; returns how many."""
        self.collect_inflight()
        reqs = [*self.running, *self.waiting.requests(), *self.compiling]
        for req in reqs:
            self.finish(req, "abort")
            self.events.append(ReqEvent("aborted", req))
        return len(reqs)

    # ---- weights and memory ------------------------------------------------------------------

    def run_task(self: Scheduler, task: WorkerTask | LocalTensors, flush_cache: bool = True) -> WorkerReply:
        """Run a worker task between steps; an accepted update starts a new cache epoch. Raises
        ControlError when the engine's state refuses it (the workers never see it)."""
        self.collect_inflight()
        if isinstance(task, MemoryOccupation):
            return self._memory(task)
        if "weights" in self.released and isinstance(task, (*UPDATES, ReadWeights)):
            raise ControlError("the weights are released: resume_memory_occupation with tag weights first")
        reply = self.executor.run_task(task)
        if reply.ok and isinstance(task, UPDATES):
            self.new_weights(flush_cache)
        return reply

    def new_weights(self: Scheduler, flush_cache: bool = True) -> None:
        """New weights serve from now on: queued requests move to the new epoch's tree of the
        cache; with ``flush_cache`` every page no running request holds is freed now."""
        self.weights_epoch += 1
        for req in self.waiting.requests():
            self.waiting.rekey(req, self.kv_salt(req))
        if flush_cache:
            self.drop_cache()

    def drop_cache(self: Scheduler) -> None:
        """Free every cached page no running request holds (all of them when none runs)."""
        self.drain()
        if not (self.running or self.inflight):
            self.allocator.free(self.cache.reset())
        else:
            self.allocator.free(self.cache.evict(self.cache.size_info().evictable))

    # ---- LoRA adapters -----------------------------------------------------------------------

    def lora_adapter(self: Scheduler, name: str | None) -> Adapter | None:
        """The loaded adapter a request names (None: none named); ValueError naming what is wrong."""
        if name is None:
            return None
        if self.loras is None:
            raise LoraError("lora_path needs a server started with --enable-lora (or --lora-paths)")
        return self.loras.get(name)

    def load_lora(
        self: Scheduler, name: str, path: str, pinned: bool = False, tensors: LoadLora | LocalLora | None = None
    ) -> WorkerReply:
        """Read an adapter (the folder at ``path``, or ``tensors``: its key is set here) into
        every worker's host memory, between steps; a pinned one also takes a device slot for good."""
        if self.loras is None:
            raise ControlError("LoRA adapters need a server started with --enable-lora")
        if not name or not (path or tensors):
            raise ControlError("lora_name and lora_path must both be given")
        self.collect_inflight()
        try:
            adapter = self.loras.new(name, path or "<tensors>", pinned)
        except LoraError as e:
            raise ControlError(str(e)) from None
        task = tensors or LoadLora(adapter.key, path)
        task.key = adapter.key
        reply = self.executor.run_task(task)
        if reply.ok:
            self.loras.add(adapter)
        return reply

    def unload_lora(self: Scheduler, name: str) -> None:
        """Refuse the adapter to new requests; its slot and host copy go once no request names it."""
        if self.loras is None:
            raise ControlError("LoRA adapters need a server started with --enable-lora")
        try:
            self.loras.remove(name)
        except LoraError as e:
            raise ControlError(str(e)) from None

    def load_startup_loras(self: Scheduler) -> None:
        """--lora-paths, loaded before the first request."""
        for name, path, pinned in parse_lora_paths(self.args.lora_paths or []):
            reply = self.load_lora(name, path, pinned)
            if not reply.ok:
                raise ValueError(f"--lora-paths {name}={path}: {reply.message}")

    def _lora_ended(self: Scheduler, req: Req) -> None:
        """A request under an adapter ended: the adapter's host copy may go if it was unloaded."""
        if req.lora_key is not None and self.loras is not None:
            self.loras.ended(req)

    def _memory(self: Scheduler, task: MemoryOccupation) -> WorkerReply:
        unknown = sorted(set(task.tags) - set(MEMORY_TAGS))
        if unknown:
            raise ControlError(f"tags: unknown {unknown} ({', '.join(MEMORY_TAGS)})")
        if task.release and self.running and {"weights", "kv_cache"} & set(task.tags):
            raise ControlError(
                f"{len(self.running)} requests hold KV pages: pause_generation with mode abort or "
                "retract (or let them finish) before releasing memory"
            )
        if task.release and "kv_cache" in task.tags and "kv_cache" not in self.released:
            self.drop_cache()  # the pool's contents go with its memory
        reply = self.executor.run_task(task)
        if reply.ok:
            self.released = (self.released | set(task.tags)) if task.release else (self.released - set(task.tags))
        return reply
