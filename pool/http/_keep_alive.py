"""Hypercorn's keep-alive timer as one task per connection whose deadline moves, not a
task started and cancelled for every request.

Hypercorn (0.18) closes a kept-alive connection that stays idle for
``keep_alive_timeout`` (``service.keep_alive_s``), or at once when the server is
terminating, with a timer task: it cancels the task when a request arrives and starts a
new one when the answer is done. Each request so pays a task start (the new task runs to
``started`` and its starter waits for that), a cancelled task's last step, a lock and
the timer's cancel scopes (docs/performance.md, "The JSON path's fixed cost").

:class:`KeepAliveTimer` keeps Hypercorn's meaning with one task started with the
connection: idle arms its deadline (``keep_alive_timeout`` from now; now, when the
server is terminating), busy moves it to never, and a termination that comes while the
connection is idle closes it at once, as Hypercorn's timer did.

**A connection closed between requests is closed at once.** The task ends, closing
nothing, once the connection stops reading (the client closed it or the server did).
Hypercorn's own timer did not: when a client closed its kept-alive connection after an
answer (an HTTP client over its keep-alive limit closes right after reading the answer,
and every client closes its idle connections when it ends), the end of file was read but
the timer started after that answer ran on, and the connection's task group, which the
socket's close waits for, waited for it: the socket stayed in CLOSE_WAIT, holding a file
descriptor and two tasks, for the whole ``service.keep_alive_s`` (75 s by default), and
under steady traffic from such clients the descriptors piled up by the thousand.

:class:`PoolTCPServer` also reads and writes a plain TCP connection through
:class:`~pool.http._direct_stream.DirectSocketStream`, without Trio's scheduler pass
after each call that did not wait. :func:`install` puts it where Hypercorn's trio
``serve`` builds its connections, after checking that the names it relies on are still
Hypercorn's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import hypercorn.trio.run
import trio
from hypercorn.events import Closed, Event, RawData
from hypercorn.trio.tcp_server import TCPServer

from pool.http._direct_stream import DirectSocketStream


class KeepAliveTimer:
    """The idle timer of one :class:`PoolTCPServer` connection (the module's doc), with
    the interface of Hypercorn's ``TrioSingleTask``, which ``TCPServer`` drives:
    ``restart`` when the connection is idle, ``stop`` when a request arrives."""

    def __init__(self, server: TCPServer) -> None:
        self._server = server
        self._deadline: trio.CancelScope | None = None  # the task's timer, once started
        self._idle = False
        self._ended = False

    async def restart(self, task_group: Any, action: Callable[[], Any]) -> None:
        """The connection is idle: close it after the keep-alive timeout."""
        del action  # Hypercorn's own timer task; this one closes the connection itself
        self._idle = True
        if self._ended:
            return
        if self._deadline is None:
            await task_group._nursery.start(self._run)  # the connection's nursery
        else:
            self._arm()

    async def stop(self) -> None:
        """The connection is busy: no timeout until it is idle again."""
        self._idle = False
        if self._deadline is not None:
            self._deadline.deadline = math.inf

    def end(self) -> None:
        """The connection stopped reading: end the task, closing nothing."""
        self._ended = True
        if self._deadline is not None:
            self._deadline.cancel()

    def _arm(self) -> None:
        assert self._deadline is not None
        if not self._idle:
            self._deadline.deadline = math.inf
            return
        terminating = self._server.context.terminated.is_set()
        wait = 0.0 if terminating else float(self._server.config.keep_alive_timeout)
        self._deadline.deadline = trio.current_time() + wait

    async def _run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        while True:
            with trio.CancelScope() as deadline:
                self._deadline = deadline
                self._arm()
                task_status.started()
                task_status = trio.TASK_STATUS_IGNORED
                await self._server.context.terminated.wait()
                if not self._idle:
                    # Busy as the server terminates: the next restart() arms "now".
                    await trio.sleep_forever()
            if self._ended:
                return
            if self._idle:
                break
            # The deadline passed as a request arrived: the connection is busy, keep it.
        with trio.CancelScope(shield=True):
            await self._server._initiate_server_close()


class PoolTCPServer(TCPServer):
    """Hypercorn's trio connection with :class:`KeepAliveTimer` as its idle timer, read
    and written through :class:`~pool.http._direct_stream.DirectSocketStream` (plain
    TCP), its writes' lock taken without a scheduler pass when it is free."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        if isinstance(self.stream, trio.SocketStream):
            self.stream = DirectSocketStream(self.stream)
        self._timer = KeepAliveTimer(self)
        self.idle_task = self._timer  # type: ignore[assignment]  # same interface

    async def _read_data(self) -> None:
        try:
            await super()._read_data()
        finally:
            self._timer.end()

    async def protocol_send(self, event: Event) -> None:
        if not isinstance(event, RawData):
            await super().protocol_send(event)
            return
        # Hypercorn's write, with its lock taken at once when free: Trio's ``acquire``
        # passes through the scheduler even when it need not wait (a task step a write).
        if not _try_acquire(self.send_lock):
            await self.send_lock.acquire()
        try:
            with trio.CancelScope(shield=True):
                await self.stream.send_all(event.data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            await self.protocol.handle(Closed())
        finally:
            self.send_lock.release()


def _try_acquire(lock: trio.Lock) -> bool:
    try:
        lock.acquire_nowait()
    except trio.WouldBlock:
        return False
    return True


def install() -> None:
    """Have Hypercorn's trio ``serve`` build :class:`PoolTCPServer` connections
    (idempotent; a Hypercorn that no longer builds ``TCPServer`` by that name, or whose
    connection lacks a name used here, fails here, at start)."""
    current = getattr(hypercorn.trio.run, "TCPServer", None)
    if current is PoolTCPServer:
        return
    if current is not TCPServer:
        raise RuntimeError(f"hypercorn.trio.run.TCPServer is {current!r}, not Hypercorn's")
    drives_idle_task = "idle_task" in TCPServer.protocol_send.__code__.co_names
    methods = all(hasattr(TCPServer, name) for name in ("_read_data", "_initiate_server_close"))
    if not (drives_idle_task and methods):
        raise RuntimeError("Hypercorn's TCPServer no longer has the idle timer replaced here")
    if not {"send_lock", "stream"} <= set(TCPServer.__init__.__code__.co_names):
        raise RuntimeError("Hypercorn's TCPServer no longer writes as protocol_send does here")
    setattr(hypercorn.trio.run, "TCPServer", PoolTCPServer)  # noqa: B010 - not exported
