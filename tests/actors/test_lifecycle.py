"""Runtime states and transitions of a model (DESIGN section 4)."""

from __future__ import annotations

from typing import Any

import pytest
import trio

import pool.actors.models._model as model_module
from pool import Delta, Failed, PoolError, open_pool
from pool.backends import LoadContext, LoadRequest, get_backend
from pool.backends.stub import StubBackend, StubRuntime
from pool.errors import BackendError

from .helpers import Outcome, ask, run_request, stub_settings, wait_until


async def test_load_and_unload_transitions(autojump_clock: trio.abc.Clock) -> None:
    settings = stub_settings({"m": {"stub_load_seconds": 2, "stub_unload_seconds": 1}})
    async with open_pool(settings) as pool, trio.open_nursery() as nursery:
        actor = pool.model("m")
        assert actor.snapshot().state == "unloaded"
        seen: list[str] = []

        async def watch() -> None:
            while True:
                await actor.wait_state_change()
                seen.append(actor.state)

        nursery.start_soon(watch)
        await trio.testing.wait_all_tasks_blocked()
        row = await pool.load("m")
        assert row.state == "loaded" and (row.state == "loaded") and row.loaded_replicas == 1
        row = await pool.unload("m")
        assert row.state == "unloaded" and row.loaded_replicas == 0
        await trio.testing.wait_all_tasks_blocked()
        assert seen == ["loading", "loaded", "unloading", "unloaded"]
        nursery.cancel_scope.cancel()


async def test_startup_loads_enabled_models_and_survives_a_failure() -> None:
    settings = stub_settings(
        {"good": {"enabled": True}, "bad": {"enabled": True, "stub_fail_load": True}, "off": {}}
    )
    async with open_pool(settings) as pool:
        states = {r.name: r.state for r in pool.snapshots()}
        assert states == {"good": "loaded", "bad": "failed", "off": "unloaded"}
        assert "stub_fail_load" in pool.snapshot("bad").last_error
        assert (await pool.respond(ask("good", "still serving"))).text == "still serving"
        with pytest.raises(PoolError) as info:
            await pool.respond(ask("bad"))
        assert info.value.code == "model_failed" and info.value.status == 409


async def test_failed_model_can_be_loaded_again() -> None:
    async with open_pool(stub_settings({"m": {"stub_fail_load": True}})) as pool:
        with pytest.raises(PoolError) as info:
            await pool.load("m")
        assert info.value.code == "load_failed" and info.value.status == 500
        assert info.value.details["last_error"]
        assert pool.snapshot("m").state == "failed"
        # The operator fixes the cause (here: the definition) and loads again.
        actor = pool.model("m")
        actor.definition = actor.definition.model_copy(update={"stub_fail_load": False})
        row = await pool.load("m")
        assert row.state == "loaded" and row.last_error is None


async def test_load_is_idempotent_while_loading_and_loaded(autojump_clock: trio.abc.Clock) -> None:
    async with open_pool(stub_settings({"m": {"stub_load_seconds": 5}})) as pool:
        rows: list[dict[str, Any]] = []

        async def load() -> None:
            rows.append(await pool.load("m"))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(load)
            await wait_until(lambda: pool.snapshot("m").state == "loading")
            nursery.start_soon(load)
        assert [r.state for r in rows] == ["loaded", "loaded"]
        assert pool.model("m").load_count == 1
        assert (await pool.load("m")).state == "loaded"
        assert pool.model("m").load_count == 1


async def test_overrides_or_replicas_while_loaded_are_rejected() -> None:
    async with open_pool(stub_settings({"m": {"replica_max": 3}})) as pool:
        await pool.load("m")
        with pytest.raises(PoolError) as info:
            await pool.load("m", {"replicas": 2})
        assert info.value.code == "invalid_load_request"
        row = pool.snapshot("m")
        assert row.state == "loaded" and row.loaded_replicas == 1


