"""The span queue and its exporter thread: batches, a slow or failing collector, drops.

``BatchExport`` is driven here with its own ``encode`` and ``send``; a collector that
never answers is a ``send`` that blocks on an event the test holds. The end-to-end
test runs a pool whose collector hangs and checks that every request is answered.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import trio

from pool import open_pool
from pool.actors import InferenceRequest
from pool.config import build_settings
from pool.tracing import INCOMING_TRACE, IncomingTrace, TracingTarget
from pool.tracing._export import BatchExport, BatchSettings
from pool.tracing._record import KIND_INTERNAL, SpanRecord
from pool.tracing._spans import OtelTracing
from tests.bounds import EVENT_BOUND_S

# Long enough that the thread only wakes when a batch is full or at shutdown.
NEVER_S = 3600.0


def _span(n: int) -> SpanRecord:
    trace_id, span_id = bytes(15) + b"\x01", (n + 1).to_bytes(8, "big")
    return SpanRecord(
        f"s{n}", trace_id, span_id, b"", False, KIND_INTERNAL, n, n, (), (), None, None
    )


def _names(body: bytes) -> list[str]:
    return body.decode().split(",") if body else []


def _encode(batch: list[SpanRecord]) -> bytes:
    return ",".join(s.name for s in batch).encode()


class Collector:
    """A ``send`` that keeps each body, and that can be held (a collector that hangs)
    or made to refuse its next posts (one that answers with an error)."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.open = threading.Event()
        self.open.set()
        self.refusals = 0
        self.calls = threading.Semaphore(0)

    def send(self, body: bytes) -> bool:
        self.calls.release()
        self.open.wait()
        if self.refusals:
            self.refusals -= 1
            return False
        self.bodies.append(body)
        return True

    @property
    def names(self) -> list[str]:
        return [n for body in self.bodies for n in _names(body)]


def _until(predicate: Callable[[], bool], what: str) -> None:
    """Wait in this thread for the exporter's thread to do ``what``; the bound only turns
    a wait that never ends into a failure that names it."""
    deadline = time.monotonic() + EVENT_BOUND_S
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not after {EVENT_BOUND_S:g} s", pytrace=False)
        time.sleep(0.01)


@pytest.fixture
def collector() -> Iterator[Collector]:
    collector = Collector()
    yield collector
    collector.open.set()  # never leave a thread blocked


def test_spans_go_out_in_batches_and_shutdown_exports_the_rest(collector: Collector) -> None:
    export = BatchExport(_encode, collector.send, BatchSettings(100, 4, NEVER_S))
    export.add(_span(n) for n in range(10))  # two full batches wake the thread
    export.shutdown(timeout_s=30)
    assert collector.names == [f"s{n}" for n in range(10)]
    assert [len(_names(b)) for b in collector.bodies] == [4, 4, 2]
    assert (export.exported, export.failed, export.dropped) == (10, 0, 0)


def test_a_partial_batch_waits_for_the_delay_or_a_flush(collector: Collector) -> None:
    export = BatchExport(_encode, collector.send, BatchSettings(100, 4, NEVER_S))
    export.add(_span(n) for n in range(5))
    assert collector.calls.acquire(timeout=30)
    _until(lambda: export.exported >= 4, "the full batch's export")
    # One post of the full batch; the fifth span waits rather than going out alone.
    assert (len(collector.bodies), export.queued) == (1, 1)
    assert export.flush(timeout_s=30)
    assert collector.names == [f"s{n}" for n in range(5)]
    export.shutdown(timeout_s=30)

    # With a short delay, what is queued goes out without a full batch.
    prompt = BatchExport(_encode, collector.send, BatchSettings(100, 4, 0.05))
    prompt.add([_span(9)])
    _until(lambda: prompt.exported >= 1, "the export of a partial batch after the delay")
    assert collector.names[-1] == "s9"
    prompt.shutdown(timeout_s=30)


def test_a_slow_collector_never_blocks_the_request_path(
    collector: Collector, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="pool.tracing")
    collector.open.clear()  # the collector hangs
    export = BatchExport(_encode, collector.send, BatchSettings(8, 4, NEVER_S))
    export.add(_span(n) for n in range(4))
    assert collector.calls.acquire(timeout=30)  # the thread is stuck in its post
    # Requests go on adding while it is: each add returns (nothing waits for the
    # thread), the queue keeps its bound, and what does not fit is dropped and counted.
    for n in range(4, 24):
        export.add([_span(n)])
    assert export.queued == 8
    assert export.dropped == 12
    collector.open.set()
    export.shutdown(timeout_s=30)
    # The batch in flight and the newest 8 arrived; the 12 oldest queued were dropped.
    assert collector.names == [f"s{n}" for n in (0, 1, 2, 3, *range(16, 24))]
    assert export.exported == 12
    (warning,) = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert "12 spans dropped" in warning and "OTEL_BSP_MAX_QUEUE_SIZE (8)" in warning


