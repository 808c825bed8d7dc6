"""The way out for spans: a bounded queue, and a thread that encodes and sends batches.

The request's task only appends its span records to a deque (atomic under the GIL,
no lock, no wake-up but one per full batch); the thread takes them in batches, encodes
them (``_otlp.py``) and hands the body to ``send`` (the OTLP/HTTP post). A collector
that is slow, failing or absent holds up this thread only: the queue then fills, and
what does not fit is dropped and counted (the oldest first, as the SDK's batch
processor drops), logged once per round rather than once per span.

The sizes and the delay are the SDK batch processor's, and its variables set them
(``OTEL_BSP_MAX_QUEUE_SIZE``, ``OTEL_BSP_SCHEDULE_DELAY``,
``OTEL_BSP_MAX_EXPORT_BATCH_SIZE``), as they did when the SDK's processor did this.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from pool.tracing._record import SpanRecord

log = logging.getLogger("pool.tracing")


@dataclass(frozen=True, slots=True)
class BatchSettings:
    """How many spans wait at most, how many go in one export, how long one waits."""

    max_queue_size: int = 2048
    max_batch_size: int = 512
    schedule_delay_s: float = 5.0

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> BatchSettings:
        """The settings of the ``OTEL_BSP_*`` variables, where they are valid."""
        default = cls()

        def positive(name: str, fallback: int) -> int:
            text = environ.get(name, "").strip()
            if not text:
                return fallback
            try:
                value = int(text)
            except ValueError:
                value = 0
            if value <= 0:
                log.warning("%s=%r is not a positive integer: %d is used", name, text, fallback)
                return fallback
            return value

        queue = positive("OTEL_BSP_MAX_QUEUE_SIZE", default.max_queue_size)
        batch = positive("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", default.max_batch_size)
        delay_ms = positive("OTEL_BSP_SCHEDULE_DELAY", int(default.schedule_delay_s * 1000))
        # A batch never holds more than the queue can (the SDK refuses such settings).
        return cls(queue, min(batch, queue), delay_ms / 1000)


class BatchExport:
    """Queues span records and exports them in batches from a daemon thread of its own.

    ``encode`` turns a batch into a request body, ``send`` posts it and says whether it
    was taken; both run on the thread only. :meth:`shutdown` exports what is left.
    """

    def __init__(
        self,
        encode: Callable[[list[SpanRecord]], bytes],
        send: Callable[[bytes], bool],
        settings: BatchSettings | None = None,
    ) -> None:
        self.settings = settings or BatchSettings()
        self._encode = encode
        self._send = send
        self._queue: deque[SpanRecord] = deque(maxlen=self.settings.max_queue_size)
        self._wake = threading.Event()
        self._stopping = False
        # Written by the request path (dropped) and by the thread (the others) only.
        self.dropped = 0
        self.exported = 0
        self.failed = 0
        self._dropped_logged = 0
        # Callers of flush waiting for the end of the thread's next round.
        self._flushes: deque[threading.Event] = deque()
        self._thread = threading.Thread(target=self._run, name="llm-pool-traces", daemon=True)
        self._thread.start()

    def add(self, spans: Iterable[SpanRecord]) -> None:
        """Queue ``spans`` (the request path: never blocks, never waits for the thread).

        A full queue loses its oldest spans to these (the deque's bound), counted."""
        queue = self._queue
        limit = self.settings.max_queue_size
        for span in spans:
            if len(queue) == limit:
                self.dropped += 1
            queue.append(span)
        # One wake-up per batch: the thread otherwise looks every schedule delay.
        if len(queue) >= self.settings.max_batch_size and not self._wake.is_set():
            self._wake.set()

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def thread_id(self) -> int:
        """The exporter thread's id (``threading``'s; for its CPU clock)."""
        assert self._thread.ident is not None  # started in __init__
        return self._thread.ident

    def flush(self, timeout_s: float | None = None) -> bool:
        """Have the thread export what is queued now, and wait for the end of its round
        (blocking); False where ``timeout_s`` passed first."""
        done = threading.Event()
        self._flushes.append(done)
        self._wake.set()
        return done.wait(timeout_s)

    def shutdown(self, timeout_s: float | None = None) -> None:
        """Export what is queued, then stop the thread (blocking, at most ``timeout_s``:
        a thread still sending then is left behind, a daemon)."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            woken = self._wake.wait(self.settings.schedule_delay_s)
            self._wake.clear()
            # The flushes asked before this round are answered at its end (a later
            # one has woken the thread again for the next round).
            flushes = len(self._flushes)
            # Full batches as they fill; what is left once the delay has passed (or
            # for a flush, or the shutdown). Posting every span as soon as it arrives
            # would cost a post (a few ms of CPU) per handful of requests under load.
            self._export_queued(everything=not woken or self._stopping or flushes > 0)
            self._report_drops()
            for _ in range(flushes):
                self._flushes.popleft().set()
            if self._stopping and not self._queue:
                return

    def _export_queued(self, everything: bool) -> None:
        queue, size = self._queue, self.settings.max_batch_size
        while len(queue) >= size or (everything and queue):
            batch: list[SpanRecord] = []
            try:
                while len(batch) < size:
                    batch.append(queue.popleft())
            except IndexError:
                pass  # the queue ran out first
            try:
                taken = self._send(self._encode(batch))
            except Exception:
                # The thread must outlive a bad batch or a broken connection.
                log.exception("Trace export failed (%d spans lost)", len(batch))
                taken = False
            if taken:
                self.exported += len(batch)
            else:
                self.failed += len(batch)
            if not taken and not self._stopping:
                # The collector refused or is away (the sender has retried and said
                # so): the next batch waits for the next round rather than piling up
                # failures now; the queue's bound keeps the wait from costing memory.
                return

    def _report_drops(self) -> None:
        dropped = self.dropped
        if dropped != self._dropped_logged:
            log.warning(
                "Trace export queue full: %d spans dropped (%d in all); the collector is"
                " slow or away, or OTEL_BSP_MAX_QUEUE_SIZE (%d) is too small for the load",
                dropped - self._dropped_logged,
                dropped,
                self.settings.max_queue_size,
            )
            self._dropped_logged = dropped
