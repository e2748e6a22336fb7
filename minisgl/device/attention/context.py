"""The attention backend the model's layers use during the current forward pass.

Model code stays free of cache plumbing: the runner installs a backend (with the step's
metadata prepared) and every attention layer fetches it here. Only a weak reference is kept,
so deleting the runner (``del llm``) frees its model and KV pool.
"""

from __future__ import annotations

import weakref

from minisgl.device.attention.base import AttentionBackend

_backend: weakref.ref[AttentionBackend] | None = None


def set_attention_backend(backend: AttentionBackend | None) -> None:
    global _backend
    _backend = None if backend is None else weakref.ref(backend)


def get_attention_backend() -> AttentionBackend:
    backend = _backend() if _backend is not None else None
    if backend is None:
        raise RuntimeError("no attention backend installed; run the model through ModelRunner")
    return backend
