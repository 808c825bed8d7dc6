"""Streaming text out of a generation that runs on a worker thread.

The worker never waits for the event loop: each piece goes into a deque and a
``run_sync_soon`` wakes the Trio side, which forwards it to the sink while the worker
computes the next token. The deque is bounded by a semaphore (a slow client makes the
worker wait, never grows memory), and a stop flag set by the Trio side on
cancellation ends the worker at its next piece, so a cancelled request stops within
one token.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import TypeVar

import trio

from pool.backends._protocol import TokenSink

R = TypeVar("R")
Emit = Callable[[str], None]

# How often a worker blocked on a full buffer looks at the stop flag.
_STOP_POLL_S = 0.05


class GenerationStopped(Exception):
    """Raised inside the worker when the request was cancelled or the pool is closing."""


async def stream_from_thread(
    work: Callable[[Emit], R],
    sink: TokenSink,
    *,
    limiter: trio.CapacityLimiter,
    buffer: int = 64,
) -> R:
    """Run ``work(emit)`` on a worker thread; every ``emit(text)`` reaches ``sink`` in order.

    Raises whatever ``work`` raises; cancellation stops the worker at its next ``emit``.
    """
    pieces: deque[str] = deque()
    space = threading.Semaphore(buffer)
    stop = threading.Event()
    trio_token = trio.lowlevel.current_trio_token()
    state: dict[str, trio.Event] = {"arrived": trio.Event()}
    finished = False
    outcome: list[R] = []
    failure: list[Exception] = []

    def notify() -> None:
        state["arrived"].set()

    def emit(text: str) -> None:
        while not space.acquire(timeout=_STOP_POLL_S):
            if stop.is_set():
                raise GenerationStopped
        if stop.is_set():
            raise GenerationStopped
        pieces.append(text)
        try:
            trio_token.run_sync_soon(notify)
        except trio.RunFinishedError:
            raise GenerationStopped from None

    async def run_worker() -> None:
        nonlocal finished
        try:
            outcome.append(await trio.to_thread.run_sync(work, emit, limiter=limiter))
        except GenerationStopped:
            pass
        except Exception as exc:  # noqa: BLE001 - re-raised below, outside the nursery
            failure.append(exc)
        finally:
            finished = True
            notify()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_worker)
        try:
            while True:
                while pieces:
                    await sink.send(pieces.popleft())
                    space.release()
                if finished:
                    break
                await state["arrived"].wait()
                state["arrived"] = trio.Event()
        finally:
            # Cancelled (or the sink failed): the worker stops at its next piece. The
            # nursery then waits for the thread, which is bounded by one token.
            stop.set()
    if failure:
        # Raised as itself, not wrapped in the nursery's exception group, so callers
        # see the backend's PoolError or BackendError.
        raise failure[0]
    if not outcome:
        raise GenerationStopped("the generation was stopped")
    return outcome[0]
