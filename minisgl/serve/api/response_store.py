"""Where the Responses API keeps stored responses: SQLite, in the API process's memory or in a
file that several servers share (``--responses-store``; the ``--dp-size`` replicas share one, so
a ``previous_response_id`` that the router sends to another replica is still found).

It keeps the latest ``MAX_STORED`` within ``MAX_STORED_BYTES``, oldest dropped first, and
finds a response only under its tenant's ``cache_salt``.
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from minisgl.serve.api.protocol import ChatMessageIn

MAX_STORED = 4096
MAX_STORED_BYTES = 256 << 20  # their JSON together: a count alone let large bodies grow the process


@dataclass
class Stored:
    response: dict[str, Any]
    messages: list[ChatMessageIn]  # this response's input and its answer, as chat messages
    previous: str | None
    salt: str | None  # the tenant's cache_salt: only requests with the same one see it
    size: int  # bytes it holds, about: its response and messages as JSON


_messages = msgspec.json.Decoder(list[ChatMessageIn])


class ResponseStore:
    """Stored responses in SQLite: in this process's memory (``:memory:``), or in a file (WAL:
    readers never wait for a writer) shared by every process that opens it. Rows are small and
    local, so calls are made inline."""

    def __init__(self, path: str = ":memory:", max_count: int = MAX_STORED, max_bytes: int = MAX_STORED_BYTES):
        self.max_count, self.max_bytes = max_count, max_bytes
        self.db = sqlite3.connect(path, timeout=5.0, isolation_level=None, check_same_thread=False)
        self._set_up(deadline=time.monotonic() + 10.0)

    def _set_up(self, deadline: float) -> None:
        """WAL mode and the table. Switching to WAL answers "locked" at once, without waiting
        for the lock, while another process opens the same file, so this retries until the
        deadline."""
        while True:
            try:
                self.db.execute("PRAGMA journal_mode=WAL")
                self.db.execute(
                    "CREATE TABLE IF NOT EXISTS responses (id TEXT PRIMARY KEY, salt TEXT, previous TEXT, "
                    "size INTEGER, response BLOB, messages BLOB)"
                )
                return
            except sqlite3.OperationalError as e:
                if "locked" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def close(self) -> None:
        self.db.close()

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
