"""What tracing costs: the same stub requests to pools with tracing off, on, and sampled.

Three pool processes serve one zero-work stub model: one with tracing off, one that
traces every request and one that samples a tenth of them, each traced one exporting
(OTLP/HTTP, in batches from its exporter thread) to a receiver in this process that
counts what arrives and keeps nothing. Phases alternate off, on, sampled, off... with the
same closed-loop load, and each phase's server CPU time (``/proc``, user plus system,
the exporter's thread included) is divided by its answered requests. The issue's bar
(#29): tracing adds at most 0.1 ms CPU per request and loses none.

On a shared 2-core machine a phase's CPU per request moves by more than that bar from
one round to the next, so the tracing code's own CPU is measured too, in this process
(``in_process``): an embedded pool answering the same requests, the CPU time its loop's
thread spends in the tracer's calls (``time.thread_time_ns`` around each) and the CPU
time of the exporter's thread (its own CPU clock), both per request.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, cast

import trio

from benchmarks.harness import CLK_TCK, Server, closed_loop, measure, pool_server, progress
from pool.actors import DecodingOverrides, InferenceRequest, RequestTrace
from pool.config import build_settings

# The traced pool that records a share of its traces only (service.tracing.sample_ratio).
SAMPLED_RATIO = 0.1

# Two spans a request that finds a free replica: the request and its generation.
SPANS_PER_REQUEST = 2


class _Counts:
    def __init__(self) -> None:
        self.exports = 0
        self.spans = 0
        self.lock = threading.Lock()


@contextmanager
def discarding_receiver() -> Iterator[tuple[str, _Counts]]:
    """An OTLP/HTTP endpoint on 127.0.0.1 that answers every export and counts its spans."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    counts = _Counts()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            export = ExportTraceServiceRequest()
            export.ParseFromString(self.rfile.read(int(self.headers.get("content-length", 0))))
            spans = sum(len(s.spans) for r in export.resource_spans for s in r.scope_spans)
            with counts.lock:
                counts.exports += 1
                counts.spans += spans
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", counts
    finally:
        server.shutdown()
        server.server_close()


def main_thread_cpu_seconds(server: Server) -> float:
    """User plus system CPU time of the server's main thread (the Trio loop) so far:
    the rest of its CPU is other threads', the span exporter's above all."""
    pid = server.process.pid
    fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


class _TimedTrace:
    """A request's trace, its :meth:`end` timed (the pool sets and reads the rest)."""

    def __init__(self, trace: RequestTrace, owner: _TimedTracing) -> None:
        object.__setattr__(self, "_trace", trace)
        object.__setattr__(self, "_owner", owner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._trace, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._trace, name, value)

    def fail(self, exc: BaseException) -> None:
        self._trace.fail(exc)

    def end(self) -> None:
        started = time.thread_time_ns()
        self._trace.end()
        self._owner.cpu_ns += time.thread_time_ns() - started


class _TimedTracing:
    """The pool's tracer, with the CPU time of the loop's thread in its calls summed."""

    def __init__(self, tracing: Any) -> None:
        self.tracing = tracing
        self.cpu_ns = 0

    def request(self, *args: Any) -> RequestTrace:
        started = time.thread_time_ns()
        trace = self.tracing.request(*args)
        self.cpu_ns += time.thread_time_ns() - started
        return cast(RequestTrace, _TimedTrace(trace, self))

    def shutdown(self) -> None:
        self.tracing.shutdown()


async def tracing_code_cost(url: str, requests: int) -> dict[str, Any]:
    """CPU per request of the tracer's calls on the loop's thread and of its exporter's
    thread (encoding and posting to ``url``), in an embedded pool in this process."""
    from pool import open_pool
    from pool.tracing import open_tracing

    stub = {"backend": "stub", "enabled": True, "stub_reply": "a b c d", "target_inflight": 8}
    settings = build_settings(
        {
            "service": {"usage": {"enabled": False}, "tracing": {"endpoint": url}},
            "engine": {"models": {"stub": stub}},
        }
    )
    # The tracer the pool opens from its settings; its export queue and thread
    # (``.export``, pool/tracing/_export.py) are read for the thread's clock and flushes.
    tracing: Any = open_tracing(settings.service.tracing, {})
    timed = _TimedTracing(tracing)
    # The same request as the HTTP phases' (four tokens), on the embedded API.
    request = InferenceRequest.prompt("stub", "x", decoding=DecodingOverrides(max_tokens=4))
    exporter_clock = time.pthread_getcpuclockid(tracing.export.thread_id)
    async with open_pool(settings, tracing=timed) as pool:
        for _ in range(200):  # warm-up
            await pool.respond(request)
        await trio.to_thread.run_sync(tracing.export.flush)
        timed.cpu_ns = 0
        exporter_before = time.clock_gettime_ns(exporter_clock)
        loop_before = time.thread_time_ns()
        for _ in range(requests):
            await pool.respond(request)
        loop_ns = time.thread_time_ns() - loop_before
        await trio.to_thread.run_sync(tracing.export.flush)
        exporter_ns = time.clock_gettime_ns(exporter_clock) - exporter_before
    return {
        "requests": requests,
        "tracer_calls_ms_per_request": timed.cpu_ns / requests / 1e6,
        "exporter_thread_ms_per_request": exporter_ns / requests / 1e6,
        "tracing_code_ms_per_request": (timed.cpu_ns + exporter_ns) / requests / 1e6,
        "loop_thread_ms_per_request": loop_ns / requests / 1e6,
        "spans_exported": tracing.export.exported,
        "spans_dropped": tracing.export.dropped,
    }


