"""The pull manager: background downloads into the model store.

A pull belongs to the manager's nursery, not to the request that started it: a client
that disconnects stops watching, the download goes on. Pulls are deduplicated per
model; any number of watchers follow one, each through its own bounded channel (a slow
watcher misses intermediate progress, never the final state). Downloads resume with
HTTP ranges after a cut connection, are checked against a SHA-256 when the source gives
one, and are moved into place atomically; a failed pull leaves nothing in the store.

Sources: a local file, an http(s) URL, or a Hugging Face repo id (``owner/repo`` or
``owner/repo:file``; endpoint from ``service.hf_endpoint`` or ``HF_ENDPOINT``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import time
import urllib.parse
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import trio

from pool.actors._model_store import ModelStore, default_store, safe_name
from pool.errors import PoolError

if TYPE_CHECKING:
    from pool.actors._supervisor import Pool

log = logging.getLogger("pool.pulls")

_HF_REPO = re.compile(r"^[A-Za-z0-9][\w.\-]{0,95}/[\w.\-]{1,96}(?::[\w.\-]{1,128})?$")
_CHUNK = 1 << 20


@dataclass(frozen=True)
class RemoteFile:
    url: str | None
    local: Path | None
    name: str
    sha256: str | None = None


@dataclass
class PullState:
    model: str
    source: str
    status: str = "pulling manifest"
    completed: int = 0
    total: int | None = None
    files_done: int = 0
    files_total: int = 0
    file: str | None = None
    error: str | None = None
    path: str | None = None
    started_at: float = field(default_factory=time.time)
    finished_at: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


class _Pull:
    def __init__(self, state: PullState) -> None:
        self.state = state
        self.watchers: set[trio.MemorySendChannel[dict[str, Any]]] = set()
        self.done = trio.Event()
        self.scope = trio.CancelScope()

    def publish(self) -> None:
        event = self.state.as_dict()
        for watcher in list(self.watchers):
            try:
                watcher.send_nowait(event)
            except trio.WouldBlock:
                pass  # a slow watcher skips this step; it still gets the final state
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self.watchers.discard(watcher)


class PullManager:
    """Owns every download; see the module docstring."""

    def __init__(self, pool: Pool) -> None:
        service = pool.settings.service
        self._pool = pool
        self.store = ModelStore(
            Path(service.model_store).expanduser() if service.model_store else default_store()
        )
        self._endpoint = (
            service.hf_endpoint or os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
        )
        self._buffer = service.pull_progress_buffer
        self._retries = service.pull_retries
        self._pulls: dict[str, _Pull] = {}
        self._limiter = trio.CapacityLimiter(2)
        self._nursery: trio.Nursery | None = None

    async def run(
        self, *, task_status: trio.TaskStatus[PullManager] = trio.TASK_STATUS_IGNORED
    ) -> None:
        await trio.to_thread.run_sync(self.store.ensure)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started(self)
            await trio.sleep_forever()

    # -- API ------------------------------------------------------------------------
    def pull(self, model: str, source: str | None = None, sha256: str | None = None) -> PullState:
        """Start (or join) the pull of ``model``; its ``source`` defaults to the config's.

        Raises:
            PoolError: ``invalid_request`` for a bad name or source, ``unknown_model``
                for an unconfigured name without a source.
        """
        safe_name(model)
        running = self._pulls.get(model)
        if running is not None and not running.done.is_set():
            return running.state
        if source is None:
            source = self._pool.model(model).definition.source
            if not source:
                raise PoolError("invalid_request", f"model {model!r} has no `source` to pull from")
        if self._nursery is None:
            raise PoolError("shutting_down", "the pull manager is not running")
        pull = _Pull(PullState(model=model, source=source))
        self._pulls[model] = pull
        self._nursery.start_soon(self._run_pull, pull, sha256)
        return pull.state

    def status(self, model: str) -> dict[str, Any] | None:
        pull = self._pulls.get(model)
        return None if pull is None else pull.state.as_dict()

    async def cancel(self, model: str) -> bool:
        pull = self._pulls.get(model)
        if pull is None or pull.done.is_set():
            return False
        pull.scope.cancel()
        await pull.done.wait()
        return True

    @asynccontextmanager
    async def watch(self, model: str) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
        """Progress events of the pull of ``model``, ending with its final state."""
        pull = self._pulls.get(model)
        if pull is None:
            raise PoolError("not_found", f"no pull of {model!r}")
        send, receive = trio.open_memory_channel[dict[str, Any]](self._buffer)
        pull.watchers.add(send)

        async def events() -> AsyncIterator[dict[str, Any]]:
            yield pull.state.as_dict()
            async with receive:
                async for event in receive:
                    yield event
            yield pull.state.as_dict()

        try:
            yield events()
        finally:
            pull.watchers.discard(send)
            send.close()

    async def delete(self, model: str) -> bool:
        """Remove ``model``'s pulled files; 409 while it is loaded, False if none."""
        directory = self.store.model_dir(model)
        actor = self._pool.models.get(model)
        if actor is not None and actor.state in ("loaded", "loading", "unloading"):
            raise PoolError(
                "model_in_use", f"model {model!r} is {actor.state}; unload it before deleting it"
            )
        pull = self._pulls.get(model)
        if pull is not None and not pull.done.is_set():
            await self.cancel(model)
        if not directory.exists():
            return False
        await trio.to_thread.run_sync(shutil.rmtree, directory)
        self._pulls.pop(model, None)
        return True

    # -- the work ---------------------------------------------------------------------
    async def _run_pull(self, pull: _Pull, sha256: str | None) -> None:
        state = pull.state
        partials: list[Path] = []
        try:
            with pull.scope:
                pull.publish()
                files = await self._resolve(state.source, sha256)
                state.files_total = len(files)
                state.status = "downloading"
                final_paths = []
                async with httpx.AsyncClient(
                    timeout=httpx.Timeout(30.0), follow_redirects=True
                ) as client:
                    for remote in files:
                        partial = self.store.partial_path(state.model, remote.name)
                        partials.append(partial)
                        state.file = remote.name
                        remote = await self._fetch(client, remote, partial, pull)
                        final_paths.append(await self._verify_and_place(remote, partial, pull))
                        state.files_done += 1
                        pull.publish()
                state.status = "success"
                state.path = (
                    str(final_paths[0]) if len(final_paths) == 1 else str(final_paths[0].parent)
                )
                self._point_model_at(state.model, Path(state.path))
            if pull.scope.cancelled_caught:
                state.status, state.error = "cancelled", "the pull was cancelled"
        except PoolError as exc:
            state.status, state.error = "error", exc.message
        except (httpx.HTTPError, OSError) as exc:
            state.status, state.error = "error", f"{type(exc).__name__}: {exc}"
        finally:
            if state.status != "success":
                for partial in partials:
                    partial.unlink(missing_ok=True)
            state.finished_at = time.time()
            log.info("pull model=%s %s %s", state.model, state.status, state.error or "")
            pull.publish()
            for watcher in list(pull.watchers):
                watcher.close()
            pull.done.set()

    async def _resolve(self, source: str, sha256: str | None) -> list[RemoteFile]:
        if source.startswith(("http://", "https://")):
            parsed = urllib.parse.urlsplit(source)
            name = urllib.parse.unquote(parsed.path.rsplit("/", 1)[-1])
            return [RemoteFile(source, None, safe_name(name, "file name"), sha256)]
        if source.startswith("file:") or "://" in source:
            raise PoolError(
                "invalid_request",
                f"source {source!r}: only http(s) URLs, local paths and Hugging Face repo ids",
            )
        if source.startswith(("/", ".", "~")):
            local = await trio.to_thread.run_sync(lambda: Path(source).expanduser().resolve())
            if not await trio.to_thread.run_sync(local.is_file):
                raise PoolError("invalid_request", f"source {source!r} is not a file")
            return [RemoteFile(None, local, safe_name(local.name, "file name"), sha256)]
        if _HF_REPO.match(source):
            return await trio.to_thread.run_sync(self._hf_files, source, limiter=self._limiter)
        raise PoolError("invalid_request", f"source {source!r} is not a URL, a path or a repo id")

    def _hf_files(self, source: str) -> list[RemoteFile]:
        from huggingface_hub import HfApi, hf_hub_url
        from huggingface_hub.hf_api import RepoFile

        repo, _, wanted = source.partition(":")
        try:
            tree = HfApi(endpoint=self._endpoint).list_repo_tree(repo, recursive=True)
            entries = [e for e in tree if isinstance(e, RepoFile)]
        except Exception as exc:
            raise PoolError(
                "invalid_request", f"cannot list {repo} on {self._endpoint}: {exc}"
            ) from exc
        if wanted:
            entries = [e for e in entries if e.path == wanted]
        elif any(e.path.endswith(".gguf") for e in entries):
            entries = [e for e in entries if e.path.endswith(".gguf")]
        if not entries:
            raise PoolError("invalid_request", f"{source}: no matching files in the repository")
        return [
            RemoteFile(
                hf_hub_url(repo, e.path, endpoint=self._endpoint),
                None,
                safe_name(e.path.replace("/", "--"), "file name"),
                e.lfs.sha256 if e.lfs is not None else None,
            )
            for e in entries
        ]

    async def _fetch(
        self, client: httpx.AsyncClient, remote: RemoteFile, partial: Path, pull: _Pull
    ) -> RemoteFile:
        """Download ``remote`` into ``partial``; returns it with any checksum the server sent."""
        await trio.to_thread.run_sync(lambda: partial.parent.mkdir(parents=True, exist_ok=True))
        state = pull.state
        if remote.local is not None:
            size = remote.local.stat().st_size
            state.total = (state.total or 0) + size
            await trio.to_thread.run_sync(
                shutil.copyfile, remote.local, partial, limiter=self._limiter
            )
            state.completed += size
            pull.publish()
            return remote
        assert remote.url is not None
        base_completed = state.completed
        attempts = 0
        while True:
            have = partial.stat().st_size if partial.exists() else 0  # noqa: ASYNC240
            headers = {"Range": f"bytes={have}-"} if have else {}
            try:
                async with client.stream("GET", remote.url, headers=headers) as response:
                    if response.status_code == 416 and have:
                        return remote  # the partial file is already whole
                    if response.status_code >= 400:
                        raise PoolError(
                            "invalid_request", f"{remote.url} answered HTTP {response.status_code}"
                        )
                    if response.status_code == 200 and have:
                        have = 0  # no range support: start over
                    length = response.headers.get("content-length")
                    expected = have + int(length) if length is not None else None
                    if remote.sha256 is None and (
                        digest := response.headers.get("x-checksum-sha256")
                    ):
                        remote = RemoteFile(remote.url, None, remote.name, digest.lower())
                    state.total = base_completed + expected if expected is not None else None
                    mode = "ab" if have else "wb"
                    written = have
                    async with await trio.open_file(partial, mode) as out:
                        async for chunk in response.aiter_bytes():
                            await out.write(chunk)
                            written += len(chunk)
                            state.completed = base_completed + written
                            pull.publish()
                    if expected is not None and written < expected:
                        raise httpx.ReadError(f"got {written} of {expected} bytes")
                    state.completed = base_completed + written
                    return remote
            except (httpx.TransportError, httpx.RemoteProtocolError) as exc:
                attempts += 1
                if attempts > self._retries:
                    raise PoolError(
                        "invalid_request", f"download of {remote.url} failed: {exc}"
                    ) from exc
                log.info("pull %s: %s; resuming (attempt %d)", state.model, exc, attempts)
                await trio.sleep(min(2.0, 0.2 * attempts))

    async def _verify_and_place(self, remote: RemoteFile, partial: Path, pull: _Pull) -> Path:
        expected = remote.sha256
        if expected is None and remote.url is not None:
            expected = await self._sidecar_checksum(remote.url)
        if expected is not None:
            pull.state.status = "verifying sha256 digest"
            pull.publish()
            actual = await trio.to_thread.run_sync(_sha256, partial, limiter=self._limiter)
            if actual != expected.lower().removeprefix("sha256:"):
                raise PoolError(
                    "invalid_request", f"{remote.name}: sha256 {actual} does not match {expected}"
                )
            pull.state.status = "downloading"
        target = self.store.file_path(pull.state.model, remote.name)
        await trio.to_thread.run_sync(_place, partial, target, limiter=self._limiter)
        return target

    async def _sidecar_checksum(self, url: str) -> str | None:
        """``<url>.sha256`` when the source publishes one (first word of its text)."""
        try:
            async with httpx.AsyncClient(timeout=10.0) as client:
                response = await client.get(url + ".sha256")
        except httpx.HTTPError:
            return None
        if response.status_code != 200:
            return None
        words = response.text.split()
        return words[0].lower() if words and re.fullmatch(r"[0-9a-fA-F]{64}", words[0]) else None

    def _point_model_at(self, model: str, path: Path) -> None:
        # A configured model now serves the pulled file; a loaded one picks it up on
        # its next load (the definition is read at load time).
        actor = self._pool.models.get(model)
        if actor is not None:
            actor.definition = actor.definition.model_copy(update={"model_path": str(path)})


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _place(partial: Path, target: Path) -> None:
    with partial.open("rb") as handle:
        os.fsync(handle.fileno())
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(partial, target)
