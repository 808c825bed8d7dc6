"""The usage database: one row per finished request, in SQLite under the state directory.

The file is ``usage.sqlite3`` beside the pool's other state. The writer
(``_usage.py``) appends whole batches in one transaction and prunes rows past the
retention; queries (``GET /v1/admin/usage``, ``llm-pool usage``) sum rows by key,
tenant or model over a time range, optionally per UTC hour or day.

sqlite3 blocks, so every call runs in a worker thread. Writes and reads have a
connection each (WAL lets a reader go on while a batch is written), and each
connection is used by one thread at a time (its own ``CapacityLimiter``). WAL with
``synchronous=NORMAL`` as in ``pool/http/openai_responses/_store.py``: a power cut may lose the
last batches, never the file.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import trio

from pool._sqlite import open_database

FILE_NAME = "usage.sqlite3"
_SCHEMA = """
CREATE TABLE IF NOT EXISTS usage (
    at REAL NOT NULL,
    key TEXT,
    tenant TEXT NOT NULL,
    model TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    cached_tokens INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL,
    queue_ms REAL NOT NULL,
    generation_ms REAL,
    status TEXT NOT NULL,
    audio_seconds REAL NOT NULL DEFAULT 0,
    characters INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS usage_at ON usage (at);
"""
# The columns added after the table first shipped (a file an older pool wrote gains
# them when opened; its rows count 0): the seconds of audio transcribed, the
# characters of speech input (issue #41) and the seconds of loading caused (#46).
_ADDED = {
    "usage": {
        "audio_seconds": "REAL NOT NULL DEFAULT 0",
        "characters": "INTEGER NOT NULL DEFAULT 0",
        # Seconds of model loading a request caused (it found its model unloaded).
        "load_seconds": "REAL NOT NULL DEFAULT 0",
    }
}
# The columns in the order INSERT gives them.
_COLUMNS = (
    "at, key, tenant, model, prompt_tokens, cached_tokens, output_tokens, queue_ms,"
    " generation_ms, status, audio_seconds, characters, load_seconds"
)
_PLACEHOLDERS = ", ".join("?" for _ in _COLUMNS.split(","))

GroupBy = Literal["key", "tenant", "model"]
Bucket = Literal["hour", "day"]
GROUPS: tuple[GroupBy, ...] = ("key", "tenant", "model")
BUCKET_SECONDS: dict[Bucket, int] = {"hour": 3600, "day": 86400}
BUCKETS: tuple[Bucket, ...] = tuple(BUCKET_SECONDS)


@dataclass(frozen=True, slots=True)
class UsageRecord:
    """One finished request (success, error or cancel), as the usage database keeps it.

    ``at`` is when it finished (seconds since the epoch); ``status`` is ``success``,
    ``cancelled`` or the error code it ended with.
    """

    at: float
    key: str | None
    tenant: str
    model: str
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    # The pool's timer names; the table's columns keep their names (queue_ms,
    # generation_ms), which operators' queries use (docs/operations.md).
    queue_wait_ms: float
    generate_ms: float | None
    status: str
    # The seconds of audio a transcription was given (0 for everything else).
    audio_seconds: float = 0.0
    # Text a speech model said (its input's characters); 0 for the other kinds.
    characters: int = 0
    # Seconds of model loading the request caused (0: it found its model loaded).
    load_seconds: float = 0.0

    @property
    def tokens(self) -> int:
        """What budgets count: prompt plus output tokens."""
        return self.prompt_tokens + self.output_tokens


@dataclass(frozen=True, slots=True)
class UsageTotal:
    """The sums of one group (and, bucketed, of one hour or day starting at ``bucket``)."""

    group: str | None
    bucket: float | None
    requests: int
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    audio_seconds: float = 0.0
    characters: int = 0
    load_seconds: float = 0.0


class UsageStore:
    """Usage rows in the SQLite file ``path`` (created with its folder on first use)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._connections: dict[str, sqlite3.Connection] = {}
        self._opening = threading.Lock()
        # Each connection is used by one thread at a time: the writer's thread holds
        # write_limiter (UsageRecorder is given it), queries hold the read limiter, and
        # closing holds both, so no connection is ever closed under a running statement
        # (sqlite3 can crash the process then), even one whose caller stopped waiting.
        self.write_limiter = trio.CapacityLimiter(1)
        self._read_limiter = trio.CapacityLimiter(1)

    def _connection(self, role: str) -> sqlite3.Connection:
        with self._opening:
            db = self._connections.get(role)
            if db is None:
                db = open_database(self.path, _SCHEMA, _ADDED)
                self._connections[role] = db
            return db

    # -- blocking calls (run them in a worker thread) ----------------------------------
    def append(self, records: Sequence[UsageRecord]) -> None:
        """Add ``records`` in one transaction."""
        rows = [
            (
                r.at,
                r.key,
                r.tenant,
                r.model,
                r.prompt_tokens,
                r.cached_tokens,
                r.output_tokens,
                r.queue_wait_ms,
                r.generate_ms,
                r.status,
                r.audio_seconds,
                r.characters,
                r.load_seconds,
            )
            for r in records
        ]
        db = self._connection("write")
        with db:
            db.execute("BEGIN IMMEDIATE")
            if rows:
                db.executemany(f"INSERT INTO usage ({_COLUMNS}) VALUES ({_PLACEHOLDERS})", rows)

    def prune(self, before: float) -> int:
        """Delete rows that finished before ``before``; how many went."""
        db = self._connection("write")
        with db:
            return db.execute("DELETE FROM usage WHERE at < ?", (before,)).rowcount

    def totals(
        self,
        group_by: GroupBy,
        *,
        since: float | None = None,
        until: float | None = None,
        bucket: Bucket | None = None,
    ) -> list[UsageTotal]:
        """Sums per ``group_by`` value of the rows with ``since <= at < until``; with
        ``bucket``, per UTC hour or day too (the epoch starts a UTC day, so whole
        multiples of the bucket's seconds are UTC boundaries)."""
        if group_by not in GROUPS:
            raise ValueError(f"group_by must be one of {GROUPS}")
        # The column name comes from the fixed list above, never from the caller's text.
        column = group_by
        start = "NULL"
        if bucket is not None:
            size = BUCKET_SECONDS[bucket]
            start = f"CAST(at / {size} AS INTEGER) * {size}"
        where, params = [], []
        if since is not None:
            where.append("at >= ?")
            params.append(since)
        if until is not None:
            where.append("at < ?")
            params.append(until)
        sql = (
            f"SELECT {column}, {start} AS bucket, COUNT(*), SUM(prompt_tokens),"
            " SUM(cached_tokens), SUM(output_tokens), SUM(audio_seconds), SUM(characters),"
            " SUM(load_seconds) FROM usage"
            + (" WHERE " + " AND ".join(where) if where else "")
            + f" GROUP BY {column}, bucket ORDER BY bucket, {column}"
        )
        rows = self._connection("read").execute(sql, params).fetchall()
        return [
            UsageTotal(
                group=None if row[0] is None else str(row[0]),
                bucket=None if row[1] is None else float(row[1]),
                requests=int(row[2]),
                prompt_tokens=int(row[3]),
                cached_tokens=int(row[4]),
                output_tokens=int(row[5]),
                audio_seconds=round(float(row[6] or 0.0), 3),
                characters=int(row[7] or 0),
                load_seconds=float(row[8] or 0.0),
            )
            for row in rows
        ]

    def close(self) -> None:
        """Close both connections (blocking: only when no other thread uses them; from
        Trio, :meth:`aclose`)."""
        with self._opening:
            connections, self._connections = self._connections, {}
        for db in connections.values():
            db.close()

    # -- the same from Trio -------------------------------------------------------------
    async def aclose(self) -> None:
        """Close both connections once no statement runs on them. A caller cancelled
        while a stalled write still runs leaves them open (to be collected later)
        rather than close them under it."""
        async with self._read_limiter:
            await trio.to_thread.run_sync(self.close, limiter=self.write_limiter)

    async def query(self, group_by: GroupBy, **window: Any) -> list[UsageTotal]:
        """:meth:`totals` in a worker thread."""
        return await trio.to_thread.run_sync(
            lambda: self.totals(group_by, **window),
            limiter=self._read_limiter,
            abandon_on_cancel=True,
        )
