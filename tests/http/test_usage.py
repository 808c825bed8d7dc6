"""``GET /v1/admin/usage`` and budget refusals over HTTP, on every dialect."""

from __future__ import annotations

import time

import httpx
import pytest
import trio

from .conftest import start_server

MODELS = {"echo": {"backend": "stub", "enabled": True}}


async def _usage(client: httpx.AsyncClient, **params: str) -> list[dict[str, object]]:
    reply = await client.get("/v1/admin/usage", params=params)
    assert reply.status_code == 200, reply.text
    rows: list[dict[str, object]] = reply.json()["usage"]
    return rows


async def _until_recorded(client: httpx.AsyncClient, requests: int) -> None:
    """Records reach the database within a flush (service.usage.flush_ms)."""
    with trio.fail_after(10):
        while sum(int(r["requests"]) for r in await _usage(client)) < requests:  # type: ignore[call-overload]
            await trio.sleep(0.02)


async def test_usage_by_tenant_model_and_hour(nursery: trio.Nursery) -> None:
    server = await start_server(nursery, MODELS, usage={"flush_ms": 10})
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
        await client.post(
            "/v1/responses", json={"model": "echo", "input": "a b c"}, headers={"X-Tenant-ID": "t1"}
        )
        await client.post(
            "/v1/chat/completions",
            json={"model": "echo", "messages": [{"role": "user", "content": "a b"}]},
            headers={"X-Tenant-ID": "t2"},
        )
        await client.post("/api/generate", json={"model": "echo", "prompt": "a", "stream": False})
        await _until_recorded(client, 3)
        by_tenant = await _usage(client, group_by="tenant")
        assert {r["tenant"]: (r["requests"], r["output_tokens"]) for r in by_tenant} == {
            "default": (1, 1),
            "t1": (1, 3),
            "t2": (1, 2),
        }
        fields = {"tenant", "requests", "prompt_tokens", "cached_tokens", "output_tokens",
                  "audio_seconds", "characters", "load_seconds"}  # fmt: skip
        assert all(set(r) == fields for r in by_tenant)
        (by_model,) = await _usage(client, group_by="model", since=str(time.time() - 3600))
        assert by_model["model"] == "echo" and by_model["requests"] == 3
        (by_key,) = await _usage(client, group_by="key")
        assert by_key["key"] is None  # no named keys on this pool
        hourly = await _usage(client, group_by="model", bucket="hour", since="2020-01-01T00:00:00Z")
        assert len(hourly) in (1, 2)  # the hour may have turned meanwhile
        assert str(hourly[0]["bucket"]).endswith(":00:00Z")
        assert await _usage(client, until="2020-01-01T00:00:00+00:00") == []
        # A window that ends before it starts is a valid query that holds nothing.
        assert await _usage(client, since=str(time.time()), until="100") == []


@pytest.mark.parametrize(
    ("params", "word"),
    [
        ({"group_by": "user"}, "group_by"),
        ({"bucket": "week"}, "bucket"),
        ({"since": "yesterday"}, "since"),
        ({"until": "nan"}, "until"),
    ],
)
async def test_bad_parameters_are_400(
    nursery: trio.Nursery, params: dict[str, str], word: str
) -> None:
    server = await start_server(nursery, MODELS)
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
        reply = await client.get("/v1/admin/usage", params=params)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["code"] == "invalid_request" and word in error["message"]


async def test_usage_turned_off_is_409(nursery: trio.Nursery) -> None:
    server = await start_server(nursery, MODELS, usage={"enabled": False})
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
        reply = await client.get("/v1/admin/usage")
    assert reply.status_code == 409 and reply.json()["error"]["code"] == "usage_disabled"


async def test_a_spent_budget_is_429_with_retry_after_on_every_dialect(
    nursery: trio.Nursery,
) -> None:
    server = await start_server(
        nursery, MODELS, budgets=[{"tenant": "metered", "tokens_per_day": 4}]
    )
    metered = {"X-Tenant-ID": "metered"}
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
        first = await client.post(
            "/v1/responses", json={"model": "echo", "input": "a b"}, headers=metered
        )
        assert first.status_code == 200
        refused = await client.post(
            "/v1/responses", json={"model": "echo", "input": "a"}, headers=metered
        )
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "budget_exceeded"
        assert refused.json()["error"]["budget"]["limit_tokens"] == 4
        assert 1 <= int(refused.headers["Retry-After"]) <= 86400
        chat = await client.post(
            "/v1/chat/completions",
            json={"model": "echo", "messages": [{"role": "user", "content": "a"}]},
            headers=metered,
        )
        assert chat.status_code == 429 and "Retry-After" in chat.headers
        ollama = await client.post(
            "/api/generate", json={"model": "echo", "prompt": "a", "stream": False}, headers=metered
        )
        assert ollama.status_code == 429 and "Retry-After" in ollama.headers
        free = await client.post("/v1/responses", json={"model": "echo", "input": "a"})
        assert free.status_code == 200
