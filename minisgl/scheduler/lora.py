"""The scheduler's LoRA adapters: which name lives in which of the workers' adapter slots.

Every loaded adapter stays on the device (``--max-loras-per-batch`` slots), so any mix of them
runs in one batch and admission never waits for an adapter to be swapped in. A request names its
adapter when it arrives and keeps that adapter's slot until it ends: unloading a name refuses new
requests at once, and its slot takes another adapter only once no request holds it any more.
Each load gets a fresh key, and a request's prefix-cache tree is keyed by it (``kv_salt``), so
KV computed under one adapter is never served to another, nor to a later adapter of the same name.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

from minisgl.scheduler.request import Req


@dataclass(frozen=True)
class Adapter:
    name: str
    path: str
    slot: int
    key: str  # the prefix-cache tree of its requests: unique per load (and per process)


class LoraError(ValueError):
    """A request or an adapter load refused as asked (the message says why)."""


class LoraRegistry:
    def __init__(self, slots: int):
        self.slots = slots
        self.adapters: dict[str, Adapter] = {}

    def get(self, name: str) -> Adapter:
        adapter = self.adapters.get(name)
        if adapter is None:
            loaded = ", ".join(sorted(self.adapters)) or "none"
            raise LoraError(f"lora_path: no LoRA adapter named {name!r} is loaded (loaded: {loaded})")
        return adapter

    def free_slot(self, name: str, live: Iterable[Req]) -> int:
        """A slot for a new adapter: held by no loaded adapter and by no live request."""
        if name in self.adapters:
            raise LoraError(f"a LoRA adapter named {name!r} is already loaded: unload it first")
        busy = {a.slot for a in self.adapters.values()} | {r.lora_slot for r in live}
        for slot in range(self.slots):
            if slot not in busy:
                return slot
        raise LoraError(
            f"all {self.slots} adapter slots (--max-loras-per-batch) hold adapters or serve running requests: "
            "unload an adapter (its slot frees once its requests end)"
        )

    def add(self, name: str, path: str, slot: int) -> Adapter:
        adapter = Adapter(name, path, slot, f"lora-{name}-{os.urandom(6).hex()}")
        self.adapters[name] = adapter
        return adapter

    def remove(self, name: str) -> None:
        self.get(name)
        del self.adapters[name]

    def paths(self) -> dict[str, str]:
        return {a.name: a.path for a in self.adapters.values()}
