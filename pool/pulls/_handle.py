"""One pull's state and the watchers that follow it.

Any number of watchers follow one pull, each through its own bounded channel: a
watcher that reads slowly misses intermediate progress events, never the final one,
and never slows the download down.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Literal

import trio

PullStatus = Literal[
    "queued",
    "pulling manifest",
    "downloading",
    "verifying sha256 digest",
    "success",
    "error",
    "cancelled",
]
FINAL_STATUSES = frozenset({"success", "error", "cancelled"})

# The embedded-engine spec's job states, by the pull's finer status.
_SPEC_STATES: dict[str, str] = {
    "queued": "queued",
    "pulling manifest": "downloading",
    "downloading": "downloading",
    "verifying sha256 digest": "downloading",
    "success": "completed",
    "error": "failed",
    "cancelled": "cancelled",
}


class PullEvents:
    """One watcher's progress events, as an async iterator of status dicts.

    It holds at most ``service.pull_progress_buffer`` unread events; past that it skips
    new intermediate ones (counted in :attr:`skipped`). Iteration ends after the final
    event (``success``, ``error`` or ``cancelled``), which is never skipped. With
    ``heartbeat_s``, a pull that reports nothing for that long (queued behind others,
    or a stalled download) gives its current state again: a heartbeat.
    """

    def __init__(self, handle: PullHandle, buffer: int, heartbeat_s: float | None) -> None:
        self._handle = handle
        self._send, self._receive = trio.open_memory_channel[dict[str, Any]](buffer)
        self._heartbeat_s = heartbeat_s
        self._ended = False
        self.skipped = 0

    def __aiter__(self) -> PullEvents:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if self._ended:
            raise StopAsyncIteration
        try:
            if self._heartbeat_s is None:
                event = await self._receive.receive()
            else:
                # A receive that is cancelled takes nothing off the channel.
                with trio.move_on_after(self._heartbeat_s):
                    return self._seen(await self._receive.receive())
                event = self._handle.status()
        except trio.EndOfChannel:
            # The pull ended while this watcher's buffer was full: hand it the final state.
            event = self._handle.status()
        except trio.ClosedResourceError:
            raise StopAsyncIteration from None  # read after its `watch` block ended
        return self._seen(event)

    def _seen(self, event: dict[str, Any]) -> dict[str, Any]:
        if event["status"] in FINAL_STATUSES:
            self._ended = True
        return event

    def _offer(self, event: dict[str, Any]) -> None:
        try:
            self._send.send_nowait(event)
        except trio.WouldBlock:
            self.skipped += 1
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    def _end(self) -> None:
        self._send.close()

    def _discard(self) -> None:
        self._send.close()
        self._receive.close()


class PullHandle:
    """One pull, running or finished. Every caller that joins the pull gets this object.

    Whoever runs the pull (the pull manager) runs it inside :attr:`cancel_scope`,
    reports its progress through the methods of :class:`~pool.pulls._download.Progress`
    and ends it with :meth:`finish`; everyone else reads, waits, watches or cancels.

    Attributes:
        model: the model name the pull writes under (``<store>/<model>/``).
        source: what it pulls from.
    """

    def __init__(self, model: str, source: str, buffer: int) -> None:
        self.model = model
        self.source = source
        self._buffer = buffer
        self._state: dict[str, Any] = {
            "model": model,
            "source": source,
            "status": "queued",
            "completed": 0,
            "total": None,
            "files_done": 0,
            "files_total": 0,
            "file": None,
            "error": None,
            "path": None,
            "started_at": time.time(),
            "finished_at": None,
        }
        self._watchers: set[PullEvents] = set()
        self._done = trio.Event()
        # Made here, not when the pull starts: a cancel that comes first still counts.
        self._scope = trio.CancelScope()

    # -- for everyone ---------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self._done.is_set()

    def status(self) -> dict[str, Any]:
        """The current state (fields that are not known yet are left out).

        Keys: ``model``, ``source``, ``status``, ``completed`` and ``total`` (bytes over
        all files), ``files_done``, ``files_total``, ``file`` (the current one),
        ``error``, ``path`` (the pulled file, or folder for several files),
        ``started_at`` and ``finished_at`` (Unix times). Always there too, the same
        facts as the embedded-engine spec names them: ``state`` (``queued``,
        ``downloading``, ``completed``, ``failed``, ``cancelled``), ``progress`` (percent,
        100 once completed, 0 while the size is unknown), ``total_bytes`` (0 while
        unknown) and ``downloaded_bytes``.
        """
        known = {key: value for key, value in self._state.items() if value is not None}
        state = _SPEC_STATES[known["status"]]
        total, done = known.get("total") or 0, known["completed"]
        if state == "completed":
            progress = 100.0
        else:
            progress = round(min(done, total) / total * 100, 1) if total else 0.0
        return known | {
            "state": state,
            "progress": progress,
            "total_bytes": total,
            "downloaded_bytes": done,
        }

    async def wait(self) -> dict[str, Any]:
        """Wait for the pull to end; its final state."""
        await self._done.wait()
        return self.status()

    async def cancel(self) -> None:
        """Cancel the pull and wait until it has ended (at once if it already had)."""
        self._scope.cancel()
        await self._done.wait()

    @asynccontextmanager
    async def watch(self, heartbeat_s: float | None = None) -> AsyncIterator[PullEvents]:
        """Follow this pull: the events start with its state at the time of subscribing.

        With ``heartbeat_s``, the state comes again whenever the pull reports nothing
        for that long (see :class:`PullEvents`).
        """
        events = PullEvents(self, self._buffer, heartbeat_s)
        events._offer(self.status())
        if self.done:
            events._end()
        else:
            self._watchers.add(events)
        try:
            yield events
        finally:
            self._watchers.discard(events)
            events._discard()

    # -- for whoever runs the pull ---------------------------------------------------------
    @property
    def cancel_scope(self) -> trio.CancelScope:
        """The scope the pull runs in; :meth:`cancel` cancels it."""
        return self._scope

    def resolving(self) -> None:
        """The pull has its turn and is listing its source's files."""
        self._update(status="pulling manifest")

    def downloading(self, files: int, total: int | None) -> None:
        """The download of ``files`` files (``total`` bytes, if known) begins."""
        self._update(files_total=files, total=total, status="downloading")

    def file_started(self, name: str) -> None:
        """The file ``name`` is next."""
        self._update(file=name, status="downloading")

    def progressed(self, completed: int) -> None:
        """``completed`` bytes over all files are written."""
        self._update(completed=completed)

    def file_size_known(self, through: int) -> None:
        """A response stated the current file's size: all files so far hold ``through``."""
        if self._state["files_total"] == 1:
            self._update(total=through)

    def verifying(self) -> None:
        """The current file's digest is being checked."""
        self._update(status="verifying sha256 digest")

    def file_finished(self, completed: int) -> None:
        """The current file is whole and verified; ``completed`` bytes over all files."""
        self._update(files_done=self._state["files_done"] + 1, completed=completed)

    def finish(self, status: PullStatus, error: str | None = None, path: str | None = None) -> None:
        """End the pull: watchers get the final event, :meth:`wait` returns."""
        self._update(status=status, error=error, finished_at=time.time(), path=path)
        for watcher in self._watchers:
            watcher._end()
        self._watchers.clear()
        self._done.set()

    def _update(self, **changes: Any) -> None:
        self._state.update(changes)
        event = self.status()
        for watcher in list(self._watchers):
            watcher._offer(event)
