"""The admin API and the runner API over HTTP."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families

from pool.http._auth import sign_op_token

from .conftest import start_server

ROW_FIELDS = {
    "name", "resolved_backend", "configured_enabled", "runtime_state", "is_loaded", "replicas",
    "replica_max", "loaded_replicas", "inflight_requests", "queue_depth", "runtime_inflight",
    "configured_target_inflight", "effective_target_inflight", "last_error", "vram_estimate_mib",
    "vram_estimate_replica_count", "vram_estimate_source", "observed_load_delta", "gpus",
    "load_constraints",
    "load_recommendations", "load_override", "capabilities", "definition",
}  # fmt: skip


async def test_rows_have_every_field(client: httpx.AsyncClient) -> None:
    rows = (await client.get("/v1/admin/models")).json()["models"]
    assert [r["name"] for r in rows] == ["echo", "slow", "cold", "single"]
    for row in rows:
        assert set(row) == ROW_FIELDS
    single = (await client.get("/v1/admin/models/single")).json()
    assert single["load_constraints"]["exllama_cache_size"] == {
        "kind": "integer",
        "minimum": 256,
        "step": 256,
    }
    assert single["capabilities"] == {
        "modalities": ["text"],
        "multi_turn": False,
        "thinking_modes": ["default"],
    }
    missing = await client.get("/v1/admin/models/nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "unknown_model"


async def test_load_unload_and_validation(client: httpx.AsyncClient) -> None:
    assert (
        await client.post("/v1/admin/models/single/load", json={"exllama_cache_size": 0})
    ).status_code == 422
    bad = await client.post("/v1/admin/models/single/load", json={"exllama_cache_size": 8000})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_load_request"
    failed = await client.post("/v1/admin/models/single/load")
    assert failed.status_code == 500 and failed.json()["error"]["code"] == "load_failed"
    assert "not available" in failed.json()["error"]["last_error"]
    row = (await client.get("/v1/admin/models/single")).json()
    assert row["runtime_state"] == "failed" and row["last_error"]
    loaded = await client.post("/v1/admin/models/cold/load", json={})
    assert loaded.status_code == 200 and loaded.json()["runtime_state"] == "loaded"
    assert (await client.post("/v1/admin/models/cold/load")).json()["runtime_state"] == "loaded"
    listed = {m["id"] for m in (await client.get("/v1/models")).json()["data"]}
    assert listed == {"echo", "slow", "cold"}
    unloaded = await client.post("/v1/admin/models/cold/unload")
    assert unloaded.json()["runtime_state"] == "unloaded"
    assert (await client.post("/v1/admin/models/cold/unload")).status_code == 200


async def test_gpu_memory_without_a_gpu(client: httpx.AsyncClient) -> None:
    body = (await client.get("/v1/admin/gpu-memory")).json()
    assert body["gpus"] == [] and body["error"]
    assert {m["name"] for m in body["models"]} == {"echo", "slow", "cold", "single"}


async def test_openapi_and_docs(client: httpx.AsyncClient) -> None:
    doc = (await client.get("/openapi.json")).json()
    assert doc["openapi"].startswith("3.1")
    for path in ("/v1/responses", "/v1/admin/models/{name}/load", "/v1/models/load", "/metrics"):
        for operation in doc["paths"][path].values():
            assert operation["description"]
    assert "unloading" in doc["info"]["description"]
    assert "ResponseRequest" in doc["components"]["schemas"]
    page = await client.get("/docs")
    assert page.status_code == 200 and "/v1/admin/models" in page.text


async def test_runner_api(client: httpx.AsyncClient) -> None:
    caps = (await client.get("/v1/capabilities")).json()
    assert {m["id"] for m in caps["models"]["loaded"]} == {"echo", "slow"}
    assert caps["capabilities"]["streaming"] and caps["health"] == "healthy"
    started = await client.post("/v1/models/load", json={"modelId": "cold", "evictModel": "echo"})
    assert started.status_code == 202
    task_id = started.json()["taskId"]
    with trio.fail_after(5):
        while (status := (await client.get(f"/v1/models/load/{task_id}")).json())[
            "status"
        ] == "loading":
            await trio.sleep(0.01)
    assert status["status"] == "completed" and status["loadTimeMs"] >= 0
    assert (await client.get("/v1/admin/models/echo")).json()["runtime_state"] == "unloaded"
    assert (await client.get("/v1/models/load/nope")).status_code == 404
    bad = await client.post("/v1/models/load", json={"modelId": "cold", "quantization": "awq-4bit"})
    assert bad.status_code == 400
    ctx = await client.post("/v1/models/load", json={"modelId": "single", "maxContextLength": 1000})
    assert ctx.status_code == 400  # exllama_cache_size must be a multiple of 256
    unloaded = await client.post("/v1/models/unload", json={"modelId": "cold"})
    assert unloaded.json()["modelId"] == "cold" and unloaded.json()["kvCacheFlushed"]
    flush = await client.post("/v1/cache/flush", json={"scope": "all"})
    assert flush.json() == {"flushed": True, "entriesRemoved": 0, "memoryFreedMB": 0}
    assert (await client.post("/v1/cache/flush", json={"scope": "model"})).status_code == 400
    assert (await client.post("/v1/cache/flush", json={"scope": "planet"})).status_code == 422
    assert (await client.get("/health")).status_code == 200


async def test_metrics_parse_and_count(client: httpx.AsyncClient) -> None:
    for _ in range(3):
        await client.post(
            "/v1/responses", json={"model": "echo", "input": "a b"}, headers={"X-Tenant-ID": "t"}
        )
    await client.post("/v1/responses", json={"model": "cold", "input": "x"})
    text = (await client.get("/metrics")).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    counts = {
        (s.labels["model"], s.labels["tenant"], s.labels["status"]): s.value
        for s in families["llm_pool_requests"].samples
        if s.name.endswith("_total")
    }
    assert counts == {("echo", "t", "success"): 3, ("cold", "default", "model_not_loaded"): 1}


async def test_health_is_503_when_every_model_failed(nursery: trio.Nursery) -> None:
    info = await start_server(
        nursery, {"x": {"backend": "stub", "enabled": True, "stub_fail_load": True}}
    )
    async with httpx.AsyncClient(base_url=info.url) as client:
        reply = await client.get("/health")
        assert reply.status_code == 503 and reply.json()["reason"] == "every model failed to load"


async def test_bearer_tokens_and_op_tokens(nursery: trio.Nursery, tmp_path: Path) -> None:
    key = b"k" * 32
    (tmp_path / "op.key").write_bytes(key)
    info = await start_server(
        nursery,
        {"m": {"backend": "stub", "enabled": True}},
        auth={
            "inference_tokens": ["user"],
            "admin_token": "root",
            "op_token_key_path": str(tmp_path / "op.key"),
        },
    )
    user = {"Authorization": "Bearer user"}
    root = {"Authorization": "Bearer root"}
    async with httpx.AsyncClient(base_url=info.url) as client:
        body = {"model": "m", "input": "x"}
        assert (await client.post("/v1/responses", json=body)).status_code == 401
        assert (
            await client.post("/v1/responses", json=body, headers={"Authorization": "Bearer nope"})
        ).status_code == 401
        assert (await client.post("/v1/responses", json=body, headers=user)).status_code == 200
        assert (await client.get("/v1/admin/models", headers=user)).status_code == 401
        assert (await client.get("/v1/admin/models", headers=root)).status_code == 200
        assert (
            await client.post("/v1/models/unload", json={"modelId": "m"}, headers=user)
        ).status_code == 401
        claims = {"operation": "model-unload", "modelId": "m", "issuedAt": time.time(),
                  "signers": ["a"], "nonce": "nonce-12345"}  # fmt: skip
        token = sign_op_token(key, claims)
        ok = await client.post("/v1/models/unload", json={"modelId": "m", "verifiedOpToken": token})
        assert ok.status_code == 200
        replay = await client.post(
            "/v1/models/unload", json={"modelId": "m", "verifiedOpToken": token}
        )
        assert replay.status_code == 401 and "replay" in replay.json()["error"]["message"]
        forged = sign_op_token(b"x" * 32, claims | {"nonce": "nonce-99999"})
        denied = await client.post(
            "/v1/models/load", json={"modelId": "m", "verifiedOpToken": forged}
        )
        assert denied.status_code == 401
        assert (await client.get("/v1/admin/models/m", headers=root)).json()[
            "runtime_state"
        ] == "unloaded"
        assert (await client.get("/health")).status_code == 200  # probes need no token


async def test_rate_limit_over_http(nursery: trio.Nursery) -> None:
    info = await start_server(
        nursery,
        {"m": {"backend": "stub", "enabled": True}},
        tenancy={"tenants": {"metered": {"requests_per_minute": 2, "burst": 2}}},
    )
    body = {"model": "m", "input": "x"}
    async with httpx.AsyncClient(base_url=info.url) as client:
        metered = {"X-Tenant-ID": "metered"}
        first = await client.post("/v1/responses", json=body, headers=metered)
        assert first.status_code == 200 and first.headers["x-ratelimit-limit"] == "2"
        assert (await client.post("/v1/responses", json=body, headers=metered)).status_code == 200
        refused = await client.post("/v1/responses", json=body, headers=metered)
        assert refused.status_code == 429
        error = refused.json()["error"]
        assert error["code"] == "rate_limit_exceeded" and error["limit"] == 2
        assert error["remaining"] == 0 and error["resetAt"] >= int(time.time())
        assert 1 <= int(refused.headers["retry-after"]) <= 30
        other = await client.post("/v1/responses", json=body, headers={"X-Tenant-ID": "other"})
        assert other.status_code == 200
