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
from typing import Protocol, TypeVar

import trio

from pool.backends._protocol import TokenSink
from pool.backends._tools import ToolCallDelta

R = TypeVar("R")
P = TypeVar("P")
P_contra = TypeVar("P_contra", contravariant=True)
Piece = str | ToolCallDelta
Emit = Callable[[Piece], None]


class PieceSink(Protocol[P_contra]):
    """What :func:`stream_from_thread` hands pieces to: a generation's ``TokenSink``, a
    task's sink, a speech job's PCM sink."""

    async def send(self, piece: P_contra, /) -> None: ...


# How often a worker blocked on a full buffer looks at the stop flag.
_STOP_POLL_S = 0.05


class GenerationStopped(Exception):
    """Raised inside the worker when the request was cancelled or the pool is closing."""


async def stream_from_thread(
    work: Callable[[Callable[[P], None]], R],
    sink: PieceSink[P],
    *,
    limiter: trio.CapacityLimiter,
    buffer: int = 64,
) -> R:
    """Run ``work(emit)`` on a worker thread; every ``emit(piece)`` reaches ``sink`` in
    order (text and tool-call pieces of a generation, bytes of a task).

    Raises whatever ``work`` raises; cancellation stops the worker at its next ``emit``.
    """
    pieces: deque[P] = deque()
    space = threading.Semaphore(buffer)
    stop = threading.Event()
    trio_token = trio.lowlevel.current_trio_token()
    state: dict[str, trio.Event] = {"arrived": trio.Event()}
    finished = False
    outcome: list[R] = []
    failure: list[Exception] = []

    def notify() -> None:
        state["arrived"].set()

    def emit(text: P) -> None:
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


class PieceStream:
    """One request's text from a driver thread that serves many requests at once.

    :func:`stream_from_thread` gives one generation a worker thread and lets it wait
    when its client is slow. A batching engine (ExLlamaV3's generator) has one thread
    for every request of a replica, and that thread must never wait for one consumer:
    it would stall the whole batch (exllamav3's own async wrapper makes the same choice).
    So here the producer only appends; a request's backlog is bounded by its
    ``max_tokens``. The hand-over is the same as above: pieces go into a deque and
    :func:`wake_streams` asks Trio, once per engine step for all the streams it touched,
    to set their events, so the thread never waits for the event loop and no wake-up is
    lost.

    The producer calls :meth:`put` and :meth:`finish` (from any one thread); the Trio
    task that created the stream awaits :meth:`deliver`.
    """

    def __init__(self) -> None:
        self._pieces: deque[str | ToolCallDelta] = deque()
        self._arrived = trio.Event()
        self._finished = False
        self._failure: BaseException | None = None

    @property
    def finished(self) -> bool:
        return self._finished

    def put(self, text: str | ToolCallDelta) -> None:
        """Producer side: queue ``text`` (or a tool-call piece); it reaches Trio at the
        next :func:`wake_streams`."""
        self._pieces.append(text)

    def finish(self, failure: BaseException | None = None) -> None:
        """Producer side: no more pieces; ``deliver`` raises ``failure`` after the last one."""
        self._failure = failure
        # Set after every piece is queued: ``deliver`` reads this flag before it drains.
        self._finished = True

    def _wake(self) -> None:
        self._arrived.set()

    async def deliver(self, sink: TokenSink) -> None:
        """Trio side: send every piece to ``sink`` until the producer finishes.

        Text that piled up while the sink was busy goes out as one piece, so a slow
        client costs one ``send`` per wake-up rather than one per token (tool-call
        pieces go out one by one, in order).

        Raises:
            BaseException: what the producer passed to :meth:`finish`.
        """
        while True:
            # Read before draining: once it is set, every piece is already queued.
            finished = self._finished
            if self._pieces:
                await sink.send(_take_text(self._pieces))
                continue
            if finished:
                break
            await self._arrived.wait()
            self._arrived = trio.Event()
        if self._failure is not None:
            raise self._failure


def _take_text(pieces: deque[str | ToolCallDelta]) -> str | ToolCallDelta:
    """The first piece, joined with the text that follows it when it is text."""
    first = pieces.popleft()
    if isinstance(first, ToolCallDelta):
        return first
    taken = [first]
    while pieces:
        following = pieces[0]
        if not isinstance(following, str):
            break
        pieces.popleft()
        taken.append(following)
    return "".join(taken) if len(taken) > 1 else first


def wake_streams(trio_token: trio.lowlevel.TrioToken, streams: list[PieceStream]) -> bool:
    """Producer side: hand what ``streams`` received to Trio, with one call into the loop.

    Returns:
        False when the Trio run has ended (nobody is listening any more).
    """
    if not streams:
        return True

    def wake() -> None:
        for stream in streams:
            stream._wake()

    try:
        trio_token.run_sync_soon(wake)
    except trio.RunFinishedError:
        return False
    return True
