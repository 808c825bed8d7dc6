"""Asynchronous load tasks of the runner API (``POST /v1/models/load`` answers 202).

A task runs in the pool's nursery, so it outlives the HTTP request that started it;
its record is kept for polling until ``max_tasks`` newer ones have replaced it.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import trio

from pool.config import LoadRequest, validate_load_request
from pool.errors import PoolError

if TYPE_CHECKING:
    from pool.actors._supervisor import Pool

log = logging.getLogger("pool.tasks")


@dataclass(slots=True)
class LoadTask:
    """One task's record, updated as the load goes; the runner API renders it."""

    task_id: str
    model: str
    evict: str | None
    status: Literal["loading", "completed", "failed"] = "loading"
    created_at: float = field(default_factory=time.time)
    started: float = field(default_factory=trio.current_time)
    load_time_ms: float | None = None
    error: str | None = None
    error_code: str | None = None
    gpu_memory_used_mb: int | None = None
    done: trio.Event = field(default_factory=trio.Event)


class LoadTasks:
    """The registry of load tasks, bounded to the ``max_tasks`` most recent."""

    def __init__(self, pool: Pool, max_tasks: int) -> None:
        self._pool = pool
        self._max_tasks = max_tasks
        self._tasks: OrderedDict[str, LoadTask] = OrderedDict()
        self._counter = itertools.count(1)

    def start(
        self, nursery: trio.Nursery, model: str, body: LoadRequest, evict: str | None
    ) -> LoadTask:
        """Validate at once (so a bad request is a 4xx now, not a failed task later)."""
        actor = self._pool.model(model)
        if evict is not None:
            self._pool.model(evict)
            if evict == model:
                raise PoolError("invalid_request", "evictModel names the model being loaded")
        validate_load_request(body, actor.definition)
        task = LoadTask(f"load-{next(self._counter)}-{secrets.token_hex(4)}", model, evict)
        self._tasks[task.task_id] = task
        while len(self._tasks) > self._max_tasks:
            self._tasks.popitem(last=False)
        nursery.start_soon(self._run, task, body)
        return task

    async def _run(self, task: LoadTask, body: LoadRequest) -> None:
        try:
            if task.evict is not None:
                await self._pool.unload(task.evict)
            snapshot = await self._pool.load(task.model, body)
            task.status = "completed"
            task.gpu_memory_used_mb = snapshot.vram.mib
        except PoolError as exc:
            task.status = "failed"
            task.error = exc.message
            task.error_code = exc.code
            log.warning("task=%s model=%s load failed: %s", task.task_id, task.model, exc.message)
        finally:
            task.load_time_ms = (trio.current_time() - task.started) * 1000.0
            task.done.set()

    def get(self, task_id: str) -> LoadTask:
        try:
            return self._tasks[task_id]
        except KeyError:
            raise PoolError("not_found", f"no load task {task_id!r}") from None
