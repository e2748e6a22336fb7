"""Sampling: the parameters (torch-free, used by every process) and the batched sampler (worker
only, imported on first use so the tokenizer, scheduler and API processes never load torch)."""

from typing import Any

from minisgl.sampling.params import SamplingParams

__all__ = ["SamplingParams", "Sampler", "SampleOutput"]


def __getattr__(name: str) -> Any:
    if name in ("Sampler", "SampleOutput"):
        from minisgl.sampling import sampler

        return getattr(sampler, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
