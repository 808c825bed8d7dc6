"""The pull manager: the actor that owns background downloads into the model store.

A pull belongs to the manager's nursery, not to whoever started it: a caller (an HTTP
client) that goes away only stops watching, the download goes on. There is at most one
running pull per model name; a second ``pull()`` joins it. A pull runs in four steps,
each in a module of its own: its source becomes a list of files (``_sources``), they
are downloaded and verified into ``<store>/.partial/<model>/`` (``_download``), then
installed into ``<store>/<model>/`` (``_install``), and the model is pointed at them.
A pull of a model whose store already holds a complete pull of the same source (and
checksum, where one is asked for) succeeds at once, downloading nothing.

What a failed pull leaves: nothing in the visible store, ever. Its partial files are
deleted, except when the connection kept breaking after bytes had arrived (retries
exhausted) or the pool shut down mid-download: then they stay in ``.partial/`` with
the validator they came with, and the next pull of the same URL resumes them. A
cancelled pull always deletes its partial files.

A configured model whose pull succeeds serves the pulled file: the manager sends its
actor the new ``model_path`` before the pull reports success. A model that is loaded
at that moment keeps serving the file it loaded and picks the new path up at its next
load. After a restart, a configured model whose store holds a complete pull of its
configured ``source`` points at that pull again.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Protocol, TypeVar

import trio

from pool.config import ModelDefinition, Settings
from pool.errors import PoolError
from pool.pulls._download import Downloader, DownloadInterrupted
from pool.pulls._handle import PullEvents, PullHandle, PullStatus
from pool.pulls._install import completed_pull, install
from pool.pulls._sources import (
    PullFile,
    Sources,
    classify_source,
    hub_endpoint,
    normal_sha256,
    shown_url,
)
from pool.pulls._store import ModelStore, default_store, safe_name

log = logging.getLogger("pool.pulls")

T = TypeVar("T")

# Finished pulls remembered for status(); the oldest are forgotten past this.
_FINISHED_KEPT = 256
_CLEANUP_S = 30.0


class PulledModel(Protocol):
    """What the pull manager needs of a configured model (a ``ModelActor`` is one)."""

    @property
    def definition(self) -> ModelDefinition:
        """The model's current definition: its ``source`` and ``model_path``."""

    @property
    def state(self) -> str:
        """Its runtime state (``unloaded``, ``loading``, ...)."""

    @property
    def load_pending(self) -> bool:
        """Whether an on-demand load is waiting to start."""

    async def set_model_path(self, path: str | None) -> None:
        """Point the model at ``path`` from its next load on."""


