"""The streaming check shared by the real-backend tests."""

from __future__ import annotations

import time

from pool import Delta, Finished, InferenceRequest, Pool


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
