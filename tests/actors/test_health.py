"""What degrades a serving pool (pool/actors/serving/_health.py): a saturated queue, a GPU out
of memory within the window, a failed model; and when it is unhealthy instead."""

from __future__ import annotations

from typing import Any

import pytest
import trio

import pool.actors.models._model as model_module
from pool import PoolError, open_pool
from pool.backends import GenerationRequest, GenerationStats, LoadContext, TokenSink
from pool.backends.stub import StubBackend, StubModel, StubRuntime
from pool.config import Settings, build_settings
from pool.errors import BackendError

from .helpers import Outcome, ask, run_request, wait_until

WINDOW_S = 120.0
CUDA_OOM = "CUDA error: out of memory (cudaMalloc of 4096 MiB on device 0)"


def settings(models: dict[str, dict[str, Any]], **engine: Any) -> Settings:
    return build_settings(
        {
            "service": {"health_oom_window_s": WINDOW_S},
            "engine": {
                **engine,
                "models": {n: {"backend": "stub", **m} for n, m in models.items()},
            },
        }
    )


class _OomRuntime(StubRuntime):
    async def generate(self, request: GenerationRequest, sink: TokenSink) -> GenerationStats:
        raise BackendError(f"llama_decode failed: {CUDA_OOM}")


class _OomBackend(StubBackend):
    """Model ``m`` runs out of GPU memory: on load, or on each request once loaded."""

    def __init__(self, at: str) -> None:
        self.at = at

    async def load(self, definition: StubModel, context: LoadContext) -> StubRuntime:
        if context.model_name != "m":
            return await super().load(definition, context)
        if self.at == "load":
            raise BackendError(CUDA_OOM)
        return _OomRuntime(definition)


async def test_a_healthy_pool_has_no_issues() -> None:
    async with open_pool(settings({"m": {"enabled": True}})) as pool:
        health = pool.health()
        assert health.status == "healthy" and health.issues == ()


async def test_an_oom_on_a_request_degrades_for_the_window(
    autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(model_module, "get_backend", lambda name: _OomBackend("generate"))
    # On virtual GPU 1 of two (GPU 0 is too small for it): the reason names that GPU.
    config = settings({"m": {"stub_vram_mib": 3000}}, gpu_budget_mib=[2000, 8000])
    async with open_pool(config) as pool:
        await pool.load("m")
        with pytest.raises(PoolError) as info:
            await pool.respond(ask("m"))
        assert info.value.code == "backend_error"
        health = pool.health()
        assert health.serving and health.status == "degraded"
        [issue] = health.issues
        assert (issue.code, issue.model, issue.details["gpu"]) == ("gpu_oom", "m", 1)
        assert "out of memory" in issue.details["message"]
        # The spec's 503 for a GPU out of memory (/health answers it), with the reason.
        assert not health.available
        assert health.reason == "model 'm' ran out of GPU memory on GPU 1"
        # The model still serves (the next request may fit); the OOM is reported until
        # the window has passed.
        assert pool.snapshot("m").state == "loaded"
        await trio.sleep(WINDOW_S - 1)
        assert pool.health().status == "degraded"
        await trio.sleep(2)
        assert pool.health().status == "healthy" and pool.health().available
        assert pool.health().reason is None


async def test_an_oom_on_load_degrades_with_the_failed_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(model_module, "get_backend", lambda name: _OomBackend("load"))
    config = settings(
        {"m": {"stub_vram_mib": 1000}, "ok": {"enabled": True}}, gpu_budget_mib=[8000]
    )
    async with open_pool(config) as pool:
        with pytest.raises(PoolError):
            await pool.load("m")
        health = pool.health()
        assert health.serving and health.status == "degraded" and not health.available
        codes = sorted((i.code, i.model) for i in health.issues)
        assert codes == [("gpu_oom", "m"), ("model_failed", "m")]
        failed = next(i for i in health.issues if i.code == "model_failed")
        assert "out of memory" in failed.details["error"]


async def test_a_failure_that_is_not_an_oom_is_only_a_failed_model() -> None:
    config = settings({"bad": {"enabled": True, "stub_fail_load": True}, "ok": {"enabled": True}})
    async with open_pool(config) as pool:
        health = pool.health()
        assert health.status == "degraded" and health.available  # one failed model: 200
        assert [(i.code, i.model) for i in health.issues] == [("model_failed", "bad")]


async def test_every_model_failed_is_unhealthy_with_the_issues() -> None:
    config = settings({"bad": {"enabled": True, "stub_fail_load": True}})
    async with open_pool(config) as pool:
        health = pool.health()
        assert not health.serving and health.status == "unhealthy"
        assert health.reason == "every model failed to load"
        assert [i.code for i in health.issues] == ["model_failed"]


async def test_a_queue_at_its_max_is_saturated(autojump_clock: trio.abc.Clock) -> None:
    slow = {"enabled": True, "stub_reply": "a b c d", "stub_tokens_per_second": 1}
    config = settings({"m": {**slow, "max_queue": 3, "target_inflight": 1}})
    async with open_pool(config) as pool, trio.open_nursery() as nursery:
        outcomes = [Outcome() for _ in range(4)]
        for outcome in outcomes[:3]:
            nursery.start_soon(run_request, pool, ask("m"), outcome)
        await wait_until(lambda: pool.snapshot("m").queue_depth == 2)
        # Two of three: not near the max yet.
        assert pool.health().status == "healthy"
        nursery.start_soon(run_request, pool, ask("m"), outcomes[3])
        await wait_until(lambda: pool.snapshot("m").queue_depth == 3)
        health = pool.health()
        assert health.status == "degraded"
        [issue] = health.issues
        assert issue.code == "queue_saturated" and issue.model == "m"
        assert issue.details == {"queueDepth": 3, "maxQueue": 3}
        for outcome in outcomes:
            await outcome.done.wait()
        assert all(o.error is None for o in outcomes)
        assert pool.health().status == "healthy"
