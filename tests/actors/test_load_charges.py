"""Loads charged to whoever caused them: usage rows, budgets, fair scheduling (#46)."""

from __future__ import annotations

import dataclasses
import sqlite3
from pathlib import Path

import pytest
import trio

from pool import PoolError, open_pool
from pool.actors import InferenceRequest, UsageRecord, UsageStore
from pool.actors.accounting._usage_store import FILE_NAME
from pool.actors.models._scheduler import Scheduler
from pool.actors.models._ticket import Ticket
from pool.backends import Decoding, GenerationRequest, TextPart, Turn
from pool.config import build_settings

from .helpers import ask as plain_ask
from .helpers import wait_until

LOAD_S = 0.4


def ask(model: str, key_name: str | None = None) -> InferenceRequest:
    return dataclasses.replace(plain_ask(model, "hello world"), key_name=key_name)


def _settings(budgets: list[dict[str, object]] | None = None) -> object:
    return build_settings(
        {
            "service": {"usage": {"flush_ms": 10}, "budgets": budgets or []},
            "engine": {
                "models": {
                    "lazy": {"backend": "stub", "on_demand": True, "stub_load_seconds": LOAD_S},
                    "warm": {"backend": "stub", "enabled": True},
                }
            },
        }
    )


def _rows(state: Path) -> list[tuple[object, ...]]:
    with sqlite3.connect(state / FILE_NAME) as db:
        return db.execute(
            "SELECT key, tenant, model, status, load_seconds FROM usage ORDER BY rowid"
        ).fetchall()


async def test_the_request_that_starts_a_load_is_charged_its_seconds(
    private_state: Path,
) -> None:
    async with open_pool(_settings()) as pool:  # type: ignore[arg-type]
        await pool.respond(ask("lazy", key_name="ci"), tenant="acme")
        await pool.respond(ask("lazy", key_name="ci"), tenant="acme")  # loaded: no charge
        await pool.respond(ask("warm"), tenant="beta")
        await wait_until(lambda: pool.parts_for_tests().usage.written == 3)  # type: ignore[union-attr]
        by_tenant = {t.group: t for t in await pool.usage_totals("tenant")}
        by_key = {t.group: t for t in await pool.usage_totals("key")}
    rows = _rows(private_state)
    assert [r[:4] for r in rows] == [
        ("ci", "acme", "lazy", "success"),
        ("ci", "acme", "lazy", "success"),
        (None, "beta", "warm", "success"),
    ]
    first, second, other = (float(r[4]) for r in rows)  # type: ignore[arg-type]
    assert LOAD_S <= first < LOAD_S + 1.0
    assert second == 0.0 and other == 0.0
    assert by_tenant["acme"].load_seconds == pytest.approx(first)
    assert by_tenant["beta"].load_seconds == 0.0
    assert by_key["ci"].load_seconds == pytest.approx(first)


async def test_a_client_that_leaves_during_the_load_is_still_charged(
    private_state: Path,
) -> None:
    async with open_pool(_settings()) as pool:  # type: ignore[arg-type]
        with trio.move_on_after(LOAD_S / 4):
            await pool.respond(ask("lazy"), tenant="acme")
        await wait_until(lambda: pool.snapshot("lazy").state == "loaded")
        await wait_until(lambda: pool.parts_for_tests().usage.written == 2)  # type: ignore[union-attr]
    (left, load) = _rows(private_state)
    assert left[1:4] == ("acme", "lazy", "cancelled") and left[4] == 0.0
    assert load[1:4] == ("acme", "lazy", "load") and float(load[4]) >= LOAD_S  # type: ignore[arg-type]


async def test_a_load_seconds_budget_stops_the_tenant_that_swaps(private_state: Path) -> None:
    budgets = [{"tenant": "swapper", "load_seconds_per_day": LOAD_S / 2}]
    async with open_pool(_settings(budgets)) as pool:  # type: ignore[arg-type]
        await pool.respond(ask("lazy"), tenant="swapper")
        with pytest.raises(PoolError) as refused:
            await pool.respond(ask("warm"), tenant="swapper")
        assert refused.value.code == "budget_exceeded"
        assert "load seconds per day" in refused.value.message
        budget = refused.value.details["budget"]  # type: ignore[index]
        assert budget["limit_load_seconds"] == LOAD_S / 2
        assert budget["spent_load_seconds"] >= LOAD_S
        await pool.respond(ask("warm"), tenant="other")  # others go on


