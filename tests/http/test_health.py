"""``/health`` with its ``degraded`` state and reasons, and ``/api/status`` (the full
status: health, engine, pulls, GPU memory)."""

from __future__ import annotations

from typing import Any

import httpx
import trio

from pool.actors import GpuReading

from .conftest import FakeGpus, running, start_server

MODELS: dict[str, dict[str, Any]] = {
    "echo": {"backend": "stub", "enabled": True, "keep_alive": 300, "on_demand": True},
    "bad": {"backend": "stub", "enabled": True, "stub_fail_load": True},
    "busy": {
        "backend": "stub",
        "enabled": True,
        "stub_reply": " ".join(f"w{i}" for i in range(40)),
        "stub_tokens_per_second": 20,
        "max_queue": 1,
    },
}
GPUS = FakeGpus(GpuReading(0, "NVIDIA L4", used_mib=1000, total_mib=23034, pool_used_mib=800))


async def test_a_failed_model_degrades_the_pool(nursery: trio.Nursery) -> None:
    info = await start_server(nursery, MODELS)
    async with httpx.AsyncClient(base_url=info.url) as client:
        reply = await client.get("/health")
    assert reply.status_code == 200
    body = reply.json()
    assert body["status"] == "degraded" and "reason" not in body
    assert body["reasons"] == [
        {"code": "model_failed", "model": "bad", "error": "stub_fail_load is set for model"
         " 'bad' (replica 0)"}
    ]  # fmt: skip


async def test_a_healthy_pool_lists_no_reasons(nursery: trio.Nursery) -> None:
    info = await start_server(nursery, {"echo": MODELS["echo"]})
    async with httpx.AsyncClient(base_url=info.url) as client:
        body = (await client.get("/health")).json()
        capabilities = (await client.get("/v1/capabilities")).json()
    assert body["status"] == "healthy" and "reasons" not in body
    assert capabilities["health"] == "healthy"


async def test_a_saturated_queue_degrades_and_clears(nursery: trio.Nursery) -> None:
    info = await start_server(nursery, {"busy": MODELS["busy"]})
    body = {"model": "busy", "input": "x"}
    async with (
        httpx.AsyncClient(base_url=info.url, timeout=60) as client,
        trio.open_nursery() as requests,
    ):
        requests.start_soon(lambda: client.post("/v1/responses", json=body))
        with trio.fail_after(20):
            while not await running(client, "busy"):
                await trio.sleep(0.02)
        requests.start_soon(lambda: client.post("/v1/responses", json=body))
        with trio.fail_after(20):
            while (await client.get("/health")).json()["status"] != "degraded":
                await trio.sleep(0.02)
        saturated = await client.get("/health")
        capabilities = await client.get("/v1/capabilities")
        # Degraded still serves: the runner descriptor says so with a 200.
        assert capabilities.status_code == 200 and capabilities.json()["health"] == "degraded"
    # The spec's 503 for a saturated queue, still "degraded", with the reason.
    assert saturated.status_code == 503
    body = saturated.json()
    assert body["status"] == "degraded"
    assert body["reason"] == "the queue of model 'busy' is saturated (1/1)"
    assert body["reasons"] == [
        {"code": "queue_saturated", "model": "busy", "queueDepth": 1, "maxQueue": 1}
    ]
    async with httpx.AsyncClient(base_url=info.url) as client:
        cleared = await client.get("/health")
        assert cleared.status_code == 200 and cleared.json()["status"] == "healthy"
        assert "reason" not in cleared.json()


async def test_the_full_status(nursery: trio.Nursery) -> None:
    info = await start_server(nursery, MODELS, gpus=GPUS)
    async with httpx.AsyncClient(base_url=info.url, timeout=30) as client:
        await client.post("/v1/responses", json={"model": "echo", "input": "x"})
        reply = await client.get("/api/status")
    assert reply.status_code == 200
    status = reply.json()
    assert status["status"] == "degraded" and status["reason"] is None
    assert [r["code"] for r in status["reasons"]] == ["model_failed"]
    assert isinstance(status["uptime"], int)
    rows = {row["name"]: row for row in status["engine"]["models"]}
    assert set(rows) == {"echo", "bad", "busy"}
    echo = rows["echo"]
    assert echo["state"] == "loaded" and echo["backend"] == "stub"
    assert echo["keep_alive"] == 300 and echo["idle_seconds"] is not None
    # An on-demand model that went idle counts down to its unload.
    assert 0 < echo["will_unload_in"] <= 300
    assert echo["error"] is None and echo["queue_depth"] == echo["running"] == 0
    assert rows["bad"]["state"] == "failed" and "stub_fail_load" in rows["bad"]["error"]
    assert rows["busy"]["keep_alive"] == -1 and rows["busy"]["will_unload_in"] is None
    assert status["pulls"] == {}
    assert status["gpu_memory"] == {
        "gpus": [
            {
                "index": 0,
                "name": "NVIDIA L4",
                "used_mib": 1000,
                "total_mib": 23034,
                "free_mib": 22034,
                "pool_used_mib": 800,
                "virtual": False,
            }
        ],
        "error": None,
    }


async def test_the_full_status_needs_an_inference_token(nursery: trio.Nursery) -> None:
    info = await start_server(
        nursery, {"echo": MODELS["echo"]}, auth={"inference_tokens": ["secret"]}
    )
    async with httpx.AsyncClient(base_url=info.url) as client:
        assert (await client.get("/api/status")).status_code == 401
        authorized = await client.get("/api/status", headers={"Authorization": "Bearer secret"})
        assert authorized.status_code == 200 and authorized.json()["status"] == "healthy"
        # /health stays open for probes.
        assert (await client.get("/health")).status_code == 200


async def test_the_runner_form_is_served_for_the_ollama_seeds_states(
    nursery: trio.Nursery,
) -> None:
    # The seeds disagree on /health (docs/api.md, "Health"): the runner's later form is
    # served. The Ollama seed's "idle" (nothing loaded) is healthy with modelsLoaded 0,
    # and its "loading" (503 there) is no /health state: a loading model is a row state.
    slow = {"backend": "stub", "on_demand": True, "stub_load_seconds": 30}
    info = await start_server(nursery, {"slow": slow})
    async with httpx.AsyncClient(base_url=info.url, timeout=30) as client:
        idle = await client.get("/health")
        assert idle.status_code == 200
        assert {k: idle.json()[k] for k in ("status", "modelsLoaded", "queueDepth")} == {
            "status": "healthy", "modelsLoaded": 0, "queueDepth": 0
        }  # fmt: skip
        await client.post("/v1/models/load", json={"modelId": "slow"})
        with trio.fail_after(10):
            while info.pool.snapshot("slow").state != "loading":
                await trio.sleep(0.01)
        loading = await client.get("/health")
        assert loading.status_code == 200 and loading.json()["status"] == "healthy"
        assert set(loading.json()) == {"status", "uptime", "modelsLoaded", "queueDepth"}