def test_a_failing_collector_loses_its_batches_not_the_thread(collector: Collector) -> None:
    collector.refusals = 1
    export = BatchExport(_encode, collector.send, BatchSettings(100, 2, NEVER_S))
    export.add([_span(0), _span(1)])
    export.add([_span(2), _span(3)])
    export.shutdown(timeout_s=30)
    assert collector.names == ["s2", "s3"]
    assert (export.exported, export.failed) == (2, 2)


def test_an_encoding_error_is_logged_and_the_thread_goes_on(
    collector: Collector, caplog: pytest.LogCaptureFixture
) -> None:
    def encode(batch: list[SpanRecord]) -> bytes:
        if batch[0].name == "s0":
            raise ValueError("bad span")
        return _encode(batch)

    export = BatchExport(encode, collector.send, BatchSettings(100, 1, NEVER_S))
    export.add([_span(0)])
    export.add([_span(1)])
    export.shutdown(timeout_s=30)
    assert collector.names == ["s1"]
    assert export.failed == 1
    assert any("Trace export failed" in r.getMessage() for r in caplog.records)


def test_a_hung_collector_bounds_the_shutdown(collector: Collector) -> None:
    collector.open.clear()
    export = BatchExport(_encode, collector.send, BatchSettings(100, 1, NEVER_S))
    export.add([_span(0)])
    assert collector.calls.acquire(timeout=30)
    export.shutdown(timeout_s=0.2)  # returns, leaving the daemon thread in its post
    assert export.exported == 0


def test_the_sdk_variables_size_the_batches() -> None:
    assert BatchSettings.from_environ({}) == BatchSettings(2048, 512, 5.0)
    environ = {
        "OTEL_BSP_MAX_QUEUE_SIZE": "100",
        "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "500",  # more than the queue: the queue's size
        "OTEL_BSP_SCHEDULE_DELAY": "250",
    }
    assert BatchSettings.from_environ(environ) == BatchSettings(100, 100, 0.25)
    bad = {"OTEL_BSP_MAX_QUEUE_SIZE": "many", "OTEL_BSP_SCHEDULE_DELAY": "-1"}
    assert BatchSettings.from_environ(bad) == BatchSettings(2048, 512, 5.0)


async def test_a_pool_whose_collector_hangs_answers_every_request(collector: Collector) -> None:
    collector.open.clear()
    target = TracingTarget("http://127.0.0.1:9/v1/traces", "llm-pool", 1.0, "test")
    tracing = OtelTracing(target, send=collector.send, batches=BatchSettings(16, 4, NEVER_S))
    echo = {"backend": "stub", "enabled": True}
    settings = build_settings({"engine": {"models": {"echo": echo}}})
    async with open_pool(settings, tracing=tracing) as pool:
        for _ in range(40):  # 80 spans into a queue of 16, behind a post that hangs
            done = await pool.respond(InferenceRequest.prompt("echo", "one two"))
            assert done.text == "one two"
        assert await trio.to_thread.run_sync(collector.calls.acquire, True, 30)
        assert tracing.export.dropped > 0
        collector.open.set()
    received = [span for body in collector.bodies for span in _records(body)]
    assert len(received) + tracing.export.dropped == 80
    assert {name for name, *_ in received} <= {"chat echo", "llm_pool.generation"}


def _records(body: bytes) -> list[tuple[str, int, int, int]]:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    export = ExportTraceServiceRequest.FromString(body)
    return [
        (s.name, int(s.trace_id.hex(), 16), int(s.span_id.hex(), 16), s.flags)
        for r in export.resource_spans
        for scope in r.scope_spans
        for s in scope.spans
    ]


@pytest.mark.parametrize(("flags", "ratio"), [("01", 0.0), ("00", 1.0)])
def test_the_callers_sampling_decision_wins_over_the_ratio(flags: str, ratio: float) -> None:
    bodies: list[bytes] = []

    def send(body: bytes) -> bool:
        bodies.append(body)
        return True

    target = TracingTarget("http://127.0.0.1:9/v1/traces", "llm-pool", ratio, "test")
    tracing = OtelTracing(target, send=send)
    caller = f"00-{'ab' * 16}-{'cd' * 8}-{flags}"
    incoming = IncomingTrace(caller, "vendor=1")
    token = INCOMING_TRACE.set(incoming)
    try:
        trace = tracing.request(
            InferenceRequest.prompt("echo", "x"), "default", time.perf_counter()
        )
    finally:
        INCOMING_TRACE.reset(token)
    trace.end()  # never admitted: an error span ("cancelled")
    tracing.shutdown()
    assert incoming.answer == trace.traceparent
    version, trace_id, span_id, answered_flags = trace.traceparent.split("-")
    assert version == "00"
    assert (trace_id, answered_flags) == ("ab" * 16, flags)
    if flags == "00":
        assert bodies == []
        return
    ((name, got_trace, got_span, span_flags),) = _records(b"".join(bodies))
    assert (name, got_trace, got_span) == ("chat echo", int("ab" * 16, 16), int(span_id, 16))
    assert span_flags == 0x300  # the parent is known to be remote