class PullManager:
    """Owns every download into the model store; see the module docstring.

    Started by :func:`pool.open_pool`; callers reach it through ``Pool.pull`` and its kin.

    Args:
        settings: the pool's settings (``service.*`` pull settings, the configured
            models, the settings folder).
        models: the configured models by name; a pull of one of them fills its
            ``model_path``.
    """

    def __init__(self, settings: Settings, models: Mapping[str, PulledModel]) -> None:
        service = settings.service
        self._settings = settings
        self._models = models
        root = Path(service.model_store).expanduser() if service.model_store else default_store()
        if not root.is_absolute():
            root = Path(settings.base_dir or os.getcwd()) / root
        self.store = ModelStore(root)
        self._buffer = service.pull_progress_buffer
        self._slots = trio.Semaphore(service.pull_concurrency)
        self._threads = trio.CapacityLimiter(service.pull_concurrency)
        self._sources = Sources(
            self.store, base_dir=settings.base_dir, endpoint=hub_endpoint(service.hf_endpoint)
        )
        self._downloader = Downloader(
            self.store,
            threads=self._threads,
            retries=service.pull_retries,
            timeout=service.pull_timeout_s,
        )
        self._pulls: dict[str, PullHandle] = {}
        self._nursery: trio.Nursery | None = None

    async def run(
        self, *, task_status: trio.TaskStatus[PullManager] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """The actor: points models at their completed pulls, then owns the download tasks."""
        for model, path in (await self._thread(self._completed_pulls)).items():
            await self._point_model_at(model, path)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started(self)
            await trio.sleep_forever()

    # -- API ------------------------------------------------------------------------------
    def pull(self, model: str, source: str | None = None, sha256: str | None = None) -> PullHandle:
        """Start the pull of ``model`` in the background, or join the one running.

        Args:
            model: the name to store the pull under; for a configured model, the model
                whose ``model_path`` the pull fills.
            source: where to pull from; defaults to the configured model's ``source``.
                Required for a name that is not configured.
            sha256: the expected SHA-256 (hex, optionally ``sha256:``-prefixed) of a
                single-file source; it takes precedence over what the source states.

        Returns:
            The :class:`PullHandle`; joining a running pull returns that pull's handle.

        Raises:
            PoolError: ``invalid_request`` for a bad name, source or checksum, or an
                explicit source different from that of the running pull;
                ``unknown_model`` for an unconfigured name without a source;
                ``shutting_down`` when the manager is not running.
        """
        safe_name(model)
        expected = normal_sha256(sha256) if sha256 is not None else None
        running = self._pulls.get(model)
        if running is not None and not running.done:
            if source is not None and source != running.source:
                raise PoolError(
                    "invalid_request",
                    f"a pull of {model!r} from {running.source!r} is running; cancel it first",
                )
            return running
        if source is None:
            actor = self._models.get(model)
            if actor is None:
                raise PoolError(
                    "unknown_model", f"model {model!r} is not configured; name a source to pull"
                )
            source = actor.definition.source
            if not source:
                raise PoolError("no_pull_source", f"model {model!r} has no `source` to pull from")
        classify_source(source)
        if self._nursery is None:
            raise PoolError("shutting_down", "the pull manager is not running")
        handle = PullHandle(model, source, self._buffer)
        self._remember(handle)
        self._nursery.start_soon(self._run, handle, expected, name=f"pull {model}")
        return handle

    def get(self, model: str) -> PullHandle | None:
        """The current or last pull of ``model``, if the manager remembers one."""
        return self._pulls.get(model)

    def status(self, model: str) -> dict[str, Any] | None:
        """The state of the current or last pull of ``model`` (see :meth:`PullHandle.status`)."""
        handle = self._pulls.get(model)
        return None if handle is None else handle.status()

    def running(self) -> dict[str, dict[str, Any]]:
        """The state of every pull under way, by model (see :meth:`PullHandle.status`)."""
        return {model: h.status() for model, h in self._pulls.items() if not h.done}

    @asynccontextmanager
    async def watch(
        self, model: str, heartbeat_s: float | None = None
    ) -> AsyncIterator[PullEvents]:
        """Follow the current or last pull of ``model`` (see :class:`PullEvents`).

        Leaving the block unsubscribes; the pull itself goes on. With ``heartbeat_s``,
        a pull that reports nothing for that long gives its state again.

        Raises:
            PoolError: ``not_found`` (404) when no pull of ``model`` is known.
        """
        handle = self._pulls.get(model)
        if handle is None:
            raise PoolError("not_found", f"no pull of {model!r}")
        async with handle.watch(heartbeat_s) as events:
            yield events

    async def stored_models(self) -> list[str]:
        """The models whose pull the store holds complete, by name."""
        return await self._thread(self.store.pulled_models)

    async def cancel(self, model: str) -> bool:
        """Stop the running pull of ``model`` and delete its partial files.

        Returns:
            True once it has stopped; False if no pull of ``model`` was running.
        """
        handle = self._pulls.get(model)
        if handle is None or handle.done:
            return False
        await handle.cancel()
        return True

    async def delete(self, model: str) -> bool:
        """Remove ``model``'s pulled files (and partials) from the store.

        A running pull of it is cancelled first. A configured model that pointed at the
        deleted files goes back to its configured ``model_path``. Another task could
        start loading the model while the files are being removed; that load fails.

        Returns:
            Whether the store held anything for ``model``.

        Raises:
            PoolError: ``model_in_use`` (409) while the model is loaded, loading,
                unloading or waiting for an on-demand load; ``invalid_request`` for a
                bad name.
        """
        safe_name(model)
        self._refuse_in_use(model)
        await self.cancel(model)
        self._refuse_in_use(model)
        existed = await self._thread(self.store.remove_model, model)
        self._pulls.pop(model, None)
        actor = self._models.get(model)
        configured = self._settings.engine.models.get(model)
        if actor is not None and configured is not None:
            current = actor.definition.model_path
            if current and current != configured.model_path and self.store.contains(Path(current)):
                await actor.set_model_path(configured.model_path)
        return existed

    # -- one pull ---------------------------------------------------------------------------
    async def _run(self, handle: PullHandle, sha256: str | None) -> None:
        model = handle.model
        keep_partials = False
        outcome: tuple[PullStatus, str | None] = ("error", "the pull ended unexpectedly")
        pulled: Path | None = None
        try:
            with handle.cancel_scope:
                # A model the store already holds from this source is not fetched again
                # (nor does it wait for a download slot): delete it to pull it afresh.
                source = handle.source
                pulled = await self._thread(completed_pull, self.store, model, source, sha256)
                if pulled is None:
                    async with self._slots:
                        handle.resolving()
                        files = await self._resolve(source, sha256)
                        await self._downloader.fetch(model, files, handle)
                        pulled = await self._thread(install, self.store, model, source, files)
            if handle.cancel_scope.cancelled_caught:
                outcome = ("cancelled", "the pull was cancelled")
            else:
                # Installed: from here on a cancel of the pull is too late to undo it.
                assert pulled is not None
                await self._point_model_at(model, pulled)
                outcome = ("success", None)
        except DownloadInterrupted as exc:
            keep_partials = True
            outcome = ("error", str(exc))
        except PoolError as exc:
            outcome = ("error", exc.message)
        except OSError as exc:
            outcome = ("error", f"file error: {exc}")
        except trio.Cancelled:
            keep_partials = True  # the pool is shutting down: a later pull may resume
            outcome = ("error", "the pool shut down during the pull")
            raise
        except Exception as exc:  # a broken pull must not take the pool down
            log.exception("pull model=%s failed unexpectedly", model)
            outcome = ("error", f"internal error: {type(exc).__name__}: {exc}")
        finally:
            status, error = outcome
            if status != "success" and not keep_partials:
                with trio.move_on_after(_CLEANUP_S, shield=True):
                    await self._cleanup(model)
            log.info(
                "pull model=%s source=%s status=%s%s",
                model,
                shown_url(handle.source) if "://" in handle.source else handle.source,
                status,
                f" error={error}" if error else "",
            )
            handle.finish(status, error, path=str(pulled) if status == "success" else None)

    async def _resolve(self, source: str, sha256: str | None) -> list[PullFile]:
        return await self._thread(self._sources.files, source, sha256)

    async def _cleanup(self, model: str) -> None:
        try:
            await self._thread(self.store.remove_partials, model)
        except (OSError, PoolError) as exc:
            log.warning("pull model=%s could not remove partial files: %s", model, exc)

    # -- the models ---------------------------------------------------------------------------
    def _completed_pulls(self) -> dict[str, Path]:
        """Configured models whose store holds a complete pull of their ``source``."""
        found: dict[str, Path] = {}
        for name, actor in self._models.items():
            source = actor.definition.source
            if source and (path := completed_pull(self.store, name, source)) is not None:
                found[name] = path
        return found

    async def _point_model_at(self, model: str, path: Path) -> None:
        actor = self._models.get(model)
        if actor is not None:
            await actor.set_model_path(str(path))
            log.info("pull model=%s model_path=%s (pulled)", model, path)

    def _refuse_in_use(self, model: str) -> None:
        actor = self._models.get(model)
        if actor is not None and (
            actor.state in ("loaded", "loading", "unloading") or actor.load_pending
        ):
            raise PoolError(
                "model_in_use", f"model {model!r} is {actor.state}; unload it before deleting it"
            )

    def _remember(self, handle: PullHandle) -> None:
        self._pulls.pop(handle.model, None)
        self._pulls[handle.model] = handle
        finished = [name for name, h in self._pulls.items() if h.done]
        for name in finished[: max(0, len(finished) - _FINISHED_KEPT)]:
            del self._pulls[name]

    async def _thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await trio.to_thread.run_sync(fn, *args, limiter=self._threads)
