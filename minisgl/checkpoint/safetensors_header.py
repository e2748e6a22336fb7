"""A safetensors file's header, read without trusting the file.

Weight updates and LoRA loads read files a trainer may still be writing, or anything a client
names. The safetensors library raises its own error types on a bad header and believes the
declared header length, so a file cut short, a header length of 2^62, a FIFO or a link to a
device would reach the worker as an exception nobody expects, or a read that never ends. Here the
file must be a regular file, its declared header must fit in it (and in ``MAX_HEADER``), and
every tensor's bytes must lie inside the file and match its shape and type: any other file is a
``CheckpointError`` naming the problem, before anything is loaded.
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path

MAX_HEADER = 100 << 20  # bytes of JSON (a 100k-tensor checkpoint's header is ~10 MB)
DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}  # fmt: skip
FLOAT_DTYPES = frozenset(d for d in DTYPE_BYTES if d.startswith(("F", "BF")))


class CheckpointError(ValueError):
    """A checkpoint or adapter file that cannot be read as what it claims to be."""


def regular_file(path: Path, what: str = "file") -> os.stat_result:
    """The stat of ``path`` (links followed), if it is a regular file: a FIFO or a device would
    block or never end when read."""
    try:
        info = os.stat(path)
    except OSError as e:
        raise CheckpointError(f"{what} {path.name!r}: {e.strerror or e}") from None
    if not stat.S_ISREG(info.st_mode):
        raise CheckpointError(f"{what} {path.name!r} is not a regular file (a FIFO, a device or a link to one)")
    return info


def read_json(path: Path, what: str, limit: int = 1 << 20) -> object:
    """A small JSON file (a config), refused past ``limit`` bytes or nested too deeply to parse."""
    size = regular_file(path, what).st_size
    if size > limit:
        raise CheckpointError(f"{what} {path.name!r} has {size} bytes; at most {limit} are read")
    try:
        return json.loads(path.read_bytes())
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{what} {path.name!r} is not JSON this server reads ({type(e).__name__})") from None


def header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Each tensor's (dtype, shape) in a safetensors file, after checking that the header and
    every tensor's bytes lie inside the file."""
    size = regular_file(path, "safetensors file").st_size
    name = path.name
    if size < 8:
        raise CheckpointError(f"{name}: {size} bytes, too short for a safetensors file (cut short?)")
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n > size - 8:
            raise CheckpointError(f"{name}: declares a {n}-byte header; the file has {size} bytes (cut short?)")
        if n > MAX_HEADER:
            raise CheckpointError(f"{name}: declares a {n}-byte header; at most {MAX_HEADER} are read")
        raw = f.read(n)
    try:
        entries = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{name}: the header is not JSON ({type(e).__name__})") from None
    if not isinstance(entries, dict):
        raise CheckpointError(f"{name}: the header is not a JSON object")
    data = size - 8 - n
    out = {}
    for key, entry in entries.items():
        if key == "__metadata__":
            continue
        out[key] = _entry(name, key, entry, data)
    return out


def _entry(name: str, key: str, entry: object, data: int) -> tuple[str, tuple[int, ...]]:
    where = f"{name}: tensor {key[:200]!r}"
    if not isinstance(entry, dict):
        raise CheckpointError(f"{where} has no dtype, shape and data_offsets")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise CheckpointError(f"{where}: dtype {str(dtype)[:20]!r} is not one this server reads")
    ints = lambda v, n=None: (  # noqa: E731
        isinstance(v, list) and (n is None or len(v) == n) and all(type(x) is int and x >= 0 for x in v)
    )
    if not ints(shape) or not ints(offsets, 2) or offsets[0] > offsets[1]:
        raise CheckpointError(f"{where}: its shape or data_offsets are not non-negative integers")
    if offsets[1] > data:
        raise CheckpointError(f"{where}: its bytes end at {offsets[1]}, past the file's {data} (cut short?)")
    if offsets[1] - offsets[0] != math.prod(shape) * DTYPE_BYTES[dtype]:
        raise CheckpointError(f"{where}: {offsets[1] - offsets[0]} bytes for a {dtype} tensor of shape {shape}")
    return dtype, tuple(shape)
