"""Token budgets per key and tenant, per UTC day and month, with a clock the test moves."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pool import PoolError, open_pool
from pool.actors import Budgets, EmbeddingRequest, InferenceRequest
from pool.actors.accounting._budgets import Spent, Unit, window
from pool.config import BudgetRule, build_settings

from .helpers import ask as plain_ask

# The units a text request and a speech request spend (pool/actors/serving/_serving.py).
TEXT: tuple[Unit, ...] = ("tokens", "requests", "load_ms")
SPEECH: tuple[Unit, ...] = ("requests", "load_ms", "characters")


class Clock:
    """Seconds since the epoch, moved by the test."""

    def __init__(self, at: datetime) -> None:
        self.now = at.timestamp()

    def __call__(self) -> float:
        return self.now


def ask(text: str, key_name: str | None = None) -> InferenceRequest:
    # The echo stub answers with the prompt: N words cost N prompt + N output tokens.
    return dataclasses.replace(plain_ask("m", text), key_name=key_name)


def words(n: int) -> str:
    return " ".join(["w"] * n)


def _settings(budgets: list[dict[str, object]]) -> object:
    return build_settings(
        {
            "service": {"budgets": budgets},
            "engine": {"models": {"m": {"backend": "stub", "enabled": True}}},
        }
    )


async def test_a_daily_tenant_budget_is_hit_and_resets_at_utc_midnight() -> None:
    clock = Clock(datetime(2026, 3, 14, 23, 0, tzinfo=UTC))
    settings = _settings([{"tenant": "acme", "tokens_per_day": 50}])
    async with open_pool(settings, clock=clock) as pool:  # type: ignore[arg-type]
        await pool.respond(ask(words(20)), tenant="acme")  # 40 tokens
        await pool.respond(ask(words(5)), tenant="acme")  # 50: the budget is spent
        with pytest.raises(PoolError) as refused:
            await pool.respond(ask("x"), tenant="acme")
        error = refused.value
        assert error.code == "budget_exceeded" and error.status == 429
        assert error.retry_after_s == 3600  # until 2026-03-15T00:00:00Z
        assert error.details["budget"] == {
            "tenant": "acme",
            "period": "day",
            "window": "2026-03-14",
            "limit_tokens": 50,
            "spent_tokens": 50,
            "resets_at": int(datetime(2026, 3, 15, tzinfo=UTC).timestamp()),
        }
        # Another tenant is not affected.
        await pool.respond(ask(words(30)), tenant="beta")
        clock.now += 1800
        with pytest.raises(PoolError) as again:
            await pool.respond(ask("x"), tenant="acme")
        assert again.value.retry_after_s == 1800
        clock.now += 1800  # midnight UTC: a new day, a new budget
        await pool.respond(ask(words(20)), tenant="acme")
        refusals = _sample(pool, "llm_pool_budget_refusals_total", subject="tenant")
        assert refusals == 2


async def test_a_monthly_key_budget_waits_for_the_next_month() -> None:
    clock = Clock(datetime(2026, 12, 31, 12, 0, tzinfo=UTC))
    settings = _settings([{"key": "ci", "tokens_per_month": 10}])
    async with open_pool(settings, clock=clock) as pool:  # type: ignore[arg-type]
        await pool.respond(ask(words(6), key_name="ci"))  # 12 tokens: over, counted whole
        with pytest.raises(PoolError) as refused:
            await pool.respond(ask("x", key_name="ci"))
        assert refused.value.retry_after_s == 12 * 3600  # until 2027-01-01T00:00:00Z
        assert refused.value.details["budget"]["key"] == "ci"
        assert refused.value.details["budget"]["window"] == "2026-12"
        # The same tenant with another key, or with none, is not bound by the key's budget.
        await pool.respond(ask("x", key_name="other"))
        await pool.respond(ask("x"))
        clock.now = datetime(2027, 1, 1, tzinfo=UTC).timestamp()
        await pool.respond(ask("x", key_name="ci"))


async def test_of_several_spent_budgets_the_longest_wait_is_given() -> None:
    clock = Clock(datetime(2026, 5, 10, 6, 0, tzinfo=UTC))
    rules = [
        {"tenant": "acme", "tokens_per_day": 10, "tokens_per_month": 10},
        {"key": "k", "tokens_per_day": 1000},
    ]
    async with open_pool(_settings(rules), clock=clock) as pool:  # type: ignore[arg-type]
        await pool.respond(ask(words(5), key_name="k"), tenant="acme")
        with pytest.raises(PoolError) as refused:
            await pool.respond(ask("x", key_name="k"), tenant="acme")
        month_end = datetime(2026, 6, 1, tzinfo=UTC).timestamp()
        assert refused.value.retry_after_s == month_end - clock.now
        assert refused.value.details["budget"]["period"] == "month"


async def test_failed_requests_cost_nothing() -> None:
    clock = Clock(datetime(2026, 5, 10, tzinfo=UTC))
    settings = build_settings(
        {
            "service": {"budgets": [{"tenant": "acme", "tokens_per_day": 5}]},
            "engine": {"models": {"m": {"backend": "stub"}}},  # not loaded
        }
    )
    async with open_pool(settings, clock=clock) as pool:
        for _ in range(3):
            with pytest.raises(PoolError) as info:
                await pool.respond(ask(words(10)), tenant="acme")
            assert info.value.code == "model_not_loaded"


def test_windows_follow_utc_calendar_boundaries() -> None:
    leap = datetime(2028, 2, 29, 23, 59, 59, tzinfo=UTC).timestamp()
    assert window("day", leap).id == "2028-02-29"
    assert window("day", leap).ends_at == datetime(2028, 3, 1, tzinfo=UTC).timestamp()
    assert window("month", leap).id == "2028-02"
    assert window("month", leap).ends_at == datetime(2028, 3, 1, tzinfo=UTC).timestamp()
    new_year = datetime(2026, 12, 31, 23, 0, tzinfo=UTC).timestamp()
    assert window("month", new_year).ends_at == datetime(2027, 1, 1, tzinfo=UTC).timestamp()


def test_a_rule_names_one_subject_and_a_limit() -> None:
    with pytest.raises(ValueError, match="exactly one of key and tenant"):
        BudgetRule(key="a", tenant="b", tokens_per_day=1)
    with pytest.raises(ValueError, match="tokens_per_day, tokens_per_month, requests_per_day"):
        BudgetRule(tenant="b")
    assert BudgetRule(tenant="b", requests_per_month=3).requests_per_month == 3
    assert not Budgets(()).enabled


def _sample(pool: object, name: str, **labels: str) -> float:
    text = pool.render_metrics().decode()  # type: ignore[attr-defined]
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


async def test_a_restarted_pool_remembers_what_its_budgets_spent(private_state: Path) -> None:
    """Local budgets start from the usage database: a restart within the window gives no
    tokens back, and what was spent in an earlier window is not counted."""
    clock = Clock(datetime(2026, 3, 14, 10, 0, tzinfo=UTC))
    settings = build_settings(
        {
            "service": {
                "budgets": [
                    {"tenant": "acme", "tokens_per_day": 50},
                    {"key": "ci", "tokens_per_month": 100},
                ],
                "usage": {"flush_ms": 10},
            },
            "engine": {"models": {"m": {"backend": "stub", "enabled": True}}},
        }
    )
    async with open_pool(settings, clock=clock) as pool:
        await pool.respond(ask(words(20), key_name="ci"), tenant="acme")  # 40 tokens
    clock.now += 3600  # the same day
    async with open_pool(settings, clock=clock) as pool:
        await pool.respond(ask(words(5)), tenant="acme")  # 50: spent across the restart
        with pytest.raises(PoolError) as refused:
            await pool.respond(ask("x"), tenant="acme")
        assert refused.value.details["budget"]["spent_tokens"] == 50
        # The key's monthly budget counted the first pool's 40 tokens as well.
        await pool.respond(ask(words(25), key_name="ci"), tenant="other")  # 40 + 50
        await pool.respond(ask(words(5), key_name="ci"), tenant="other")  # 100: spent
        with pytest.raises(PoolError) as key_spent:
            await pool.respond(ask("x", key_name="ci"), tenant="other")
        assert key_spent.value.details["budget"]["key"] == "ci"
    clock.now += 86400  # the next day: the tenant's day budget is whole again
    async with open_pool(settings, clock=clock) as pool:
        await pool.respond(ask(words(20)), tenant="acme")
        with pytest.raises(PoolError):  # but the key's month is still spent
            await pool.respond(ask("x", key_name="ci"), tenant="acme")


async def test_a_request_budget_counts_requests_whatever_they_used(private_state: Path) -> None:
    """Where no tokens apply (an image), a budget counts requests: every request that
    reached a model, a refused one too; a restart gives none back."""
    clock = Clock(datetime(2026, 6, 1, 22, 0, tzinfo=UTC))
    settings = build_settings(
        {
            "service": {
                "budgets": [{"tenant": "acme", "requests_per_day": 3, "tokens_per_day": 1000}],
                "usage": {"flush_ms": 10},
            },
            "engine": {"models": {"m": {"backend": "stub", "enabled": True}}},
        }
    )
    async with open_pool(settings, clock=clock) as pool:  # type: ignore[arg-type]
        await pool.respond(ask("one"), tenant="acme")
        # A request of the wrong kind reached the model: it counts too.
        with pytest.raises(PoolError) as wrong:
            await pool.embed(EmbeddingRequest("m", ("x",)), tenant="acme")
        assert wrong.value.code == "wrong_model_kind"
    clock.now += 60
    async with open_pool(settings, clock=clock) as pool:  # type: ignore[arg-type]
        await pool.respond(ask("three"), tenant="acme")
        with pytest.raises(PoolError) as refused:
            await pool.respond(ask("four"), tenant="acme")
        assert refused.value.code == "budget_exceeded"
        budget = refused.value.details["budget"]
        assert budget["limit_requests"] == 3 and budget["spent_requests"] == 3
        assert "3 requests per day" in refused.value.message
        # Tokens were few: the token budget is not what ran out.
        assert "limit_tokens" not in budget
        await pool.respond(ask("other"), tenant="beta")
        clock.now += 7200  # the next UTC day
        await pool.respond(ask("again"), tenant="acme")


def test_characters_budgets_count_speech_and_refuse_only_speech() -> None:
    clock = Clock(datetime(2026, 3, 14, 12, 0, tzinfo=UTC))
    rules = [
        BudgetRule(tenant="acme", tokens_per_day=100, characters_per_month=1000),
    ]
    budgets = Budgets(rules, clock=clock)
    budgets.charge("acme", None, Spent(characters=600))
    budgets.charge("acme", None, Spent(tokens=40, characters=400))  # 1000 characters: spent
    budgets.check("acme", None, TEXT)  # tokens: 40 of 100
    with pytest.raises(PoolError) as refused:
        budgets.check("acme", None, SPEECH)
    assert refused.value.details["budget"] == {
        "tenant": "acme",
        "period": "month",
        "window": "2026-03",
        "limit_characters": 1000,
        "spent_characters": 1000,
        "resets_at": int(datetime(2026, 4, 1, tzinfo=UTC).timestamp()),
    }
    budgets.charge("acme", None, Spent(tokens=60))
    with pytest.raises(PoolError) as tokens:
        budgets.check("acme", None, TEXT)
    assert tokens.value.details["budget"]["limit_tokens"] == 100
    with pytest.raises(ValueError, match="characters_per_day"):
        BudgetRule(tenant="acme")
