"""The scheduler's LoRA adapters: which are loaded (in the workers' host memory) and which of
them sits in which of the ``--max-loras-per-batch`` device slots.

A request names its adapter when it arrives; it gets a slot when it is admitted. If its adapter
is not on the device, admission puts it into a slot no running request uses (an empty one, else
the least recently used), and the step's batch carries the copy (``lora_swap_slots``): the
worker makes it before that step's forward, after every earlier step's, so a step in flight
still reads what it was planned with. A request whose adapter finds no such slot waits while
later requests are admitted, and one slot (the one with the fewest running requests) stops
taking new ones until it empties, so the waiting request gets it. Pinned adapters keep their slot.

Unloading refuses the name to new requests at once; its host copy is dropped (``lora_drops``)
once no request names it. Each load gets a fresh key, and a request's prefix-cache tree is
keyed by it (``kv_salt``), so KV computed under one adapter is never served to another, nor to a
later adapter of the same name.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass

from minisgl.serve.scheduler.request import Req
from minisgl.wire.steps import ForwardBatch


@dataclass(frozen=True)
class Adapter:
    name: str
    path: str
    key: str  # its host copy on the workers, and the prefix-cache tree of its requests
    pinned: bool = False


class LoraError(ValueError):
    """A request or an adapter load refused as asked (the message says why)."""


class LoraRegistry:
    def __init__(self, slots: int, max_loaded: int | None = None):
        self.slots = slots
        self.max_loaded = max_loaded
        self.adapters: dict[str, Adapter] = {}
        self.slot_key: list[str | None] = [None] * slots  # the adapter on the device in each slot
        self.slot_users = [0] * slots  # running requests in each slot
        self.last_used = [0] * slots  # admission tick of each slot's latest request (LRU)
        self.pinned: set[str] = set()  # keys that keep their slot
        self.refs: Counter[str] = Counter()  # live requests (queued or running) per key
        self.unloaded: set[str] = set()  # keys unloaded while requests still named them
        self.swaps: list[tuple[int, str]] = []  # (slot, key) copies for the next batch
        # A slot admits no more requests while a request waits for one (so it empties: requests
        # of resident adapters arriving all the time would otherwise keep every slot busy).
        self.draining: int | None = None
        self.drain_for: str | None = None  # the waiting request's adapter (draining ends with its requests)
        self.drops: list[str] = []  # host copies the workers may free
        self._tick = 0

    # ---- loading -----------------------------------------------------------------------------

    def new(self, name: str, path: str, pinned: bool = False) -> Adapter:
        """The adapter a load will make (not registered until the workers have it)."""
        if name in self.adapters:
            raise LoraError(f"a LoRA adapter named {name!r} is already loaded: unload it first")
        if self.max_loaded is not None and len(self.adapters) >= self.max_loaded:
            raise LoraError(f"{self.max_loaded} LoRA adapters are loaded (--max-loaded-loras): unload one first")
        if pinned and len(self.pinned) + 1 >= self.slots:
            raise LoraError(f"at most {self.slots - 1} pinned adapters for {self.slots} slots (--max-loras-per-batch)")
        if pinned and self._free_slot() is None:
            raise LoraError("every adapter slot serves running requests: pin the adapter when fewer run")
        return Adapter(name, path, f"lora-{name}-{os.urandom(6).hex()}", pinned)

    def add(self, adapter: Adapter) -> None:
        self.adapters[adapter.name] = adapter
        if adapter.pinned:  # (``new`` saw a free slot; nothing has run since)
            self._put(self._free_slot(), adapter.key)
            self.pinned.add(adapter.key)

    def remove(self, name: str) -> None:
        """Refuse the name to new requests; free its slot and host copy once no request names it."""
        key = self.get(name).key
        del self.adapters[name]
        self.pinned.discard(key)
        self.unloaded.add(key)
        self._maybe_drop(key)

    def get(self, name: str) -> Adapter:
        adapter = self.adapters.get(name)
        if adapter is None:
            loaded = ", ".join(sorted(self.adapters)) or "none"
            raise LoraError(f"lora_path: no LoRA adapter named {name!r} is loaded (loaded: {loaded})")
        return adapter

    def paths(self) -> dict[str, str]:
        return {a.name: a.path for a in self.adapters.values()}

    # ---- requests ----------------------------------------------------------------------------

    def named(self, req: Req) -> None:
        """A request under an adapter was queued."""
        self.refs[req.lora_key] += 1

    def ended(self, req: Req) -> None:
        """A request under an adapter ended (once)."""
        self.refs[req.lora_key] -= 1
        self._maybe_drop(req.lora_key)

    def place(self, req: Req) -> bool:
        """Give an admitted request its adapter's slot, copying the adapter in if it is not on the
        device; False (nothing changed) when every slot serves running requests of other adapters."""
        if req.lora_key is None:
            return True
        self._tick += 1
        if self.draining is not None and not self.refs[self.drain_for]:
            self.draining = None  # nothing waits for it any more
        if req.lora_key in self.slot_key:
            slot = self.slot_key.index(req.lora_key)
            if slot == self.draining:
                return False
        else:
            slot = self._free_slot()
            if slot is None:
                if self.draining is None:  # the unpinned slot with the fewest running requests
                    busy = [s for s in range(self.slots) if self.slot_key[s] not in self.pinned]
                    self.draining = min(busy, key=lambda s: self.slot_users[s])
                    self.drain_for = req.lora_key
                return False
            self._put(slot, req.lora_key)
            if slot == self.draining:
                self.draining = None
        req.lora_slot, self.last_used[slot] = slot, self._tick
        return True

    def hold(self, req: Req) -> None:
        """The placed request runs: its slot is not given to another adapter until it stops."""
        if req.lora_slot >= 0:
            self.slot_users[req.lora_slot] += 1

    def let_go(self, req: Req) -> None:
        """The held request no longer runs (ended or retracted)."""
        if req.lora_slot >= 0:
            self.slot_users[req.lora_slot] -= 1
            req.lora_slot = -1

    def stamp(self, batch: ForwardBatch) -> None:
        """The copies into slots and the host copies to free, onto the next batch."""
        if self.swaps:
            batch.lora_swap_slots = [s for s, _ in self.swaps]
            batch.lora_swap_keys = [k for _, k in self.swaps]
            self.swaps = []
        if self.drops:
            batch.lora_drops, self.drops = self.drops, []

    # ---- slots -------------------------------------------------------------------------------

    def _free_slot(self) -> int | None:
        """A slot no running request uses and no pinned adapter holds: an empty one, else the
        least recently used."""
        free = [s for s in range(self.slots) if not self.slot_users[s] and self.slot_key[s] not in self.pinned]
        if not free:
            return None
        return min(free, key=lambda s: (self.slot_key[s] is not None, self.last_used[s]))

    def _put(self, slot: int, key: str) -> None:
        self.slot_key[slot] = key
        self.swaps.append((slot, key))

    def _maybe_drop(self, key: str) -> None:
        if key in self.unloaded and not self.refs[key]:
            self.unloaded.discard(key)
            del self.refs[key]
            if key in self.slot_key:
                self.slot_key[self.slot_key.index(key)] = None
            self.swaps = [(s, k) for s, k in self.swaps if k != key]
            self.drops.append(key)
