"""Per-tenant rate limits, backpressure figures and Prometheus counters."""

from __future__ import annotations

import itertools

import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from pool import PoolError, open_pool
from pool.config import build_settings

from .helpers import Outcome, ask, run_request, stub_settings, wait_until


def _limited(**limits: object) -> object:
    return build_settings(
        {
            "service": {"tenancy": {"tenants": {"metered": limits}}},
            "engine": {
                "models": {"m": {"backend": "stub", "enabled": True, "target_inflight": 64}}
            },
        }
    )


async def test_sustained_request_rate_is_exact(autojump_clock: trio.abc.Clock) -> None:
    async with open_pool(_limited(requests_per_minute=30, burst=5)) as pool:  # type: ignore[arg-type]
        admitted: list[float] = []
        refused = 0
        start = trio.current_time()
        while trio.current_time() - start < 600:
            try:
                await pool.respond(ask("m"), tenant="metered")
                admitted.append(trio.current_time() - start)
            except PoolError as exc:
                assert exc.code == "rate_limit_exceeded" and exc.status == 429
                assert exc.retry_after_s is not None and exc.retry_after_s > 0
                assert exc.details["limit"] == 30 and exc.details["remaining"] == 0
                assert exc.details["reset_at"] > 0
                refused += 1
                await trio.sleep(exc.retry_after_s)
        # 5 at once (the burst), then one every 2 s: at 2, 4, ..., 598 s.
        assert len(admitted) == 5 + 299
        assert admitted[:5] == [0, 0, 0, 0, 0]
        gaps = [b - a for a, b in itertools.pairwise(admitted[4:])]
        assert all(g == pytest.approx(2.0) for g in gaps)
        assert refused > 0


async def test_other_tenants_are_not_slowed(autojump_clock: trio.abc.Clock) -> None:
    async with open_pool(_limited(requests_per_minute=1)) as pool:  # type: ignore[arg-type]
        await pool.respond(ask("m"), tenant="metered")
        with pytest.raises(PoolError):
            await pool.respond(ask("m"), tenant="metered")
        before = trio.current_time()
        for _ in range(50):
            await pool.respond(ask("m"), tenant="free")
        assert trio.current_time() == before  # no waiting at all for the other tenant


async def test_token_budget_refuses_until_refilled(autojump_clock: trio.abc.Clock) -> None:
    async with open_pool(_limited(tokens_per_minute=60)) as pool:  # type: ignore[arg-type]
        text = " ".join(["w"] * 40)  # 40 prompt + 40 output tokens with the echo stub
        await pool.respond(ask("m", text), tenant="metered")
        with pytest.raises(PoolError) as info:
            await pool.respond(ask("m", "x"), tenant="metered")
        assert info.value.code == "rate_limit_exceeded"
        await trio.sleep(info.value.retry_after_s or 0)
        await pool.respond(ask("m", "x"), tenant="metered")


async def test_queue_full_says_when_to_retry(autojump_clock: trio.abc.Clock) -> None:
    settings = stub_settings(
        {"m": {"stub_reply": "a", "stub_tokens_per_second": 2, "max_queue": 1}}
    )
    async with open_pool(settings) as pool:
        await pool.load("m")
        for _ in range(4):  # history: one completion every 0.5 s
            await pool.respond(ask("m"))
        async with trio.open_nursery() as nursery:
            for _ in range(2):
                nursery.start_soon(pool.respond, ask("m"))
            await wait_until(lambda: pool.snapshot("m").inflight_requests == 2)
            with pytest.raises(PoolError) as info:
                await pool.respond(ask("m"))
        assert info.value.code == "queue_full"
        assert info.value.retry_after_s == pytest.approx(1.0, abs=0.5)
        assert info.value.details["queue_depth"] == 1 and info.value.details["max_depth"] == 1
        stats = pool.model("m").scheduler.stats
        assert stats.avg_wait_ms >= 0 and stats.p95_wait_ms >= stats.avg_wait_ms


async def test_metrics_counters_match_requests(autojump_clock: trio.abc.Clock) -> None:
    settings = stub_settings(
        {"m": {"enabled": True, "max_queue": 0, "stub_tokens_per_second": 10}, "off": {}}
    )
    async with open_pool(settings) as pool:
        for _ in range(3):
            await pool.respond(ask("m", "a b"), tenant="t1")
        with pytest.raises(PoolError):
            await pool.respond(ask("off"), tenant="t2")
        outcome = Outcome()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_request, pool, ask("m", "x y z"), outcome)
            await wait_until(lambda: pool.snapshot("m").running == 1)
            with pytest.raises(PoolError):
                await pool.respond(ask("m"), tenant="t1")  # queue_full
        families = {
            f.name: f for f in text_string_to_metric_families(pool.render_metrics().decode())
        }
        requests = {
            (s.labels["model"], s.labels["tenant"], s.labels["status"]): s.value
            for s in families["llm_pool_requests"].samples
            if s.name == "llm_pool_requests_total"
        }
        assert requests == {
            ("m", "t1", "success"): 3,
            ("off", "t2", "model_not_loaded"): 1,
            ("m", "default", "success"): 1,
            ("m", "t1", "queue_full"): 1,
        }
        tokens = [
            s.value
            for s in families["llm_pool_generated_tokens"].samples
            if s.name.endswith("_total")
        ]
        assert tokens == [3 * 2 + 3]
        states = {
            (s.labels["model"], s.labels["state"]): s.value
            for s in families["llm_pool_model_state"].samples
        }
        assert states[("m", "loaded")] == 1 and states[("off", "unloaded")] == 1
        loads = {
            s.labels["outcome"]: s.value
            for s in families["llm_pool_model_loads"].samples
            if s.name.endswith("_total")
        }
        assert loads == {"loaded": 1}
        inflight = [
            s.value
            for s in families["llm_pool_inflight_requests"].samples
            if s.labels["model"] == "m"
        ]
        assert inflight == [0]
