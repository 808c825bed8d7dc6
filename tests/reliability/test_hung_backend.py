"""A backend that stops producing is cut off by ``engine.generation_idle_timeout_s``:
the request ends with ``backend_timeout`` (504) and its slot serves the next request.
A client that reads slowly is not the backend's silence and is never cut off."""

from __future__ import annotations

from typing import Any

import trio

from pool import Delta, Failed, Finished, InferenceRequest, open_pool
from pool.config import build_settings

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
