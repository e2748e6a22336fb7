"""The worker side: a rank's model runner (torch), imported on first use so that the launcher
can import this package's process entry point (``worker.spawn``) without torch."""

from typing import Any

__all__ = ["ModelRunner"]


def __getattr__(name: str) -> Any:
    if name == "ModelRunner":
        from minisgl.worker.model_runner import ModelRunner

        return ModelRunner
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
