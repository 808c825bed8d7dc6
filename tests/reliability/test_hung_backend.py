"""A backend that stops producing is cut off by ``engine.generation_idle_timeout_s``:
the request ends with ``backend_timeout`` (504), the watchdog recycles the replica and
the fresh one serves the next request (docs/faults.md). A client that reads slowly is not
the backend's silence and is never cut off."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from pool import Delta, Failed, Finished, InferenceRequest, Pool, open_pool
from pool.config import build_settings
from pool.errors import PoolError

from .conftest import words

IDLE_S = 30.0


def _settings(**engine: Any) -> Any:
    return build_settings(
        {
            "engine": {
                "generation_idle_timeout_s": IDLE_S,
                **engine,
                "models": {
                    "m": {
                        "backend": "scripted",
                        "enabled": True,
                        "scripted_reply": words(20),
                        "scripted_hang_after": 3,
                    }
                },
            }
        }
    )


async def test_a_silent_backend_times_out_and_frees_its_slot(
    scripted: None, autojump_clock: trio.abc.Clock
) -> None:
    async with open_pool(_settings()) as pool:
        events: list[Any] = []
        second: list[Any] = []

        async def second_request() -> None:
            # Queued behind the hung one (one slot): it runs once the slot is freed.
            second.extend([e async for e in pool.stream(InferenceRequest.prompt("m", "fine"))])

        started = trio.current_time()
        with trio.fail_after(IDLE_S * 3):
            async with trio.open_nursery() as nursery:
                async for event in pool.stream(InferenceRequest.prompt("m", "please hang")):
                    events.append(event)
                    if len(events) == 1:
                        nursery.start_soon(second_request)
        failed_at = trio.current_time() - started
        assert [type(e) for e in events] == [Delta, Delta, Delta, Failed]
        error = events[-1].error
        assert error.code == "backend_timeout" and error.status == 504
        assert "no token for 30 s" in error.message
        assert "generation_idle_timeout_s" in error.message
        assert IDLE_S <= failed_at < IDLE_S + 1
        assert isinstance(second[-1], Finished) and second[-1].text == words(20)
        row = pool.snapshot("m")
        assert row.state == "loaded" and row.running == 0


async def test_a_slow_reader_is_not_a_silent_backend(
    scripted: None, autojump_clock: trio.abc.Clock
) -> None:
    # No buffer between generation and client: every word waits for the reader, who
    # takes four times the idle timeout between reads (and less than the replica's 5 s
    # bound on handing over the final result).
    settings = _settings(stream_buffer_tokens=0, generation_idle_timeout_s=1.0)
    async with open_pool(settings) as pool:
        texts = []
        async for event in pool.stream(InferenceRequest.prompt("m", "fine")):
            if isinstance(event, Delta):
                texts.append(event.text)
                await trio.sleep(4.0)
        assert isinstance(event, Finished) and "".join(texts) == words(20)


def _stub_settings(model: dict[str, Any], **engine: Any) -> Any:
    return build_settings(
        {
            "engine": {
                "generation_idle_timeout_s": IDLE_S,
                **engine,
                "models": {
                    "m": {"backend": "stub", "enabled": True, "stub_hang_after": 1, **model},
                    "other": {"backend": "stub", "enabled": True},
                },
            }
        }
    )


def _recycles(pool: Pool) -> list[Any]:
    return [d for d in pool.decisions() if d.action == "reload" and d.model == "m"]


async def test_a_hung_replica_is_recycled_and_serves_again(
    autojump_clock: trio.abc.Clock,
) -> None:
    """``stub_hang_after``: the runtime hangs mid-stream without dying. The stream ends at
    its idle deadline with ``backend_timeout``; the watchdog recycles the replica (one
    decision, one count); a request queued behind the hung one is served by the fresh
    runtime; the other model is untouched."""
    async with open_pool(_stub_settings({})) as pool:
        first = await pool.respond(InferenceRequest.prompt("m", "one two"))
        assert first.text == "one two"
        hung = pool.model("m").replicas[0]
        queued: list[Any] = []
        events: list[Any] = []
        started = trio.current_time()
        async with trio.open_nursery() as nursery:

            async def behind() -> None:
                queued.extend([e async for e in pool.stream(InferenceRequest.prompt("m", "ok"))])

            async for event in pool.stream(InferenceRequest.prompt("m", "three four five")):
                events.append(event)
                if len(events) == 1:
                    nursery.start_soon(behind)
            failed_at = trio.current_time() - started
        assert [type(e) for e in events] == [Delta, Failed]
        assert events[0].text == "three"
        assert events[-1].error.code == "backend_timeout"
        assert IDLE_S <= failed_at < IDLE_S + 1
        assert isinstance(queued[-1], Finished) and queued[-1].text == "ok"
        (recycle,) = _recycles(pool)
        assert recycle.details == {"fault": "hang", "replica": 0}
        assert "engine.generation_idle_timeout_s" in recycle.reason
        assert "1 of 3 recycles this hour" in recycle.reason
        row = pool.snapshot("m")
        assert row.state == "loaded" and row.loaded_replicas == 1
        assert pool.model("m").replicas[0] is not hung and hung.runtime is None
        assert pool.model("other").load_count == 1
        metrics = pool.render_metrics().decode()
        assert 'llm_pool_watchdog_recycles_total{fault="hang",model="m"} 1.0' in metrics


async def test_the_other_replicas_serve_while_one_is_recycled(
    autojump_clock: trio.abc.Clock,
) -> None:
    # Without prefix affinity a request goes to the first free replica: replica 0 takes
    # both requests below, and hangs on the second.
    settings = _stub_settings({"replicas": 2, "stub_load_seconds": 5}, prefix_affinity=False)
    async with open_pool(settings) as pool:
        zero, one = pool.model("m").replicas
        await pool.respond(InferenceRequest.prompt("m", "a"))
        with pytest.raises(PoolError) as hung:
            await pool.respond(InferenceRequest.prompt("m", "b"))
        assert hung.value.code == "backend_timeout"
        await wait_for_replicas(pool, [one])
        # The fresh replica 0 loads (5 s); replica 1 serves meanwhile.
        served = await pool.respond(InferenceRequest.prompt("m", "meanwhile"))
        assert served.text == "meanwhile"
        assert pool.snapshot("m").state == "loaded"
        with trio.fail_after(6):
            while len(pool.model("m").replicas) < 2:
                await trio.sleep(0.1)
        fresh, kept = pool.model("m").replicas
        assert kept is one and fresh is not zero and fresh.index == 0
        assert len(_recycles(pool)) == 1


async def wait_for_replicas(pool: Pool, expected: list[Any]) -> None:
    """The model actor handles the hang's report after the request has failed."""
    with trio.fail_after(1):
        while pool.model("m").replicas != expected:
            await trio.sleep(0.01)


async def test_past_the_hourly_recycles_the_model_is_marked_failed(
    autojump_clock: trio.abc.Clock,
) -> None:
    settings = _stub_settings({}, watchdog_recycles_per_hour=1)
    async with open_pool(settings) as pool:
        for decided in (1, 2):
            await pool.respond(InferenceRequest.prompt("m", "a"))  # the runtime's one answer
            with pytest.raises(PoolError) as hung:
                await pool.respond(InferenceRequest.prompt("m", "b"))
            assert hung.value.code == "backend_timeout"
            # The model actor handles the hang's report after the request has failed.
            with trio.fail_after(1):
                while len([d for d in pool.decisions() if d.action != "place"]) < decided:
                    await trio.sleep(0.01)
            with trio.fail_after(1):
                while pool.snapshot("m").state == "loaded" and not pool.model("m").replicas:
                    await trio.sleep(0.01)
        row = pool.snapshot("m")
        assert row.state == "failed" and row.last_error is not None
        assert row.last_error.startswith("no token for 30 s")
        (fail,) = [d for d in pool.decisions() if d.action == "fail"]
        assert "engine.watchdog_recycles_per_hour" in fail.reason
        assert len(_recycles(pool)) == 1
        assert pool.snapshot("other").state == "loaded"
