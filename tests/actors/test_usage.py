"""The usage database: what every finished request records, off the request path."""

from __future__ import annotations

import dataclasses
import logging
import os
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from pool import Failed, Pool, PoolError, open_pool
from pool.actors import EmbeddingRequest, InferenceRequest, UsageRecord, UsageStore
from pool.actors.accounting._usage import UsageRecorder
from pool.actors.accounting._usage_store import FILE_NAME
from pool.backends import TokenSink
from pool.backends.stub import StubRuntime
from pool.config import build_settings
from pool.errors import BackendError

from .helpers import ask as plain_ask
from .helpers import wait_until


def ask(model: str, text: str = "hello world", key_name: str | None = None) -> InferenceRequest:
    """A request as one made with the key named ``key_name`` arrives at the pool."""
    return dataclasses.replace(plain_ask(model, text), key_name=key_name)


def _settings(**usage: object) -> object:
    return build_settings(
        {
            "service": {"usage": {"flush_ms": 10, **usage}},
            "engine": {
                "models": {
                    "m": {"backend": "stub", "enabled": True, "target_inflight": 64},
                    "slow": {
                        "backend": "stub",
                        "enabled": True,
                        "stub_reply": " ".join(["w"] * 50),
                        "stub_tokens_per_second": 20,
                    },
                    "cold": {"backend": "stub"},
                }
            },
        }
    )


def _metric(pool: object, name: str, **labels: str) -> float:
    text = pool.render_metrics().decode()  # type: ignore[attr-defined]
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def _rows(state: Path) -> list[tuple[object, ...]]:
    with sqlite3.connect(state / FILE_NAME) as db:
        return db.execute(
            "SELECT key, tenant, model, prompt_tokens, cached_tokens, output_tokens,"
            " queue_ms, generation_ms, status FROM usage ORDER BY rowid"
        ).fetchall()


async def test_every_ending_is_recorded_with_its_status(private_state: Path) -> None:
    async with open_pool(_settings()) as pool:  # type: ignore[arg-type]
        await pool.respond(ask("m", "one two three", key_name="ci"), tenant="acme")
        with pytest.raises(PoolError):
            await pool.respond(ask("cold"), tenant="acme")  # model_not_loaded
        with trio.move_on_after(0.3):  # cancelled mid-generation
            await pool.respond(ask("slow"), tenant="beta")
        await wait_until(lambda: pool.parts_for_tests().usage.written == 3)  # type: ignore[union-attr]
    rows = _rows(private_state)
    assert rows[0][:6] == ("ci", "acme", "m", 3, 0, 3)
    assert rows[0][8] == "success"
    assert isinstance(rows[0][6], float) and isinstance(rows[0][7], float)
    assert rows[1][1:3] == ("acme", "cold") and rows[1][8] == "model_not_loaded"
    assert rows[1][3:6] == (0, 0, 0) and rows[1][7] is None
    assert rows[2][0] is None and rows[2][1:3] == ("beta", "slow")
    assert rows[2][8] == "cancelled"
    # Cut after about 6 of its 50 tokens: charged its prompt and what was generated.
    assert rows[2][3] == 2 and 1 <= rows[2][5] < 50


async def _stream_until_cut(pool: Pool, model: str, outcome: list[object]) -> None:
    """Read ``model``'s stream to its end; its last event is kept."""
    async for event in pool.stream(ask(model, "one two three")):
        outcome[:] = [event]


async def test_a_stream_cut_by_the_drain_deadline_is_charged(private_state: Path) -> None:
    settings = build_settings(
        {
            "service": {"usage": {"flush_ms": 10}},
            "engine": {
                "unload_drain_s": 0.3,
                "models": {
                    "slow": {
                        "backend": "stub",
                        "enabled": True,
                        "stub_reply": " ".join(["w"] * 50),
                        "stub_tokens_per_second": 20,
                    }
                },
            },
        }
    )
    last: list[object] = []
    async with open_pool(settings) as pool, trio.open_nursery() as nursery:
        nursery.start_soon(_stream_until_cut, pool, "slow", last)
        await wait_until(lambda: bool(last))  # the first token is out
        await pool.unload("slow")
        await wait_until(lambda: pool.parts_for_tests().usage.written == 1)  # type: ignore[union-attr]
    assert isinstance(last[0], Failed)
    ((prompt, output, status),) = [(r[3], r[5], r[8]) for r in _rows(private_state)]
    assert status == last[0].error.code
    assert prompt == 3 and 1 <= output < 50


