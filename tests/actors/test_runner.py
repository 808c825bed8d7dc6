"""Runner-API operations of the pool: async load tasks, capabilities, health, cache flush."""

from __future__ import annotations

import pytest
import trio

import pool.actors.models._model as model_module
from pool import PoolError, open_pool
from pool.actors import FlushResult
from pool.backends import get_backend
from pool.config import build_settings

from .helpers import CachingBackend, CachingRuntime, ask, stub_settings, wait_until


async def test_load_task_runs_in_background_and_evicts_first(
    autojump_clock: trio.abc.Clock,
) -> None:
    settings = stub_settings({"a": {"enabled": True}, "b": {"stub_load_seconds": 4}})
    async with open_pool(settings) as pool:
        task = pool.start_load_task("b", evict="a")
        assert task.status == "loading"
        await task.done.wait()
        done = pool.load_task(task.task_id)
        assert done.status == "completed" and done.model == "b"
        assert done.load_time_ms == pytest.approx(4000, abs=5)
        assert pool.snapshot("a").state == "unloaded"
        assert pool.snapshot("b").state == "loaded"


async def test_failed_load_task_reports_the_error() -> None:
    async with open_pool(stub_settings({"m": {"stub_fail_load": True}})) as pool:
        task = pool.start_load_task("m")
        await task.done.wait()
        assert task.status == "failed" and task.error_code == "load_failed"
        assert task.error is not None and "stub_fail_load" in task.error


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
            (lambda: pool.load_task("load-0-x"), "not_found"),
        ]:
            with pytest.raises(PoolError) as info:
                call()
            assert info.value.code == code


async def test_health_and_capabilities(autojump_clock: trio.abc.Clock) -> None:
    async with open_pool(
        stub_settings({"ok": {"enabled": True}, "bad": {"stub_fail_load": True}})
    ) as pool:
        health = pool.health()
        assert health.serving and health.models_loaded == 1
        await pool.respond(ask("ok"))
        states = {s.name: s.state for s in pool.snapshots()}
        assert states == {"ok": "loaded", "bad": "unloaded"}
        queue = pool.queue_stats()
        assert queue.depth == 0 and queue.p95_wait_ms >= 0 and queue.max_depth == 64
        view = pool.gpu_view()
        assert view.gpus == () and view.error
        await pool.unload("ok")
        with pytest.raises(PoolError):
            await pool.load("bad")
        assert pool.health().serving  # "ok" is unloaded, not failed
    settings = build_settings(
        {"engine": {"models": {"x": {"backend": "stub", "enabled": True, "stub_fail_load": True}}}}
    )
    async with open_pool(settings) as pool:
        health = pool.health()
        assert not health.serving and health.reason == "every model failed to load"
        pool.begin_shutdown()
        assert pool.health().reason == "the pool is shutting down"


async def test_flush_sums_the_runtimes_in_scope(monkeypatch: pytest.MonkeyPatch) -> None:
    caching = CachingBackend()
    monkeypatch.setattr(
        model_module, "get_backend", lambda name: caching if name == "stub" else get_backend(name)
    )
    monkeypatch.setattr(CachingRuntime, "flushes", [])
    settings = stub_settings({"a": {"enabled": True, "replicas": 2}, "b": {"enabled": True}})
    async with open_pool(settings) as pool:
        assert await pool.flush_cache("all") == FlushResult(9, 4.5)  # three replicas
        assert await pool.flush_cache("model", model="b") == FlushResult(3, 1.5)
        assert await pool.flush_cache("tenant", tenant="t1") == FlushResult(9, 4.5)
        assert CachingRuntime.flushes[-1] == ("tenant", "t1", None)
        assert len(CachingRuntime.flushes) == 3 + 1 + 3
        await pool.unload("a")
        assert await pool.flush_cache("all") == FlushResult(3, 1.5)  # only b is loaded
        with pytest.raises(PoolError):
            await pool.flush_cache("model", model="nope")


async def test_flush_without_prompt_caches_reports_zero() -> None:
    # The stub keeps no cache (no flush_cache): nothing to flush, and no error.
    async with open_pool(stub_settings({"m": {"enabled": True}})) as pool:
        assert await pool.flush_cache("all") == FlushResult(0, 0.0)


async def test_loading_models_are_listed_while_loading(autojump_clock: trio.abc.Clock) -> None:
    async with open_pool(stub_settings({"m": {"stub_load_seconds": 3}})) as pool:
        task = pool.start_load_task("m")
        await wait_until(lambda: pool.snapshot("m").state == "loading")
        assert [s.name for s in pool.snapshots() if s.state == "loading"] == ["m"]
        await task.done.wait()


async def test_a_load_eta_counts_down_from_the_last_measured_load(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with open_pool(stub_settings({"m": {"stub_load_seconds": 30}})) as pool:
        actor = pool.model("m")
        task = pool.start_load_task("m")
        await wait_until(lambda: actor.state == "loading")
        assert pool.load_eta_s("m") is None  # never measured: no guess
        await task.done.wait()
        assert pool.load_eta_s("m") is None  # not loading
        await pool.unload("m")
        again = pool.start_load_task("m")
        await wait_until(lambda: actor.state == "loading")
        await trio.sleep(10)
        assert pool.load_eta_s("m") == pytest.approx(20, abs=0.1)
        await again.done.wait()


async def test_a_runner_load_reuses_a_copy_that_serves_it_and_reloads_one_that_does_not(
    autojump_clock: trio.abc.Clock,
) -> None:
    """The toy backend's ``toy_ctx`` is its context field: a loaded copy of 256 serves a
    runner load of 128 as it is; one of 512 reloads it, with a ``reload`` decision."""
    from pool.backends import register_backend, unregister_backend

    from ..backends import toy_backend

    register_backend("toy", toy_backend.__name__)
    try:
        settings = build_settings({"engine": {"models": {"t": {"backend": "toy"}}}})
        async with open_pool(settings) as pool:
            await pool.load("t", {"toy_ctx": 256})
            loads = pool.model("t").load_count
            task = pool.start_load_task("t", {"toy_ctx": 128})
            await task.done.wait()
            assert task.status == "completed", task.error
            assert pool.model("t").load_count == loads
            assert pool.snapshot("t").load_override == {"toy_ctx": 256}
            assert not [d for d in pool.decisions("t") if d.action == "reload"]

            task = pool.start_load_task("t", {"toy_ctx": 512})
            await task.done.wait()
            assert task.status == "completed", task.error
            assert pool.model("t").load_count == loads + 1
            assert pool.snapshot("t").load_override == {"toy_ctx": 512}
            (reload,) = [d for d in pool.decisions("t") if d.action == "reload"]
            assert reload.reason.endswith("toy_ctx 512 asked; the loaded copy has 256")
    finally:
        unregister_backend("toy")
