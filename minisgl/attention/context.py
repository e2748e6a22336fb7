"""The attention backend the model's layers use during the current forward pass.

Model code stays free of cache plumbing: the runner installs a backend (with the step's
metadata prepared) and every attention layer fetches it here.
"""

from __future__ import annotations

from minisgl.attention.base import AttentionBackend

_backend: AttentionBackend | None = None


def set_attention_backend(backend: AttentionBackend | None) -> None:
    global _backend
    _backend = backend


def get_attention_backend() -> AttentionBackend:
    if _backend is None:
        raise RuntimeError("no attention backend installed; run the model through ModelRunner")
    return _backend