async def test_a_backend_failure_after_the_first_token_is_charged(
    private_state: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def fails_midway(self: StubRuntime, request: object, sink: TokenSink) -> None:
        sink.used.prompt_tokens = 7
        for produced, word in enumerate(("a ", "b ", "c "), start=1):
            await sink.send(word)
            sink.used.output_tokens = produced
        sink.used.output_tokens = 5  # two more generated, never sent
        raise BackendError("the runtime fell over")

    monkeypatch.setattr(StubRuntime, "generate", fails_midway)
    async with open_pool(_settings()) as pool:  # type: ignore[arg-type]
        with pytest.raises(PoolError) as failed:
            await pool.respond(ask("m", "x", key_name="k"), tenant="acme")
        await wait_until(lambda: pool.parts_for_tests().usage.written == 1)  # type: ignore[union-attr]
    assert failed.value.code == "backend_error"
    ((prompt, output, status),) = [(r[3], r[5], r[8]) for r in _rows(private_state)]
    assert (prompt, output, status) == (7, 5, "backend_error")


async def test_a_runtime_that_counts_no_tokens_is_charged_the_pieces_relayed(
    private_state: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def counts_nothing(self: StubRuntime, request: object, sink: TokenSink) -> None:
        for word in ("a ", "b ", "c ", "d "):
            await sink.send(word)
        raise BackendError("the upstream broke off")

    monkeypatch.setattr(StubRuntime, "generate", counts_nothing)
    async with open_pool(_settings()) as pool:  # type: ignore[arg-type]
        with pytest.raises(PoolError):
            await pool.respond(ask("m", "x"), tenant="acme")
        await wait_until(lambda: pool.parts_for_tests().usage.written == 1)  # type: ignore[union-attr]
    ((prompt, output, status),) = [(r[3], r[5], r[8]) for r in _rows(private_state)]
    assert (prompt, output, status) == (0, 4, "backend_error")


async def test_usage_sums_survive_a_restart(private_state: Path) -> None:
    for run in range(2):
        async with open_pool(_settings()) as pool:  # type: ignore[arg-type]
            for _ in range(3):
                await pool.respond(ask("m", "a b", key_name=f"k{run}"), tenant="acme")
        # Leaving the pool flushes what was still queued.
    async with open_pool(_settings()) as pool:  # type: ignore[arg-type]
        by_tenant = await pool.usage_totals("tenant")
        by_key = await pool.usage_totals("key")
    assert [(t.group, t.requests, t.prompt_tokens, t.output_tokens) for t in by_tenant] == [
        ("acme", 6, 12, 12)
    ]
    assert [(t.group, t.requests) for t in by_key] == [("k0", 3), ("k1", 3)]


async def test_embedded_requests_record_their_prompt(private_state: Path) -> None:
    settings = build_settings(
        {
            "service": {"usage": {"flush_ms": 10}},
            "engine": {"models": {"e": {"backend": "stub", "enabled": True, "embedding": True}}},
        }
    )
    async with open_pool(settings) as pool:
        await pool.embed(EmbeddingRequest("e", ("x y z", "w"), key_name="k"), tenant="t")
    rows = _rows(private_state)
    assert rows[0][:3] == ("k", "t", "e") and rows[0][3] > 0 and rows[0][5] == 0
    assert rows[0][8] == "success"


class _FullDisk:
    """A usage store on a disk that is full until ``full`` is cleared: its writes fail as
    SQLite's do (``database or disk is full``), then succeed."""

    def __init__(self) -> None:
        self.full = True
        self.calls = 0
        self.rows: list[UsageRecord] = []

    def append(self, records: Sequence[UsageRecord]) -> None:
        self.calls += 1
        if self.full:
            raise sqlite3.OperationalError("database or disk is full")
        self.rows.extend(records)

    def prune(self, before: float) -> int:
        if self.full:
            raise sqlite3.OperationalError("database or disk is full")
        return 0


def _usage(pool: Pool) -> UsageRecorder:
    usage = pool.parts_for_tests().usage
    assert usage is not None
    return usage


async def test_a_full_disk_holds_the_records_and_writes_them_when_space_returns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sink = _FullDisk()
    with caplog.at_level(logging.WARNING, logger="pool.usage"):
        async with open_pool(_settings(), usage_sink=sink) as pool:  # type: ignore[arg-type]
            for n in range(5):
                text = " ".join(["w"] * (n + 1))
                reply = await pool.respond(ask("m", text), tenant="acme")
                assert reply.text == text  # served all the same
                await wait_until(lambda n=n: _usage(pool).held == n + 1)  # type: ignore[misc]
            assert _metric(pool, "llm_pool_usage_records_held") == 5
            assert _usage(pool).written == _usage(pool).dropped == 0
            failing = [r.getMessage() for r in caplog.records if "writes failing" in r.getMessage()]
            # One line per interval, not one per batch.
            assert len(failing) == 1 and "disk is full" in failing[0], failing
            sink.full = False
            await wait_until(lambda: _usage(pool).written == 5)
            assert _metric(pool, "llm_pool_usage_records_held") == 0
            assert _metric(pool, "llm_pool_usage_records_written_total") == 5
            assert _usage(pool).dropped == 0
            # The held rows, in the order they came, then new ones behind them.
            await pool.respond(ask("m", "w w w w w w"), tenant="acme")
            await wait_until(lambda: _usage(pool).written == 6)
    assert [r.prompt_tokens for r in sink.rows] == [1, 2, 3, 4, 5, 6]
    assert any("writes recovered: 5" in r.getMessage() for r in caplog.records)


async def test_past_hold_records_the_oldest_held_rows_are_dropped() -> None:
    sink = _FullDisk()
    settings = _settings(hold_records=3, batch_size=1)
    async with open_pool(settings, usage_sink=sink) as pool:  # type: ignore[arg-type]
        for n in range(5):
            await pool.respond(ask("m", " ".join(["w"] * (n + 1))), tenant="acme")
        await wait_until(lambda: _usage(pool).dropped == 2)
        assert _usage(pool).held == 3
        assert _metric(pool, "llm_pool_usage_records_dropped_total", reason="hold_full") == 2
        sink.full = False
        await wait_until(lambda: _usage(pool).written == 3)
    assert [r.prompt_tokens for r in sink.rows] == [3, 4, 5]  # the newest three


async def test_rows_still_refused_at_shutdown_are_counted_dropped() -> None:
    sink = _FullDisk()
    async with open_pool(_settings(), usage_sink=sink) as pool:  # type: ignore[arg-type]
        for _ in range(4):
            await pool.respond(ask("m"), tenant="acme")
        await wait_until(lambda: _usage(pool).held == 4)
        usage = _usage(pool)
        calls = sink.calls
    assert sink.calls > calls  # one last try
    assert usage.dropped == 4 and usage.held == 0 and usage.written == 0
    assert usage.metrics.usage_dropped.labels("write_failed")._value.get() == 4


class _StalledDisk:
    """A disk whose writes hang until released (a full NFS mount, a dying drive)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()

    def append(self, records: Sequence[UsageRecord]) -> None:
        self.entered.set()
        self.release.wait(30)

    def prune(self, before: float) -> int:
        return 0


async def test_a_stalled_disk_never_stalls_requests() -> None:
    sink = _StalledDisk()
    try:
        async with open_pool(  # type: ignore[arg-type]
            _settings(queue_size=4, batch_size=1), usage_sink=sink
        ) as pool:
            await pool.respond(ask("m"), tenant="acme")
            await trio.to_thread.run_sync(sink.entered.wait, 10)
            # The writer hangs in the disk; the queue (4) fills; the rest are dropped.
            with trio.fail_after(10):
                for _ in range(50):
                    await pool.respond(ask("m"), tenant="acme")
            assert pool.parts_for_tests().usage.dropped >= 50 - 4  # type: ignore[union-attr]
            assert _metric(pool, "llm_pool_usage_records_dropped_total", reason="queue_full") >= 46
            # Shutting down does not wait on the hung write past its bound either.
            started = time.monotonic()
    finally:
        sink.release.set()
    assert time.monotonic() - started < 10


async def test_retention_prunes_old_records(private_state: Path) -> None:
    store = UsageStore(private_state / FILE_NAME)
    now = 2_000_000_000.0
    old = UsageRecord(now - 40 * 86400, None, "t", "m", 1, 0, 1, 0.0, None, "success")
    recent = UsageRecord(now - 10 * 86400, None, "t", "m", 2, 0, 2, 0.0, None, "success")
    store.append([old, recent])
    store.close()
    async with open_pool(_settings(retention_days=30), clock=lambda: now) as pool:  # type: ignore[arg-type]
        await wait_until(lambda: len(_rows(private_state)) == 1)
        totals = await pool.usage_totals("tenant")
    assert [(t.requests, t.prompt_tokens) for t in totals] == [(1, 2)]


async def test_turned_off_nothing_is_written(private_state: Path) -> None:
    async with open_pool(_settings(enabled=False)) as pool:  # type: ignore[arg-type]
        await pool.respond(ask("m"), tenant="acme")
        assert pool.parts_for_tests().usage is None
        with pytest.raises(PoolError) as info:
            await pool.usage_totals("tenant")
        assert info.value.code == "usage_disabled"
    assert not (private_state / FILE_NAME).exists()


async def test_tenant_token_counters_have_bounded_labels() -> None:
    async with open_pool(_settings(metrics_max_tenants=2)) as pool:  # type: ignore[arg-type]
        for tenant in ("a", "b", "c", "d"):
            await pool.respond(ask("m", "one two"), tenant=tenant)
        assert _metric(pool, "llm_pool_tenant_prompt_tokens_total", tenant="a") == 2
        assert _metric(pool, "llm_pool_tenant_output_tokens_total", tenant="b") == 2
        # c and d came after the first two tenants: one "other" series for both.
        assert _metric(pool, "llm_pool_tenant_prompt_tokens_total", tenant="c") == 0
        assert _metric(pool, "llm_pool_tenant_prompt_tokens_total", tenant="other") == 4


def test_store_groups_and_buckets(tmp_path: Path) -> None:
    store = UsageStore(tmp_path / FILE_NAME)
    day = 1_764_115_200.0  # 2025-11-26T00:00:00Z
    records = [
        UsageRecord(day + 60, "k1", "acme", "m1", 10, 4, 5, 1.0, 2.0, "success"),
        UsageRecord(day + 3700, "k1", "acme", "m2", 20, 0, 6, 1.0, 2.0, "success"),
        UsageRecord(day + 3800, "k2", "beta", "m1", 30, 0, 7, 1.0, None, "queue_full"),
        UsageRecord(day + 86400 + 5, None, "acme", "m1", 40, 0, 8, 1.0, 2.0, "success"),
    ]
    store.append(records)
    by_model = store.totals("model", since=day, until=day + 86400)
    assert [(t.group, t.requests, t.prompt_tokens, t.cached_tokens, t.output_tokens)
            for t in by_model] == [("m1", 2, 40, 4, 12), ("m2", 1, 20, 0, 6)]  # fmt: skip
    hourly = store.totals("tenant", bucket="hour", until=day + 86400)
    assert [(t.bucket, t.group, t.requests) for t in hourly] == [
        (day, "acme", 1),
        (day + 3600, "acme", 1),
        (day + 3600, "beta", 1),
    ]
    daily = store.totals("key", bucket="day")
    assert [(t.bucket, t.group, t.output_tokens) for t in daily] == [
        (day, "k1", 11),
        (day, "k2", 7),
        (day + 86400, None, 8),
    ]
    assert store.prune(day + 86400) == 3
    store.close()


def test_a_file_from_before_characters_gains_the_column(tmp_path: Path) -> None:
    path = tmp_path / FILE_NAME
    # The table as it shipped before speech (issue #41), with one row in it.
    with sqlite3.connect(path) as db:
        db.execute(
            "CREATE TABLE usage (at REAL NOT NULL, key TEXT, tenant TEXT NOT NULL,"
            " model TEXT NOT NULL, prompt_tokens INTEGER NOT NULL, cached_tokens INTEGER"
            " NOT NULL, output_tokens INTEGER NOT NULL, queue_ms REAL NOT NULL,"
            " generation_ms REAL, status TEXT NOT NULL)"
        )
        db.execute("INSERT INTO usage VALUES (1, NULL, 'acme', 'm', 3, 0, 4, 0, 1, 'success')")
    store = UsageStore(path)
    try:
        record = UsageRecord(2, None, "acme", "tts", 0, 0, 0, 0.0, 5.0, "success", characters=42)
        store.append([record])
        (total,) = store.totals("tenant")
        assert (total.requests, total.prompt_tokens, total.characters) == (2, 3, 42)
    finally:
        store.close()
    # Opened again: the column is there once, not added twice.
    again = UsageStore(path)
    try:
        assert [t.characters for t in again.totals("model")] == [0, 42]
    finally:
        again.close()


# Run in a child process: it lowers its own file-size limit (RLIMIT_FSIZE, no root
# needed) so that SQLite's writes past the files' sizes fail as on a full disk (EFBIG,
# SIGXFSZ ignored: "disk I/O error"), then lifts it again as space coming back.
_FILE_SIZE_LIMITED = """
import math, resource, signal, sqlite3, sys, time
from pathlib import Path

import trio

from pool.actors.accounting._usage import UsageRecorder
from pool.actors.accounting._usage_store import UsageRecord, UsageStore
from pool.actors.models._metrics import PoolMetrics
from pool.config import UsageSettings

folder = Path(sys.argv[1])
store = UsageStore(folder / "usage.sqlite3")


def record(n):
    return UsageRecord(time.time(), None, "acme", "m", n, 0, n, 1.0, 2.0, "success")


async def main():
    recorder = UsageRecorder(
        UsageSettings(flush_ms=10), store, PoolMetrics(lambda: []), limiter=store.write_limiter
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(recorder.run)
        recorder.record(record(0))
        await recorder.wait_settled(1)
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        largest = max(path.stat().st_size for path in folder.iterdir())
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (largest + 4096, hard))
        for n in range(1, 301):
            recorder.record(record(n))
            await trio.sleep(0.001)
        with trio.fail_after(30):
            while recorder.held + recorder.written < 301:
                await trio.sleep(0.01)
        held = recorder.held
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        with trio.fail_after(60):
            await recorder.wait_settled(301)
        print("held", held, "written", recorder.written, "dropped", recorder.dropped)
        nursery.cancel_scope.cancel()


trio.run(main)
with sqlite3.connect(folder / "usage.sqlite3") as db:
    rows = [n for (n,) in db.execute("SELECT prompt_tokens FROM usage ORDER BY rowid")]
print("rows", len(rows), "in order", rows == sorted(rows))
"""


def test_a_file_size_limit_is_a_full_disk_the_writer_rides_out(tmp_path: Path) -> None:
    """A real SQLite file that cannot grow: the rows are held, then written once it
    can, all of them and in order."""
    resource = pytest.importorskip("resource")
    if not hasattr(resource, "RLIMIT_FSIZE"):
        pytest.skip("no RLIMIT_FSIZE on this platform")
    script = tmp_path / "limited.py"
    script.write_text(_FILE_SIZE_LIMITED)
    folder = tmp_path / "state"
    folder.mkdir()
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, str(script), str(folder)],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    held, written, dropped = (int(x) for x in done.stdout.split()[1:6:2])
    assert held > 0, done.stdout  # the limit did refuse writes
    assert (written, dropped) == (301, 0), done.stdout
    assert "rows 301 in order True" in done.stdout, done.stdout
