"""Stored responses of ``/openai/v1/responses``: SQLite under the state directory.

A response created with ``store: true`` is kept with its input items, per tenant, so
``previous_response_id`` can continue it and ``GET``/``DELETE`` find it; one tenant
never reads another's (every statement names the tenant). Each row holds one
response's own input and output; a continuation walks the chain of
``previous_response_id`` back to its start.

Retention is bounded two ways: rows older than ``service.responses_retention_s`` are
neither read nor kept (each save removes them), and past
``service.responses_max_stored`` rows the oldest go.

sqlite3 blocks, so every statement runs in a worker thread, on one connection that the
store keeps, in WAL mode with ``synchronous=NORMAL`` (a power cut may lose the last
saves, never the file). Measured here, one save took 26 ms on a connection opened per
save with the default ``synchronous=FULL`` (each close checkpoints and syncs), and
0.13 ms this way.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from pool._sqlite import is_storage_failure, open_database
from pool.errors import PoolError

log = logging.getLogger("pool.http")

FILE_NAME = "responses.sqlite3"
# A chain longer than this is cut at its oldest end (a guard, not a policy).
MAX_CHAIN = 10_000
_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    tenant TEXT NOT NULL,
    id TEXT NOT NULL,
    created_at REAL NOT NULL,
    previous_id TEXT,
    input TEXT NOT NULL,
    response TEXT NOT NULL,
    PRIMARY KEY (tenant, id)
);
CREATE INDEX IF NOT EXISTS responses_created_at ON responses (created_at);
"""


@dataclass(frozen=True, slots=True)
class Turn:
    """One stored response of a chain: the items it was given and the items it made."""

    input: list[dict[str, Any]]
    output: list[dict[str, Any]]


class ResponseStore:
    """Responses by tenant and id, in the SQLite file ``path``.

    Args:
        retention_s: how long a response is kept.
        max_stored: most responses kept (all tenants together); the oldest go first.
        clock: seconds since the epoch (tests pass their own).
    """

    def __init__(
        self,
        path: Path,
        retention_s: float,
        max_stored: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = path
        self.retention_s = retention_s
        self.max_stored = max_stored
        self._clock = clock
        self._db: sqlite3.Connection | None = None
        # One connection, used by one thread at a time.
        self._limiter = trio.CapacityLimiter(1)

    def _connection(self) -> sqlite3.Connection:
        if self._db is None:
            self._db = open_database(self.path, _SCHEMA)
        return self._db

    async def _run(self, work: Callable[[sqlite3.Connection], Any]) -> Any:
        """Run ``work`` in a worker thread.

        Raises:
            PoolError: ``insufficient_storage`` (507) when the state directory's disk is
                full or refuses writes (a failed transaction leaves the file as it was).
        """
        try:
            return await trio.to_thread.run_sync(
                lambda: work(self._connection()), limiter=self._limiter
            )
        except (sqlite3.Error, OSError) as exc:
            if not is_storage_failure(exc):
                raise
            log.warning("stored responses: %s refused: %s: %s", self.path, type(exc).__name__, exc)
            raise PoolError(
                "insufficient_storage",
                "the response store could not write to the state directory (its disk is full"
                f" or refuses writes: {exc})",
            ) from exc

    async def aclose(self) -> None:
        """Close the connection (a later call opens it again)."""

        def close() -> None:
            db, self._db = self._db, None
            if db is not None:
                db.close()

        await trio.to_thread.run_sync(close, limiter=self._limiter)

    def _oldest_kept(self) -> float:
        return self._clock() - self.retention_s

    async def save(
        self,
        tenant: str,
        response: dict[str, Any],
        input_items: list[dict[str, Any]],
    ) -> None:
        """Keep ``response`` (its ``id``, ``created_at`` and ``previous_response_id``)."""
        row = (
            tenant,
            response["id"],
            float(response["created_at"]),
            response.get("previous_response_id"),
            json.dumps(input_items, ensure_ascii=False),
            json.dumps(response, ensure_ascii=False),
        )
        oldest, keep = self._oldest_kept(), self.max_stored

        def work(db: sqlite3.Connection) -> None:
            with db:
                db.execute("BEGIN IMMEDIATE")
                db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?)", row)
                db.execute("DELETE FROM responses WHERE created_at < ?", (oldest,))
                # rowids grow with each insert: all but the newest `keep` rows go.
                db.execute(
                    "DELETE FROM responses WHERE rowid <= (SELECT MAX(rowid) FROM responses) - ?",
                    (keep,),
                )

        await self._run(work)

    async def get(self, tenant: str, response_id: str) -> dict[str, Any] | None:
        """The stored response object, or None."""
        oldest = self._oldest_kept()

        def work(db: sqlite3.Connection) -> str | None:
            found = db.execute(
                "SELECT response FROM responses WHERE tenant = ? AND id = ? AND created_at >= ?",
                (tenant, response_id, oldest),
            ).fetchone()
            return None if found is None else str(found[0])

        text = await self._run(work)
        return None if text is None else dict(json.loads(text))

    async def input_items(self, tenant: str, response_id: str) -> list[dict[str, Any]] | None:
        """The input items the response was created with, or None when there is none."""
        oldest = self._oldest_kept()

        def work(db: sqlite3.Connection) -> str | None:
            found = db.execute(
                "SELECT input FROM responses WHERE tenant = ? AND id = ? AND created_at >= ?",
                (tenant, response_id, oldest),
            ).fetchone()
            return None if found is None else str(found[0])

        text = await self._run(work)
        return None if text is None else list(json.loads(text))

    async def chain(self, tenant: str, response_id: str) -> list[Turn] | None:
        """The conversation up to and including ``response_id``, oldest first; None when
        that response is not stored. A deleted or expired ancestor ends the chain."""
        oldest = self._oldest_kept()

        def work(db: sqlite3.Connection) -> list[tuple[str, str]]:
            return db.execute(
                """
                WITH RECURSIVE chain(id, previous_id, depth, input, response) AS (
                    SELECT id, previous_id, 0, input, response FROM responses
                    WHERE tenant = ?1 AND id = ?2 AND created_at >= ?3
                    UNION ALL
                    SELECT r.id, r.previous_id, c.depth + 1, r.input, r.response
                    FROM responses AS r JOIN chain AS c
                    ON r.tenant = ?1 AND r.id = c.previous_id AND r.created_at >= ?3
                    WHERE c.depth < ?4
                )
                SELECT input, response FROM chain ORDER BY depth DESC
                """,
                (tenant, response_id, oldest, MAX_CHAIN),
            ).fetchall()

        rows = await self._run(work)
        if not rows:
            return None
        return [Turn(json.loads(i), json.loads(r).get("output", [])) for i, r in rows]

    async def delete(self, tenant: str, response_id: str) -> bool:
        """Remove the response; False when it was not stored."""

        def work(db: sqlite3.Connection) -> bool:
            with db:
                gone = db.execute(
                    "DELETE FROM responses WHERE tenant = ? AND id = ?", (tenant, response_id)
                )
                return gone.rowcount > 0

        return bool(await self._run(work))
