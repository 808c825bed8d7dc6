"""Usage recording off the request path: a bounded queue and one writer task.

A finishing request hands its :class:`UsageRecord` to :meth:`UsageRecorder.record`,
which never waits: the record goes into a bounded memory channel
(``service.usage.queue_size``) or, when that is full, is dropped and counted. The
writer task takes records in batches (``service.usage.batch_size`` records, or what
arrived within ``service.usage.flush_ms``) and appends each batch in one transaction in
a worker thread. A disk that is slow only fills the queue; one that fails loses that
batch; either way the drops are counted (``llm_pool_usage_records_dropped_total``) and
logged at most once per :data:`DROP_LOG_INTERVAL_S` with the count since the last line.

The writer also prunes rows older than ``service.usage.retention_days``, at start and
then every :data:`PRUNE_INTERVAL_S`.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import trio

from pool.actors.accounting._usage_store import UsageRecord
from pool.actors.models._metrics import PoolMetrics
from pool.config import UsageSettings

log = logging.getLogger("pool.usage")

DROP_LOG_INTERVAL_S = 10.0
PRUNE_INTERVAL_S = 3600.0
# How long a shutdown waits for the last records to reach the disk.
FINAL_FLUSH_S = 2.0


class UsageSink(Protocol):
    """Where batches go (:class:`~pool.actors.accounting._usage_store.UsageStore`; tests pass one
    that fails or blocks)."""

    def append(self, records: Sequence[UsageRecord]) -> None: ...

    def prune(self, before: float) -> int: ...


class UsageRecorder:
    """The usage writer actor: :meth:`record` from anywhere, :meth:`run` in the pool's nursery.

    Args:
        sink: the blocking store its worker thread writes to.
        clock: seconds since the epoch (for the retention cut-off).
        limiter: the limiter of ``sink``'s connection (``UsageStore.write_limiter``).
    """

    def __init__(
        self,
        settings: UsageSettings,
        sink: UsageSink,
        metrics: PoolMetrics,
        clock: Callable[[], float] = time.time,
        limiter: trio.CapacityLimiter | None = None,
    ) -> None:
        self.settings = settings
        self.sink = sink
        self.metrics = metrics
        # When records are stamped and the retention counted from (tests move it).
        self.clock = clock
        self._send, self._receive = trio.open_memory_channel[UsageRecord](settings.queue_size)
        # One worker thread at a time (the store's own limiter where it has one, so
        # its connection is never closed under a write); a write that stalls is
        # abandoned at shutdown rather than waited for, and keeps the limiter until it ends.
        self._limiter = limiter or trio.CapacityLimiter(1)
        self.written = 0
        self.dropped = 0
        self._unlogged_drops = 0
        self._last_drop_log = -DROP_LOG_INTERVAL_S
        # Set (and replaced) whenever records are written or dropped.
        self._progress = trio.Event()

    def record(self, record: UsageRecord) -> None:
        """Queue ``record`` for the writer; drop it (counted) when the queue is full."""
        try:
            self._send.send_nowait(record)
        except trio.WouldBlock:
            self._drop(1, "queue_full")
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            self._drop(1, "closed")

    async def wait_settled(self, records: int) -> None:
        """Wait until ``records`` records in all have been written or dropped (a benchmark
        waits so for its rounds' writes; nothing on the request path waits here)."""
        while self.written + self.dropped < records:
            await self._progress.wait()

    def _progressed(self) -> None:
        self._progress.set()
        self._progress = trio.Event()

    def _drop(self, count: int, reason: str, error: str | None = None) -> None:
        self.dropped += count
        self._unlogged_drops += count
        self.metrics.usage_dropped.labels(reason).inc(count)
        try:
            now = trio.current_time()
        except RuntimeError:  # outside Trio (a pool that has ended)
            now = time.monotonic()
        if now - self._last_drop_log >= DROP_LOG_INTERVAL_S:
            log.warning(
                "usage records dropped: %d since the last report (reason=%s%s)",
                self._unlogged_drops,
                reason,
                f" error={error}" if error else "",
            )
            self._last_drop_log = now
            self._unlogged_drops = 0
        self._progressed()

    async def run(
        self, *, task_status: trio.TaskStatus[UsageRecorder] = trio.TASK_STATUS_IGNORED
    ) -> None:
        pending: list[UsageRecord] = []
        with self._receive:
            task_status.started(self)
            next_prune = trio.current_time()
            try:
                while True:
                    if trio.current_time() >= next_prune:
                        await self._prune()
                        next_prune = trio.current_time() + PRUNE_INTERVAL_S
                    if not await self._fill(pending):
                        return
                    batch, pending = pending, []
                    await self._write(batch)
            finally:
                with self._send:
                    pass  # late records are dropped as "closed" from here on
                with trio.move_on_after(FINAL_FLUSH_S, shield=True) as scope:
                    pending.extend(self._waiting())
                    if pending:
                        await self._write(pending)
                if scope.cancelled_caught:
                    self._drop(len(pending), "shutdown")

    async def _fill(self, batch: list[UsageRecord]) -> bool:
        """Add the next records to ``batch``: waits for one, then up to ``batch_size``
        or ``flush_ms``, whichever comes first. False when the channel has closed.
        (The caller's list, so a shutdown meanwhile still writes what was taken.)"""
        try:
            batch.append(await self._receive.receive())
        except trio.EndOfChannel:
            return False
        with trio.move_on_after(self.settings.flush_ms / 1000.0):
            while len(batch) < self.settings.batch_size:
                try:
                    batch.append(await self._receive.receive())
                except trio.EndOfChannel:
                    break
        return True

    def _waiting(self) -> list[UsageRecord]:
        records: list[UsageRecord] = []
        while True:
            try:
                records.append(self._receive.receive_nowait())
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                return records

    async def _write(self, batch: list[UsageRecord]) -> None:
        try:
            await trio.to_thread.run_sync(
                self.sink.append, batch, limiter=self._limiter, abandon_on_cancel=True
            )
        except (OSError, sqlite3.Error) as exc:
            self._drop(len(batch), "write_failed", f"{type(exc).__name__}: {exc}")
            return
        self.written += len(batch)
        self.metrics.usage_written.inc(len(batch))
        self._progressed()

    async def _prune(self) -> None:
        cutoff = self.clock() - self.settings.retention_days * 86400.0
        try:
            removed = await trio.to_thread.run_sync(
                self.sink.prune, cutoff, limiter=self._limiter, abandon_on_cancel=True
            )
        except (OSError, sqlite3.Error) as exc:
            log.warning("usage retention: pruning failed: %s: %s", type(exc).__name__, exc)
            return
        if removed:
            log.info(
                "usage retention: %d record(s) older than %d days removed",
                removed,
                self.settings.retention_days,
            )
