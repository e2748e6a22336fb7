"""Where the Responses API keeps stored responses: in the API process's memory, or in a SQLite
file that several servers share (``--responses-store``; the ``--dp-size`` replicas share one, so
a ``previous_response_id`` that the router sends to another replica is still found).

Either keeps the latest ``MAX_STORED`` within ``MAX_STORED_BYTES``, oldest dropped first, and
finds a response only under its tenant's ``cache_salt``.
"""

from __future__ import annotations

import sqlite3
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgspec

from minisgl.api.protocol import ChatMessageIn

MAX_STORED = 4096
MAX_STORED_BYTES = 256 << 20  # their JSON together: a count alone let large bodies grow the process


@dataclass
class Stored:
    response: dict[str, Any]
    messages: list[ChatMessageIn]  # this response's input and its answer, as chat messages
    previous: str | None
    salt: str | None  # the tenant's cache_salt: only requests with the same one see it
    size: int  # bytes it holds, about: its response and messages as JSON


class ResponseStore:
    """Stored responses in this process, oldest first."""

    def __init__(self, max_count: int = MAX_STORED, max_bytes: int = MAX_STORED_BYTES):
        self.max_count, self.max_bytes = max_count, max_bytes
        self.items: OrderedDict[str, Stored] = OrderedDict()
        self.bytes = 0

    def put(self, rid: str, stored: Stored) -> None:
        self.items[rid] = stored
        self.bytes += stored.size
        while len(self.items) > self.max_count or self.bytes > self.max_bytes:
            self.bytes -= self.items.popitem(last=False)[1].size

    def get(self, rid: str, salt: str | None) -> Stored | None:
        stored = self.items.get(rid)
        return stored if stored is not None and stored.salt == salt else None

    def pop(self, rid: str) -> None:
        self.bytes -= self.items.pop(rid).size


_messages = msgspec.json.Decoder(list[ChatMessageIn])


class SqliteResponseStore:
    """Stored responses in a SQLite file (WAL: readers never wait for a writer), shared by every
    process that opens it; rows are small and local, so calls are made inline."""

    def __init__(self, path: str, max_count: int = MAX_STORED, max_bytes: int = MAX_STORED_BYTES):
        self.max_count, self.max_bytes = max_count, max_bytes
        self.db = sqlite3.connect(path, timeout=5.0, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute(
            "CREATE TABLE IF NOT EXISTS responses (id TEXT PRIMARY KEY, salt TEXT, previous TEXT, "
            "size INTEGER, response BLOB, messages BLOB)"
        )

    def put(self, rid: str, stored: Stored) -> None:
        row = (
            rid,
            stored.salt,
            stored.previous,
            stored.size,
            msgspec.json.encode(stored.response),
            msgspec.json.encode(stored.messages),
        )
        with self.db:  # one transaction: the insert and the trim
            self.db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?)", row)
            count, total = self.db.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM responses").fetchone()
            drop = []
            for rowid, size in self.db.execute("SELECT rowid, size FROM responses ORDER BY rowid"):
                if count - len(drop) <= self.max_count and total <= self.max_bytes:
                    break
                drop.append((rowid,))
                total -= size
            self.db.executemany("DELETE FROM responses WHERE rowid = ?", drop)

    def get(self, rid: str, salt: str | None) -> Stored | None:
        row = self.db.execute(
            "SELECT response, messages, previous, salt, size FROM responses WHERE id = ? AND salt IS ?", (rid, salt)
        ).fetchone()
        if row is None:
            return None
        return Stored(msgspec.json.decode(row[0]), _messages.decode(row[1]), row[2], row[3], row[4])

    def pop(self, rid: str) -> None:
        self.db.execute("DELETE FROM responses WHERE id = ?", (rid,))


def open_store(path: str | None) -> ResponseStore | SqliteResponseStore:
    return ResponseStore() if path is None else SqliteResponseStore(path)