async def test_load_while_unloading_is_a_conflict(autojump_clock: trio.abc.Clock) -> None:
    async with open_pool(stub_settings({"m": {"stub_unload_seconds": 5}})) as pool:
        await pool.load("m")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pool.unload, "m")
            await wait_until(lambda: pool.snapshot("m").state == "unloading")
            with pytest.raises(PoolError) as info:
                await pool.load("m")
            assert info.value.code == "model_unloading" and info.value.status == 409
            # A second unload is fine and returns once the model is unloaded.
            assert (await pool.unload("m")).state == "unloaded"


async def test_unload_of_unloaded_or_failed_model_is_ok() -> None:
    async with open_pool(stub_settings({"m": {}, "f": {"stub_fail_load": True}})) as pool:
        assert (await pool.unload("m")).state == "unloaded"
        with pytest.raises(PoolError):
            await pool.load("f")
        assert (await pool.unload("f")).state == "failed"


async def test_unknown_model() -> None:
    async with open_pool(stub_settings({"m": {}})) as pool:
        for call in (pool.load("nope"), pool.unload("nope")):
            with pytest.raises(PoolError) as info:
                await call
            assert info.value.code == "unknown_model" and info.value.status == 404
        with pytest.raises(PoolError) as info:
            await pool.respond(ask("nope"))
        assert info.value.code == "unknown_model"


@pytest.mark.parametrize(
    ("state_setup", "code"),
    [("unloaded", "model_not_loaded"), ("loading", "model_loading")],
)
async def test_requests_rejected_by_state(
    autojump_clock: trio.abc.Clock, state_setup: str, code: str
) -> None:
    settings = stub_settings({"m": {"stub_load_seconds": 5}})
    async with open_pool(settings) as pool, trio.open_nursery() as nursery:
        if state_setup == "loading":
            nursery.start_soon(pool.load, "m")
            await wait_until(lambda: pool.snapshot("m").state == "loading")
        with pytest.raises(PoolError) as info:
            await pool.respond(ask("m"))
        assert info.value.code == code
        if code == "model_loading":
            assert info.value.status == 503 and info.value.retry_after_s


async def test_unload_cancels_queued_and_drains_running(autojump_clock: trio.abc.Clock) -> None:
    settings = stub_settings({"m": {"stub_reply": "a b c d e f g h", "stub_tokens_per_second": 2}})
    async with open_pool(settings) as pool:
        await pool.load("m")
        running, queued = Outcome(), Outcome()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_request, pool, ask("m"), running)
            await wait_until(lambda: pool.snapshot("m").running == 1)
            nursery.start_soon(run_request, pool, ask("m"), queued)
            await wait_until(lambda: pool.snapshot("m").queue_depth == 1)
            unload_started = trio.current_time()
            nursery.start_soon(pool.unload, "m")
            await wait_until(lambda: queued.done.is_set())
            assert queued.error is not None and queued.error.code == "model_unloading"
            # New requests are refused at once while the running one drains.
            with pytest.raises(PoolError) as info:
                await pool.respond(ask("m"))
            assert info.value.code == "model_unloading"
            assert pool.snapshot("m").state == "unloading"
        assert running.text == "a b c d e f g h"
        assert running.finished_at is not None and running.finished_at > unload_started
        row = pool.snapshot("m")
        assert row.state == "unloaded"
        assert row.running == row.queue_depth == 0


async def test_unload_cuts_requests_still_running_at_the_drain_deadline(
    autojump_clock: trio.abc.Clock,
) -> None:
    long_reply = " ".join(f"w{i}" for i in range(400))  # 200 s at 2 tokens/s
    settings = stub_settings(
        {"m": {"stub_reply": long_reply, "stub_tokens_per_second": 2, "target_inflight": 2}},
        unload_drain_s=30,
    )
    async with open_pool(settings) as pool:
        await pool.load("m")
        endless: list[Any] = []
        fast = Outcome()

        async def read_endless() -> None:
            async for event in pool.stream(ask("m")):
                endless.append(event)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_endless)
            # 4 tokens: 2 s, well inside the deadline.
            nursery.start_soon(run_request, pool, ask("m", decoding={"max_tokens": 4}), fast)
            await wait_until(lambda: pool.snapshot("m").running == 2)
            unload_started = trio.current_time()
            row = await pool.unload("m")
            unload_took = trio.current_time() - unload_started
        assert row.state == "unloaded" and row.running == 0
        assert unload_took == pytest.approx(30, abs=0.6)
        assert fast.error is None and fast.text == "w0 w1 w2 w3"
        deltas = [e for e in endless if isinstance(e, Delta)]
        assert 55 <= len(deltas) <= 62  # about 30 s of tokens, then cut
        assert isinstance(endless[-1], Failed)
        assert endless[-1].error.code == "model_unloading"
        assert "unload_drain_s" in endless[-1].error.message
        assert pool.model("m").replicas == []


