"""The caller a key makes (pool/actors/serving/_caller.py): its name on the request, and its own
request rate (``rate_limit_rpm``) beside its tenant's limits."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import trio

from pool import PoolError, open_pool
from pool.actors import CALLER, Caller, InferenceRequest
from pool.actors.serving import _serving as serving_module
from pool.config import build_settings

from .helpers import ask


def _settings(**tenant_limits: object) -> object:
    return build_settings(
        {
            "service": {"tenancy": {"tenants": {"metered": tenant_limits}}},
            "engine": {
                "models": {"m": {"backend": "stub", "enabled": True, "target_inflight": 64}}
            },
        }
    )


async def test_a_keys_rate_is_its_minute_at_once_then_even(autojump_clock: trio.abc.Clock) -> None:
    async with open_pool(_settings()) as pool:  # type: ignore[arg-type]
        token = CALLER.set(Caller("batch", rate_limit_rpm=6))
        try:
            admitted: list[float] = []
            start = trio.current_time()
            while trio.current_time() - start < 300:
                try:
                    await pool.respond(ask("m"))
                    admitted.append(trio.current_time() - start)
                except PoolError as exc:
                    assert exc.code == "rate_limit_exceeded"
                    assert exc.details["key"] == "batch" and exc.details["limit"] == 6
                    assert exc.retry_after_s is not None and exc.retry_after_s > 0
                    await trio.sleep(exc.retry_after_s)
        finally:
            CALLER.reset(token)
        # The minute's 6 at once, then one every 10 s: at 10, 20, ..., 290 s.
        assert admitted[:6] == [0] * 6
        assert len(admitted) == 6 + 29
        assert all(b - a == pytest.approx(10.0) for a, b in itertools.pairwise(admitted[5:]))
        # Without the key, nothing limits the same pool.
        for _ in range(20):
            await pool.respond(ask("m"))


async def test_below_one_a_minute_the_first_request_still_passes(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with open_pool(_settings()) as pool:  # type: ignore[arg-type]
        token = CALLER.set(Caller("rare", rate_limit_rpm=0.5))
        try:
            await pool.respond(ask("m"))
            with pytest.raises(PoolError) as info:
                await pool.respond(ask("m"))
            assert info.value.retry_after_s == pytest.approx(120.0)
            await trio.sleep(120)
            await pool.respond(ask("m"))
        finally:
            CALLER.reset(token)


async def test_a_refusal_by_the_tenant_costs_the_key_nothing(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with open_pool(_settings(requests_per_minute=1)) as pool:  # type: ignore[arg-type]
        token = CALLER.set(Caller("k", rate_limit_rpm=2))
        try:
            await pool.respond(ask("m"), tenant="metered")
            for _ in range(5):  # refused by the tenant's limit, not charged to the key
                with pytest.raises(PoolError) as info:
                    await pool.respond(ask("m"), tenant="metered")
                assert info.value.details["tenant"] == "metered"
            # The key still has the second of its two.
            await pool.respond(ask("m"), tenant="other")
            with pytest.raises(PoolError) as info:
                await pool.respond(ask("m"), tenant="other")
            assert info.value.details["key"] == "k"
        finally:
            CALLER.reset(token)


async def test_admission_names_the_request_after_its_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``InferenceRequest.key_name`` is set from the authenticated caller."""
    seen: list[InferenceRequest] = []
    build = serving_module.build_generation_request

    def recording(request: InferenceRequest, **kwargs: Any) -> Any:
        seen.append(request)
        return build(request, **kwargs)

    monkeypatch.setattr(serving_module, "build_generation_request", recording)
    async with open_pool(_settings()) as pool:  # type: ignore[arg-type]
        await pool.respond(InferenceRequest.prompt("m", "anonymous"))
        token = CALLER.set(Caller("alice", rate_limit_rpm=1))
        try:
            await pool.respond(InferenceRequest.prompt("m", "from alice"))
            with pytest.raises(PoolError) as info:
                await pool.respond(InferenceRequest.prompt("m", "again"))
            assert info.value.code == "rate_limit_exceeded"
        finally:
            CALLER.reset(token)
    # (The refused one was built before its rate limit refused it.)
    assert [r.key_name for r in seen] == [None, "alice", "alice"]
