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
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import trio

from pool.actors.residency._plan import LoadPlan
from pool.backends import LoadRequest
from pool.config import resolve_model_path
from pool.errors import PoolError

if TYPE_CHECKING:
    from pool.actors.residency._residency import Residency
    from pool.pulls import PullManager

log = logging.getLogger("pool.tasks")
# The share of a task's progress that a download takes, when the model must be fetched.
FETCH_SHARE = 0.9


def _present(model_path: str | None, base_dir: str | None) -> bool:
    """Whether ``model_path`` names a file or folder that exists."""
    if not model_path:
        return False
    try:
        return resolve_model_path(model_path, base_dir).exists()
    except FileNotFoundError:
        return False


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
    # 0..1: the download of a model not yet in the store takes the first FETCH_SHARE
    # (by bytes), the load the rest (it reports no steps: 1.0 once loaded).
    progress: float = 0.0
    phase: Literal["fetching", "loading"] = "loading"
    done: trio.Event = field(default_factory=trio.Event)


class LoadTasks:
    """The registry of load tasks, bounded to the ``max_tasks`` most recent."""

    def __init__(
        self, residency: Residency, pulls: PullManager, base_dir: str | None, max_tasks: int
    ) -> None:
        self._residency = residency
        self._pulls = pulls
        self._base_dir = base_dir
        self._max_tasks = max_tasks
        self._tasks: OrderedDict[str, LoadTask] = OrderedDict()
        self._counter = itertools.count(1)

    def start(
        self,
        nursery: trio.Nursery,
        model: str,
        body: LoadPlan | LoadRequest | Mapping[str, Any] | None,
        evict: str | None,
    ) -> LoadTask:
        """Validate at once (so a bad request is a 4xx now, not a failed task later);
        the load goes through the residency owner with the plan checked here."""
        residency = self._residency
        residency.model(model)
        if evict is not None:
            residency.model(evict)
            if evict == model:
                raise PoolError("invalid_request", "evictModel names the model being loaded")
        plan = body if isinstance(body, LoadPlan) else residency.plan(model, body)
        task = LoadTask(f"load-{next(self._counter)}-{secrets.token_hex(4)}", model, evict)
        if self._needs_fetch(model):
            task.phase = "fetching"
        self._tasks[task.task_id] = task
        while len(self._tasks) > self._max_tasks:
            self._tasks.popitem(last=False)
        nursery.start_soon(self._run, task, plan)
        return task

    async def _run(self, task: LoadTask, plan: LoadPlan) -> None:
        try:
            await self._fetch(task)
            task.phase = "loading"
            if task.evict is not None:
                await self._residency.unload(task.evict)
            snapshot = await self._residency.load(task.model, plan, reuse=True)
            task.status = "completed"
            task.progress = 1.0
            task.gpu_memory_used_mb = snapshot.vram.mib
        except PoolError as exc:
            task.status = "failed"
            task.error = exc.message
            task.error_code = exc.code
            log.warning("task=%s model=%s load failed: %s", task.task_id, task.model, exc.message)
        finally:
            task.load_time_ms = (trio.current_time() - task.started) * 1000.0
            task.done.set()

    def _needs_fetch(self, model: str) -> bool:
        """The model has a ``source`` to pull from and no file in place yet."""
        definition = self._residency.model(model).definition
        return bool(definition.source) and not _present(definition.model_path, self._base_dir)

    async def _fetch(self, task: LoadTask) -> None:
        """Pull the model into the store first when it has a ``source`` and no file yet.

        Raises:
            PoolError: ``load_failed`` when the pull ends in error or is cancelled.
        """
        if not self._needs_fetch(task.model):
            return
        definition = self._residency.model(task.model).definition
        task.phase = "fetching"
        handle = self._pulls.pull(task.model)
        async with handle.watch() as events:
            async for event in events:
                total = event.get("total")
                if total:
                    share = min(1.0, event.get("completed", 0) / total)
                    task.progress = round(FETCH_SHARE * share, 4)
        final = handle.status()
        if final["status"] != "success":
            raise PoolError(
                "load_failed",
                f"fetching {task.model!r} from {definition.source} failed:"
                f" {final.get('error') or final['status']}",
            )
        task.progress = FETCH_SHARE

    def latest(self, model: str) -> LoadTask | None:
        """The most recent task of ``model`` still remembered, if any."""
        for task in reversed(self._tasks.values()):
            if task.model == model:
                return task
        return None

    def get(self, task_id: str) -> LoadTask:
        try:
            return self._tasks[task_id]
        except KeyError:
            raise PoolError("not_found", f"no load task {task_id!r}") from None
