"""The streaming check shared by the real-backend tests."""

from __future__ import annotations

import contextlib
import time

from pool import Delta, Failed, Finished, InferenceRequest, Pool
from pool.actors import Usage


async def assert_streams(pool: Pool, request: InferenceRequest, *, min_deltas: int = 20) -> None:
    """``request`` streams: its first delta arrives early and the rest keep coming until
    the end (a buffered reply would put every delta at the end).

    The bounds leave room for a busy shared CPU (unloaded, llama_cpp's first delta comes
    at about 2% of the time).
    """
    started = time.perf_counter()
    deltas: list[float] = []
    completed = None
    async for event in pool.stream(request):
        if isinstance(event, Delta):
            deltas.append(time.perf_counter() - started)
        elif isinstance(event, Finished):
            completed = time.perf_counter() - started
    assert completed is not None, "the stream did not finish"
    assert len(deltas) > min_deltas
    assert deltas[0] < 0.5 * completed, (deltas[0], completed)
    assert deltas[-1] - deltas[0] > 0.4 * completed, (deltas[0], deltas[-1], completed)


async def assert_cut_is_charged(pool: Pool, request: InferenceRequest, *, reads: int = 3) -> Usage:
    """A stream its caller leaves after ``reads`` deltas is charged what it used: the
    prompt (prefilled by then) and at least the tokens read. Returns that charge."""
    read = 0
    async with (
        pool.admit(request) as admission,
        contextlib.aclosing(admission.events()) as events,
    ):
        async for event in events:
            read += isinstance(event, Delta)
            assert not isinstance(event, Finished | Failed), f"ended before the cut: {event}"
            if read == reads:
                break
    used = admission.used
    assert used.prompt_tokens, used
    assert used.output_tokens is not None and used.output_tokens >= reads, used
    return used