async def test_a_restarted_pool_remembers_load_seconds_spent(private_state: Path) -> None:
    budgets = [{"tenant": "swapper", "load_seconds_per_day": LOAD_S / 2}]
    async with open_pool(_settings(budgets)) as pool:  # type: ignore[arg-type]
        await pool.respond(ask("lazy"), tenant="swapper")
        await wait_until(lambda: pool.parts_for_tests().usage.written == 1)  # type: ignore[union-attr]
    async with open_pool(_settings(budgets)) as pool:  # type: ignore[arg-type]
        with pytest.raises(PoolError) as refused:
            await pool.respond(ask("warm"), tenant="swapper")
        assert refused.value.code == "budget_exceeded"


def test_an_older_usage_file_gets_the_load_seconds_column(tmp_path: Path) -> None:
    path = tmp_path / FILE_NAME
    with sqlite3.connect(path) as db:
        db.executescript(
            "CREATE TABLE usage (at REAL NOT NULL, key TEXT, tenant TEXT NOT NULL,"
            " model TEXT NOT NULL, prompt_tokens INTEGER NOT NULL, cached_tokens INTEGER"
            " NOT NULL, output_tokens INTEGER NOT NULL, queue_ms REAL NOT NULL,"
            " generation_ms REAL, status TEXT NOT NULL);"
            "INSERT INTO usage VALUES (1.0, NULL, 'old', 'm', 1, 0, 1, 0.0, NULL, 'success');"
        )
    db.close()
    store = UsageStore(path)
    try:
        store.append(
            [UsageRecord(2.0, None, "new", "m", 1, 0, 1, 0.0, None, "success", load_seconds=1.5)]
        )
        totals = {t.group: t.load_seconds for t in store.totals("tenant")}
    finally:
        store.close()
    assert totals == {"old": 0.0, "new": 1.5}


def _ticket(tenant: str, tag: str) -> Ticket:
    request = GenerationRequest(
        request_id=tag, model="m", turns=(Turn("user", (TextPart(tag),)),), decoding=Decoding()
    )
    return Ticket(request, tenant=tenant)


class _OneSlot:
    capacity = 1
    inflight = 0

    def __init__(self) -> None:
        self.started: list[str] = []

    def start_job(self, ticket: Ticket) -> None:
        self.inflight += 1
        self.started.append(ticket.request.request_id)


def _drain(scheduler: Scheduler, slot: _OneSlot) -> list[str]:
    while scheduler.queue_depth:
        slot.inflight -= 1
        scheduler.job_finished()
    return slot.started[1:]


async def test_a_tenant_that_caused_a_load_yields_turns_to_the_others() -> None:
    scheduler = Scheduler(max_queue=100)
    slot = _OneSlot()
    scheduler.set_replicas([slot])
    scheduler.enqueue(_ticket("x", "blocker"))
    # "swapper" made the model load for 3 s: three turns behind the others.
    scheduler.charge_load("swapper", 3.0)
    for tag in ("s1", "s2"):
        scheduler.enqueue(_ticket("swapper", tag))
    for tag in ("a1", "a2", "a3", "a4"):
        scheduler.enqueue(_ticket("a", tag))
    assert _drain(scheduler, slot) == ["a1", "a2", "a3", "s1", "a4", "s2"]


async def test_without_loads_the_round_robin_is_unchanged() -> None:
    scheduler = Scheduler(max_queue=100)
    slot = _OneSlot()
    scheduler.set_replicas([slot])
    scheduler.enqueue(_ticket("x", "blocker"))
    scheduler.charge_load("swapper", 0.5)  # under one turn: no charge
    for tag in ("s1", "s2"):
        scheduler.enqueue(_ticket("swapper", tag))
    for tag in ("a1", "a2"):
        scheduler.enqueue(_ticket("a", tag))
    assert _drain(scheduler, slot) == ["s1", "a1", "s2", "a2"]
