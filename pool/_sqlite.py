"""The pool's embedded SQLite databases (stored responses, usage records): opened one way."""

from __future__ import annotations

import errno
import sqlite3
from collections.abc import Mapping
from pathlib import Path

# How long a statement waits for another connection's lock before it fails.
BUSY_TIMEOUT_S = 10.0


def open_database(
    path: Path, schema: str, added: Mapping[str, Mapping[str, str]] | None = None
) -> sqlite3.Connection:
    """A connection to the database at ``path`` (created with ``schema`` where missing),
    in WAL mode so readers never wait for the writer, in autocommit (each statement or
    explicit transaction commits itself), usable from the worker threads Trio hands it to
    (one at a time: the caller's limiter sees to that). ``added``: per table, the columns
    added after it first shipped (:func:`add_columns`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(
        path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
    )
    db.execute("PRAGMA journal_mode=WAL")
    # Durable at each checkpoint, not each commit: a crash loses at most the last records.
    db.execute("PRAGMA synchronous=NORMAL")
    db.executescript(schema)
    for table, columns in (added or {}).items():
        add_columns(db, table, dict(columns))
    return db


# What a full (or write-refusing) filesystem looks like: SQLite's "database or disk is
# full", its I/O errors (a write cut short by a file-size limit, EFBIG), a file it could
# not create; or the OS's own error where Python touched the file first.
_STORAGE_SQLITE_CODES = {
    getattr(sqlite3, name)
    for name in ("SQLITE_FULL", "SQLITE_IOERR", "SQLITE_CANTOPEN")
    if hasattr(sqlite3, name)
}
_STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO}


def is_storage_failure(exc: BaseException) -> bool:
    """Whether ``exc`` says the disk under a database is full or refuses writes (as
    opposed to a bad statement or a lock held too long)."""
    if isinstance(exc, sqlite3.Error):
        code = getattr(exc, "sqlite_errorcode", None)
        if isinstance(code, int) and (code & 0xFF) in _STORAGE_SQLITE_CODES:
            return True
        text = str(exc)
        return "disk is full" in text or "disk I/O error" in text or "unable to open" in text
    return isinstance(exc, OSError) and exc.errno in _STORAGE_ERRNOS


def add_columns(db: sqlite3.Connection, table: str, columns: dict[str, str]) -> None:
    """Add the ``columns`` (name: declaration) that ``table`` lacks: a database written by
    an older pool gains the columns added since, its rows taking each one's default.

    ``CREATE TABLE IF NOT EXISTS`` leaves an existing table as it was, so every column
    added after a table first shipped is listed here too, never only in the schema."""
    present = {row[1] for row in db.execute(f"PRAGMA table_info({table})")}
    for name, declaration in columns.items():
        if name in present:
            continue
        try:
            db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {declaration}")
        except sqlite3.OperationalError as exc:
            # Another process added it between the look and the change.
            if "duplicate column" not in str(exc):
                raise
