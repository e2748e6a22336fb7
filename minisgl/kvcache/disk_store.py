"""DiskStore: the hierarchical cache's storage tier, one file per KV page per rank.

A page's key is a hash chained over the token pages of its whole prefix, so the same prefix gets
the same key in any process: a restarted server, or another replica on this host, finds the
pages an earlier one wrote. Files live under a folder named by a fingerprint of what their
bytes mean (model, page size, KV layout and dtype, tensor-parallel size), so a different model
never reads them. Each file is a header (magic, key, payload length, CRC-32 of the payload) and
one host page's bytes; it is written to a temporary name and renamed, so readers never see half
a file, and a file whose header or checksum does not match is skipped and removed.

The scheduler finds and checks pages (``find``); the worker moves bytes (``read_into`` before
loading, ``write_from`` in the background once a page's host copy is done).
"""

from __future__ import annotations

import hashlib
import os
import struct
import uuid
import zlib
from pathlib import Path

MAGIC = b"MSGLKV01"
HEADER = struct.Struct("<8s32sQI")  # magic, key (sha256), payload bytes, crc32


def page_keys(
    ids: list[int], page_size: int, start_key: bytes = b"", start: int = 0, end: int | None = None
) -> list[bytes]:
    """Chained keys of the whole pages of ``ids[start:end]``, ``start_key`` being the key of the
    page before ``start`` (empty at the beginning)."""
    end = len(ids) if end is None else end
    keys, key = [], start_key
    for at in range(start, end - end % page_size, page_size):
        key = hashlib.sha256(key + struct.pack(f"<{page_size}q", *ids[at : at + page_size])).digest()
        keys.append(key)
    return keys


def fingerprint(**what: object) -> str:
    text = repr(sorted(what.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class DiskStore:
    def __init__(self, root: str, fingerprint: str, tp_size: int = 1):
        self.folder = Path(root) / fingerprint
        self.folder.mkdir(parents=True, exist_ok=True)
        self.tp_size = tp_size
        self.corrupt = 0  # files found bad and removed

    def path(self, key: bytes, rank: int) -> Path:
        name = key.hex()
        return self.folder / name[:2] / f"{name}.r{rank}"

    def _check(self, key: bytes, rank: int, page_bytes: int) -> bool:
        """Whether the file of this key and rank is whole and matches its checksum (a bad one
        is removed and counted)."""
        path = self.path(key, rank)
        try:
            data = path.read_bytes()
        except OSError:
            return False
        ok = len(data) == HEADER.size + page_bytes
        if ok:
            magic, stored_key, length, crc = HEADER.unpack_from(data)
            ok = (
                magic == MAGIC
                and stored_key == key
                and length == page_bytes
                and crc == zlib.crc32(memoryview(data)[HEADER.size :])
            )
        if not ok:
            self.corrupt += 1
            path.unlink(missing_ok=True)
        return ok

    def find(self, keys: list[bytes], page_bytes: int) -> int:
        """How many of ``keys``, in order, have a good file for every rank."""
        for n, key in enumerate(keys):
            if not self.exists(key) or not all(self._check(key, r, page_bytes) for r in range(self.tp_size)):
                return n
        return len(keys)

    def exists(self, key: bytes) -> bool:
        return all(self.path(key, r).is_file() for r in range(self.tp_size))

    # ---- the worker's side --------------------------------------------------------------------

    def read_into(self, key: bytes, rank: int, out: memoryview) -> None:
        """The payload of a file ``find`` checked, into ``out`` (one host page's bytes)."""
        with open(self.path(key, rank), "rb") as f:
            f.seek(HEADER.size)
            if f.readinto(out) != len(out):
                raise OSError(f"{self.path(key, rank)} was cut short after it was checked")

    def write_from(self, key: bytes, rank: int, data: memoryview) -> None:
        """Write one page (atomically: a temporary file renamed into place)."""
        path = self.path(key, rank)
        if path.is_file():
            return
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
        with open(tmp, "wb") as f:
            f.write(HEADER.pack(MAGIC, key, len(data), zlib.crc32(data)))
            f.write(data)
        os.replace(tmp, path)
