"""The pool's embedded SQLite databases (stored responses, usage records): opened one way."""

from __future__ import annotations

import sqlite3
from pathlib import Path

# How long a statement waits for another connection's lock before it fails.
BUSY_TIMEOUT_S = 10.0


def open_database(path: Path, schema: str) -> sqlite3.Connection:
    """A connection to the database at ``path`` (created with ``schema`` where missing),
    in WAL mode so readers never wait for the writer, in autocommit (each statement or
    explicit transaction commits itself), usable from the worker threads Trio hands it to
    (one at a time: the caller's limiter sees to that)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(
        path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
    )
    db.execute("PRAGMA journal_mode=WAL")
    # Durable at each checkpoint, not each commit: a crash loses at most the last records.
    db.execute("PRAGMA synchronous=NORMAL")
    db.executescript(schema)
    return db
