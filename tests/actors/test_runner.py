"""Runner-API operations of the pool: async load tasks, capabilities, health, cache flush."""

from __future__ import annotations

import pytest
import trio

from pool import PoolError, open_pool
from pool.config import build_settings

from .helpers import ask, stub_settings, wait_until


async def test_load_task_runs_in_background_and_evicts_first(
    autojump_clock: trio.abc.Clock,
) -> None:
    settings = stub_settings({"a": {"enabled": True}, "b": {"stub_load_seconds": 4}})
    async with open_pool(settings) as pool:
        task = pool.start_load_task("b", evict="a")
        assert task.as_dict()["status"] == "loading"
        await task.done.wait()
        body = pool.load_tasks.get(task.task_id).as_dict()
        assert body["status"] == "completed" and body["modelId"] == "b"
        assert body["loadTimeMs"] == pytest.approx(4000, abs=5)
        assert pool.status("a")["runtime_state"] == "unloaded"
        assert pool.status("b")["runtime_state"] == "loaded"


async def test_failed_load_task_reports_the_error() -> None:
    async with open_pool(stub_settings({"m": {"stub_fail_load": True}})) as pool:
        task = pool.start_load_task("m")
        await task.done.wait()
        body = task.as_dict()
        assert body["status"] == "failed" and body["errorCode"] == "load_failed"
        assert "stub_fail_load" in body["error"]


async def test_bad_load_task_requests_fail_at_once() -> None:
    async with open_pool(stub_settings({"m": {}, "x": {"backend": "exllamav3"}})) as pool:
        for call, code in [
            (lambda: pool.start_load_task("nope"), "unknown_model"),
            (lambda: pool.start_load_task("m", evict="nope"), "unknown_model"),
            (lambda: pool.start_load_task("m", evict="m"), "invalid_request"),
            (
                lambda: pool.start_load_task("x", {"exllama_cache_size": 8000}),
                "invalid_load_request",
            ),
            (lambda: pool.load_tasks.get("load-0-x"), "not_found"),
        ]:
            with pytest.raises(PoolError) as info:
                call()
            assert info.value.code == code


async def test_health_and_capabilities(autojump_clock: trio.abc.Clock) -> None:
    async with open_pool(
        stub_settings({"ok": {"enabled": True}, "bad": {"stub_fail_load": True}})
    ) as pool:
        healthy, body = pool.health()
        assert healthy and body["modelsLoaded"] == 1
        await pool.respond(ask("ok"))
        caps = pool.capabilities()
        assert [m["id"] for m in caps["models"]["loaded"]] == ["ok"]
        assert caps["models"]["available"] == ["bad"]
        assert caps["queue"]["depth"] == 0 and caps["queue"]["p95WaitMs"] >= 0
        assert caps["resources"]["gpuIds"] == [] and caps["resources"]["error"]
        assert caps["health"] == "healthy"
        await pool.unload("ok")
        with pytest.raises(PoolError):
            await pool.load("bad")
        assert pool.health()[0]  # "ok" is unloaded, not failed
    settings = build_settings(
        {"engine": {"models": {"x": {"backend": "stub", "enabled": True, "stub_fail_load": True}}}}
    )
    async with open_pool(settings) as pool:
        healthy, body = pool.health()
        assert not healthy and body["reason"] == "every model failed to load"
        pool.shutting_down = True
        assert pool.health()[1]["reason"] == "the pool is shutting down"


async def test_flush_without_prompt_caches_reports_zero() -> None:
    async with open_pool(stub_settings({"m": {"enabled": True}})) as pool:
        assert await pool.flush_cache("all") == {
            "flushed": True,
            "entriesRemoved": 0,
            "memoryFreedMB": 0,
        }
        assert (await pool.flush_cache("model", model="m"))["entriesRemoved"] == 0
        with pytest.raises(PoolError):
            await pool.flush_cache("model", model="nope")


async def test_loading_models_are_listed_while_loading(autojump_clock: trio.abc.Clock) -> None:
    async with open_pool(stub_settings({"m": {"stub_load_seconds": 3}})) as pool:
        task = pool.start_load_task("m")
        await wait_until(lambda: pool.status("m")["runtime_state"] == "loading")
        assert pool.capabilities()["models"]["loading"] == [
            {"id": "m", "progress": None, "eta": None}
        ]
        await task.done.wait()