class _FlakyBackend(StubBackend):
    """The stub, but replica ``fail_index`` fails to load; records opens and closes."""

    def __init__(self, fail_index: int) -> None:
        self.fail_index = fail_index
        self.opened: list[int] = []
        self.closed: list[int] = []

    async def load(self, definition: Any, context: Any) -> StubRuntime:
        await trio.sleep(1)
        if context.replica_index == self.fail_index:
            raise RuntimeError(f"replica {context.replica_index} has no device")
        runtime = await super().load(definition, context)
        self.opened.append(context.replica_index)
        close = runtime.close

        async def recorded_close() -> None:
            self.closed.append(context.replica_index)
            await close()

        runtime.close = recorded_close  # type: ignore[method-assign]
        return runtime


async def test_multi_replica_load_is_all_or_nothing(
    autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    flaky = _FlakyBackend(fail_index=2)
    monkeypatch.setattr(model_module, "get_backend", lambda name: flaky)
    async with open_pool(stub_settings({"m": {"replicas": 3}})) as pool:
        with pytest.raises(PoolError) as info:
            await pool.load("m")
        assert "replica 2 has no device" in info.value.message
        row = pool.snapshot("m")
        assert row.state == "failed" and row.loaded_replicas == 0
        assert "replica 2 has no device" in row.last_error
        assert flaky.opened == [0, 1] and sorted(flaky.closed) == [0, 1]


async def test_replicas_per_load_within_replica_max() -> None:
    async with open_pool(stub_settings({"m": {"replicas": 1, "replica_max": 3}})) as pool:
        with pytest.raises(PoolError) as info:
            await pool.load("m", {"replicas": 4})
        assert info.value.code == "invalid_load_request"
        assert pool.snapshot("m").state == "unloaded"
        row = await pool.load("m", LoadRequest(replicas=3))
        assert row.replicas == row.loaded_replicas == 3
        row = await pool.unload("m")
        assert row.replicas == 1  # back to the configured default


async def test_closing_the_pool_ends_open_requests_in_bounded_time(
    autojump_clock: trio.abc.Clock,
) -> None:
    settings = stub_settings(
        {"m": {"stub_reply": "x " * 100, "stub_tokens_per_second": 1, "stub_unload_seconds": 1}},
        max_queue=4,
    )
    outcomes = [Outcome(), Outcome()]
    async with trio.open_nursery() as outside:
        async with open_pool(settings) as pool:
            await pool.load("m")
            for outcome in outcomes:
                outside.start_soon(run_request, pool, ask("m"), outcome)
            await wait_until(lambda: pool.snapshot("m").inflight_requests == 2)
            closed_at = trio.current_time()
        with trio.fail_after(5):
            for outcome in outcomes:
                await outcome.done.wait()
        assert trio.current_time() - closed_at < 5
    assert all(o.error is not None and o.error.code == "shutting_down" for o in outcomes)


async def test_registry_returns_one_backend_per_name() -> None:
    assert get_backend("stub") is get_backend("stub")
    vllm = get_backend("vllm")
    assert vllm.name == "vllm"
    with pytest.raises(BackendError, match="vllm_model"):
        await vllm.load(vllm.config(), LoadContext("m", 0))


class _DyingRuntime(StubRuntime):
    """A stub runtime that can die on its own, like a crashed subprocess."""

    def __init__(self, definition: Any, died: trio.Event, closes: list[int]) -> None:
        super().__init__(definition)
        self._died = died
        self._closes = closes

    async def wait_failed(self) -> str:
        await self._died.wait()
        return "child exited with status -9; last output: out of memory"

    async def close(self) -> None:
        self._closes.append(1)
        raise RuntimeError("close blew up too")


class _DyingBackend(StubBackend):
    def __init__(self) -> None:
        self.died = trio.Event()
        self.closes: list[int] = []
        self._doomed = True

    async def load(self, definition: Any, context: Any) -> StubRuntime:
        # Only the first replica of the first load of "m" dies; every later runtime lives.
        doomed = self._doomed and context.model_name == "m" and context.replica_index == 0
        self._doomed = self._doomed and not doomed
        return _DyingRuntime(definition, self.died if doomed else trio.Event(), self.closes)


async def test_a_runtime_that_dies_is_recycled_while_the_other_replica_serves(
    autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dead replica's request ends with ``backend_error``; the other replica's and
    the queued one are served; the watchdog starts a fresh replica 0 (docs/faults.md)."""
    dying = _DyingBackend()
    monkeypatch.setattr(model_module, "get_backend", lambda name: dying)
    settings = stub_settings(
        {"m": {"replicas": 2, "stub_reply": "a " * 50, "stub_tokens_per_second": 1}, "other": {}}
    )
    async with open_pool(settings) as pool:
        await pool.load("m")
        doomed, survivor = pool.model("m").replicas
        outcomes = [Outcome(), Outcome(), Outcome()]
        async with trio.open_nursery() as nursery:
            for outcome in outcomes:
                nursery.start_soon(run_request, pool, ask("m"), outcome)
            await wait_until(lambda: pool.snapshot("m").queue_depth == 1)
            dying.died.set()
        codes = [o.error.code for o in outcomes if o.error is not None]
        assert codes == ["backend_error"]
        assert sum(o.text == "a " * 50 for o in outcomes) == 2
        row = pool.snapshot("m")
        assert row.state == "loaded" and row.loaded_replicas == 2
        fresh, kept = pool.model("m").replicas
        assert kept is survivor and fresh is not doomed and len(dying.closes) == 1
        (recycle,) = [d for d in pool.decisions() if d.action == "reload"]
        assert recycle.details == {"fault": "exit", "replica": 0}
        assert pool.model("m").load_count == 1  # one replica recycled, not a reload


async def test_a_runtime_that_dies_past_the_recycle_budget_fails_the_model(
    autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    dying = _DyingBackend()
    monkeypatch.setattr(model_module, "get_backend", lambda name: dying)
    settings = stub_settings(
        {"m": {"replicas": 2, "stub_reply": "a " * 50, "stub_tokens_per_second": 1}, "other": {}},
        watchdog_recycles_per_hour=0,
    )
    async with open_pool(settings) as pool:
        await pool.load("m")
        outcomes = [Outcome(), Outcome(), Outcome()]
        async with trio.open_nursery() as nursery:
            for outcome in outcomes:
                nursery.start_soon(run_request, pool, ask("m"), outcome)
            await wait_until(lambda: pool.snapshot("m").queue_depth == 1)
            dying.died.set()
        row = pool.snapshot("m")
        assert row.state == "failed" and "out of memory" in row.last_error
        assert row.loaded_replicas == row.running == row.queue_depth == 0
        codes = sorted(o.error.code for o in outcomes if o.error is not None)
        assert codes == ["backend_error", "backend_error", "model_failed"]
        assert len(dying.closes) == 2  # both replicas released, despite close() raising
        with pytest.raises(PoolError) as info:
            await pool.respond(ask("m"))
        assert info.value.code == "model_failed"
        # The rest of the pool is untouched and the model can be loaded again.
        await pool.load("other")
        assert (await pool.respond(ask("other", "fine"))).text == "fine"
        assert (await pool.load("m")).state == "loaded"
