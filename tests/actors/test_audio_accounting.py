"""Audio seconds in the accounting: the usage rows (and a database written before the
column existed), budgets that cap them across a restart, and the metric.

The job is the test's own, on a stub model of kind ``transcription``: it reports the
audio seconds a transcription would, so the pool's part is what is tested (the real
model's are in tests/backends/test_whisper.py)."""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import ClassVar

import pytest

from pool import PoolError, open_pool
from pool.actors import TaskRequest, UsageRecord, UsageStore
from pool.actors.accounting._usage_store import FILE_NAME
from pool.backends import ModelKind, Runtime, TaskJob, TaskResult, TaskSink, TaskUsage
from pool.config import BudgetRule, build_settings

from .helpers import ask, wait_until
from .test_budgets import Clock


@dataclass(frozen=True, slots=True)
class HeardJob(TaskJob):
    """Answers at once, charged ``seconds`` of audio."""

    served_by: ClassVar[frozenset[ModelKind]] = frozenset({"transcription"})
    operation: ClassVar[str] = "transcription"
    model: str
    seconds: float
    request_id: str = ""

    async def run(self, runtime: Runtime, sink: TaskSink) -> TaskResult:
        return TaskResult("heard", TaskUsage(audio_seconds=self.seconds))


def _settings(budgets: list[dict[str, object]]) -> object:
    return build_settings(
        {
            "service": {"budgets": budgets, "usage": {"flush_ms": 10}},
            "engine": {
                "models": {
                    "ears": {"backend": "stub", "enabled": True, "kind": "transcription"},
                    "chat": {"backend": "stub", "enabled": True},
                }
            },
        }
    )


def _heard(seconds: float) -> TaskRequest:
    return TaskRequest("ears", HeardJob("ears", seconds))


async def test_an_audio_budget_caps_seconds_and_survives_a_restart(private_state: Path) -> None:
    clock = Clock(datetime(2026, 3, 14, 10, 0, tzinfo=UTC))
    settings = _settings([{"tenant": "acme", "audio_seconds_per_day": 60}])
    async with open_pool(settings, clock=clock) as pool:  # type: ignore[arg-type]
        await pool.run_task(_heard(40.2), tenant="acme")  # counts 41
        await pool.run_task(_heard(19.0), tenant="acme")  # 60: spent
        with pytest.raises(PoolError) as refused:
            await pool.run_task(_heard(1.0), tenant="acme")
        error = refused.value
        assert error.code == "budget_exceeded" and error.retry_after_s == 14 * 3600
        assert error.details["budget"] == {
            "tenant": "acme",
            "period": "day",
            "window": "2026-03-14",
            "limit_audio_seconds": 60,
            "spent_audio_seconds": 60,
            "resets_at": int(datetime(2026, 3, 15, tzinfo=UTC).timestamp()),
        }
        assert "60 seconds of audio per day" in error.message
        # Tokens are not audio: the tenant's chat goes on; another tenant's audio too.
        await pool.respond(ask("chat"), tenant="acme")
        await pool.run_task(_heard(90.0), tenant="other")
        usage = pool.parts_for_tests().usage
        assert usage is not None
        await wait_until(lambda: usage.written == 5)
        metrics = pool.render_metrics().decode()
    assert 'llm_pool_audio_seconds_total{model="ears"} 149.2' in metrics
    with sqlite3.connect(private_state / FILE_NAME) as db:
        rows = db.execute("SELECT tenant, model, status, audio_seconds FROM usage").fetchall()
    assert rows == [
        ("acme", "ears", "success", 40.2),
        ("acme", "ears", "success", 19.0),
        ("acme", "ears", "budget_exceeded", 0.0),
        ("acme", "chat", "success", 0.0),
        ("other", "ears", "success", 90.0),
    ]
    clock.now += 3600  # the same day: the rows give the budget back its count
    async with open_pool(settings, clock=clock) as pool:  # type: ignore[arg-type]
        with pytest.raises(PoolError) as again:
            await pool.run_task(_heard(1.0), tenant="acme")
        assert again.value.details["budget"]["spent_audio_seconds"] == 60
    clock.now += 86400  # the next day: whole again
    async with open_pool(settings, clock=clock) as pool:  # type: ignore[arg-type]
        await pool.run_task(_heard(59.0), tenant="acme")


def test_a_rule_may_cap_audio_alone() -> None:
    assert BudgetRule(key="k", audio_seconds_per_month=3600).audio_seconds_per_month == 3600
    with pytest.raises(ValueError, match="audio_seconds_per_day"):
        BudgetRule(tenant="t")


def test_a_database_from_before_audio_seconds_gains_the_column(tmp_path: Path) -> None:
    path = tmp_path / FILE_NAME
    with sqlite3.connect(path) as db:
        db.executescript(
            """
            CREATE TABLE usage (
                at REAL NOT NULL, key TEXT, tenant TEXT NOT NULL, model TEXT NOT NULL,
                prompt_tokens INTEGER NOT NULL, cached_tokens INTEGER NOT NULL,
                output_tokens INTEGER NOT NULL, queue_ms REAL NOT NULL, generation_ms REAL,
                status TEXT NOT NULL
            );
            INSERT INTO usage VALUES (100.0, NULL, 'acme', 'm', 3, 0, 4, 1.0, 2.0, 'success');
            """
        )
    db.close()
    store = UsageStore(path)
    store.append([UsageRecord(200.0, None, "acme", "w", 0, 0, 9, 1.0, 2.0, "success", 12.5)])
    (total,) = store.totals("tenant")
    assert (total.requests, total.output_tokens, total.audio_seconds) == (2, 13, 12.5)
    by_model = {t.group: t.audio_seconds for t in store.totals("model")}
    assert by_model == {"m": 0.0, "w": 12.5}
    store.close()
    # Opened again (the column is there now): nothing to add, nothing lost.
    store = UsageStore(path)
    assert store.totals("tenant")[0].audio_seconds == 12.5
    store.close()