def _body(index: int) -> tuple[dict[str, Any], dict[str, str]]:
    return {"model": "stub", "input": "x", "decoding": {"max_tokens": 4}}, {}


async def tracing_cost(quick: bool) -> dict[str, Any]:
    """Server CPU per request with tracing off and on, interleaved phases."""
    # Short phases, many rounds: the load of other work on a shared machine drifts over
    # seconds, and each round compares phases a few seconds apart.
    rounds = 2 if quick else 15
    requests = 200 if quick else 1000
    concurrency = 4
    stub = {"backend": "stub", "enabled": True, "stub_reply": "a b c d", "target_inflight": 8}
    phases: dict[str, list[dict[str, Any]]] = {"off": [], "on": [], "sampled": []}
    # Each traced pool exports to a receiver of its own, so the full one's spans are counted.
    with discarding_receiver() as (url, counts), discarding_receiver() as (sampled_url, _):
        with (
            pool_server({"stub": stub}) as off,
            pool_server({"stub": stub}, {"tracing": {"endpoint": url}}) as on,
            pool_server(
                {"stub": stub},
                {"tracing": {"endpoint": sampled_url, "sample_ratio": SAMPLED_RATIO}},
            ) as sampled,
        ):
            sides = (("off", off), ("on", on), ("sampled", sampled))
            for _, server in sides:  # warm-up (imports, first allocations)
                await closed_loop(server, concurrency, 200, _body)
            warmup_spans = SPANS_PER_REQUEST * 200
            for round_index in range(rounds):
                for side, server in sides:
                    progress(f"tracing round {round_index + 1}/{rounds} {side}")
                    main_before = main_thread_cpu_seconds(server)
                    summary = await measure(
                        server, partial(closed_loop, server, concurrency, requests, _body)
                    )
                    main_ms = (main_thread_cpu_seconds(server) - main_before) * 1000
                    summary["main_thread_cpu_ms_per_request"] = main_ms / max(summary["ok"], 1)
                    summary.pop("latencies_ms")
                    phases[side].append(summary)
        # Both pools have shut down here: the traced one flushed its last spans.
        exported = counts.spans - warmup_spans
    # The tracing code alone, in this process, once the pools have stopped.
    with discarding_receiver() as (own_url, _):
        progress("tracing code, in process")
        in_process = [await tracing_code_cost(own_url, 10 * requests)]
    cpu = {side: [p["server_cpu_ms_per_request"] for p in runs] for side, runs in phases.items()}
    main = {
        side: [p["main_thread_cpu_ms_per_request"] for p in runs] for side, runs in phases.items()
    }

    def added(values: dict[str, list[float]], side: str) -> list[float]:
        # Each round's traced phase against the off phase just before it.
        return [b - a for a, b in zip(values["off"], values[side], strict=True)]

    answered = {side: sum(p["ok"] for p in runs) for side, runs in phases.items()}
    sent = {side: sum(p["requests"] for p in runs) for side, runs in phases.items()}
    rows = []
    for side, ratio in (("on", 1.0), ("sampled", SAMPLED_RATIO)):
        rows.append(
            {
                "sample_ratio": ratio,
                "requests_per_phase": requests,
                "rounds": rounds,
                "off_cpu_ms_per_request": statistics.median(cpu["off"]),
                "on_cpu_ms_per_request": statistics.median(cpu[side]),
                "added_cpu_ms_per_request": statistics.median(added(cpu, side)),
                # Of which the Trio loop's thread (the spans made); the rest is other
                # threads' (the exporter's above all).
                "added_main_thread_ms_per_request": statistics.median(added(main, side)),
                "off_p50_ms": statistics.median(p["latency_ms"]["p50"] for p in phases["off"]),
                "on_p50_ms": statistics.median(p["latency_ms"]["p50"] for p in phases[side]),
                "off_lost": sent["off"] - answered["off"],
                "on_lost": sent[side] - answered[side],
                # Every span of the fully traced pool must arrive; a sampled share is random.
                "spans_expected": SPANS_PER_REQUEST * answered[side] if ratio == 1.0 else None,
                "spans_received": exported if ratio == 1.0 else None,
            }
        )
    return {
        "rows": rows,
        "in_process": in_process,
        "raw": phases,
        "added_by_round": added(cpu, "on"),
        "added_main_thread_by_round": added(main, "on"),
        "sampled_added_by_round": added(cpu, "sampled"),
    }
