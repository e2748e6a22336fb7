"""Tables of tuned kernel tiles (``kernels/configs/*.json``), one per GPU name, written by the
tuning scripts under ``benchmarks/``. A GPU takes the shapes its own table lacks from tables tuned
on the same chip (compute capability and SM count, kept in ``configs/chips.json``): an H200 or
H800 runs the H100's tiles, which fit the same SMs, shared memory and L2, rather than the
untuned defaults."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

CHIPS_PATH = Path(__file__).parents[1] / "kernels" / "configs" / "chips.json"


@functools.cache
def gpu(index: int) -> tuple[str, str]:
    """The name and chip (``sm90x132``) of GPU ``index``."""
    props = torch.cuda.get_device_properties(index)
    return props.name, f"sm{props.major}{props.minor}x{props.multi_processor_count}"


def read(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


@functools.cache
def table(path: Path, name: str, chip: str = "") -> dict:
    """GPU ``name``'s table in ``path`` ({shape: {bucket: tiles}}), completed bucket by bucket
    by those of other GPUs of the same ``chip`` (where two have a bucket, the first by name), so
    a GPU tuned at a few sizes keeps its chip's tiles at the others."""
    tables, chips = read(path), read(CHIPS_PATH)
    others = [t for t in sorted(tables) if t != name and chip and chips.get(t) == chip]
    merged: dict = {}
    for source in [*reversed(others), name]:  # later sources win
        for shape, buckets in tables.get(source, {}).items():
            merged[shape] = {**merged.get(shape, {}), **buckets}
    return merged


def record_chip(index: int = 0) -> None:
    """Note GPU ``index``'s chip beside its name (the tuning scripts call this), so that GPUs of
    the same chip find its tables."""
    name, chip = gpu(index)
    chips = read(CHIPS_PATH)
    chips[name] = chip
    CHIPS_PATH.write_text(json.dumps(chips, indent=1, sort_keys=True) + "\n")
