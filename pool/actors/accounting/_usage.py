"""Usage recording off the request path: a bounded queue and one writer task.

A finishing request hands its :class:`UsageRecord` to :meth:`UsageRecorder.record`,
which never waits: the record goes into a bounded memory channel
(``service.usage.queue_size``) or, when that is full, is dropped and counted. The
writer task takes records in batches (``service.usage.batch_size`` records, or what
arrived within ``service.usage.flush_ms``) and appends each batch in one transaction in
a worker thread. A disk that is slow only fills the queue, and records past it are
dropped. A batch the database refuses (a full disk: ``database or disk is full``) is
held in memory, at most ``service.usage.hold_records`` rows (past it the oldest are
dropped), and written, oldest first, when a retry succeeds: retries back off from
:data:`RETRY_FIRST_S` to :data:`RETRY_MAX_S`, and while rows are held new batches join
them, so rows reach the file in the order they came. Held rows show in
``llm_pool_usage_records_held``; drops are counted
(``llm_pool_usage_records_dropped_total``). Failing writes and drops are each logged at
most once per :data:`DROP_LOG_INTERVAL_S`, with the counts since the last line. At
shutdown held rows get one last try; what it cannot write is dropped and counted.

The writer also prunes rows older than ``service.usage.retention_days``, at start and
then every :data:`PRUNE_INTERVAL_S`.
"""

from __future__ import annotations

import logging
import math
import sqlite3
import time
from collections import deque
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
# Held rows are retried after this, doubled after each failure up to RETRY_MAX_S: a full
# disk is retried about every 15 s, so rows are written within that of space returning.
RETRY_FIRST_S = 0.5
RETRY_MAX_S = 15.0
# Held rows are written in transactions of at most this many (or batch_size, if more).
RETRY_CHUNK = 1024


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
        # Rows the database refused, oldest first, kept for a retry (bounded).
        self._held: deque[UsageRecord] = deque()
        self._retry_in = RETRY_FIRST_S
        self._retry_at = math.inf
        self._unlogged_failures = 0
        self._last_failure_log = -DROP_LOG_INTERVAL_S
        # Set (and replaced) whenever records are written or dropped.
        self._progress = trio.Event()

    @property
    def held(self) -> int:
        """Rows the database refused that wait for a retry."""
        return len(self._held)

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
                    if self._held:
                        # The disk is failing: the batch waits behind the held rows, so
                        # that a retry writes them in the order they came.
                        self._hold(batch)
                    elif batch:
                        await self._write(batch)
                    if self._held and trio.current_time() >= self._retry_at:
                        await self._write_held()
            finally:
                with self._send:
                    pass  # late records are dropped as "closed" from here on
                with trio.move_on_after(FINAL_FLUSH_S, shield=True) as scope:
                    self._hold([*pending, *self._waiting()])
                    await self._write_held(final=True)
                if self._held:
                    self._drop(
                        len(self._held), "shutdown" if scope.cancelled_caught else "write_failed"
                    )
                    self._held.clear()
                    self.metrics.usage_held.set(0)

    async def _fill(self, batch: list[UsageRecord]) -> bool:
        """Add the next records to ``batch``: waits for one (or, while rows are held,
        until their retry is due), then up to ``batch_size`` or ``flush_ms``, whichever
        comes first. False when the channel has closed. (The caller's list, so a
        shutdown meanwhile still writes what was taken.)"""
        with trio.move_on_at(self._retry_at if self._held else math.inf):
            try:
                batch.append(await self._receive.receive())
            except trio.EndOfChannel:
                return False
        if not batch:
            return True  # a retry is due
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

    async def _write(self, batch: list[UsageRecord]) -> bool:
        """Append ``batch`` in one transaction; a refused one is held (False)."""
        try:
            await trio.to_thread.run_sync(
                self.sink.append, batch, limiter=self._limiter, abandon_on_cancel=True
            )
        except (OSError, sqlite3.Error) as exc:
            self._failed(batch, exc)
            return False
        self.written += len(batch)
        self.metrics.usage_written.inc(len(batch))
        self._progressed()
        return True

    async def _write_held(self, *, final: bool = False) -> None:
        """Write the held rows, oldest first, until they are all written or one
        transaction is refused (then the next retry backs off further)."""
        chunk = max(self.settings.batch_size, RETRY_CHUNK)
        recovered = 0
        while self._held:
            batch = [self._held.popleft() for _ in range(min(chunk, len(self._held)))]
            if not await self._write(batch):
                return
            recovered += len(batch)
            self.metrics.usage_held.set(len(self._held))
        self._retry_in, self._retry_at = RETRY_FIRST_S, math.inf
        if recovered and not final:
            log.warning("usage writes recovered: %d held record(s) written", recovered)

    def _failed(self, batch: list[UsageRecord], exc: BaseException) -> None:
        """The database refused ``batch``: hold it (in front of the rows held already,
        which came later) and schedule the next retry."""
        self._held.extendleft(reversed(batch))
        self._hold([])
        now = trio.current_time()
        self._retry_at = now + self._retry_in
        self._retry_in = min(self._retry_in * 2.0, RETRY_MAX_S)
        self._unlogged_failures += 1
        if now - self._last_failure_log >= DROP_LOG_INTERVAL_S:
            log.warning(
                "usage writes failing: %d failed write(s) since the last report, %d record(s)"
                " held for a retry in %.1f s (error=%s: %s)",
                self._unlogged_failures,
                len(self._held),
                self._retry_at - now,
                type(exc).__name__,
                exc,
            )
            self._last_failure_log = now
            self._unlogged_failures = 0

    def _hold(self, records: list[UsageRecord]) -> None:
        """Add ``records`` behind the held ones; past ``hold_records`` the oldest go."""
        self._held.extend(records)
        over = len(self._held) - self.settings.hold_records
        if over > 0:
            for _ in range(over):
                self._held.popleft()
            self._drop(over, "hold_full")
        self.metrics.usage_held.set(len(self._held))

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
