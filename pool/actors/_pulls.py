"""The pull manager: background downloads into the model store.

A pull belongs to the manager's nursery, not to whoever started it: a caller (an HTTP
client) that goes away only stops watching, the download goes on. There is at most one
running pull per model name; a second ``pull()`` joins it. Any number of watchers
follow one pull, each through its own bounded channel: a watcher that reads slowly
misses intermediate progress events, never the final one, and never slows the
download down.

Sources (``ModelDefinition.source``, or the ``source`` argument):

* a local file or folder: ``/abs/path``, ``./rel``, ``../rel``, ``~/path`` or
  ``pkg://package/file`` (relative paths start at the settings file's folder);
* an ``http://`` or ``https://`` URL naming one file;
* a Hugging Face repo id, ``owner/name[@revision][:path/in/repo]``. Without a file, a
  repo with one ``.gguf`` pulls that file and a repo without any pulls every file
  (dotfiles aside); several ``.gguf`` files must be told apart with ``:file``. The
  endpoint is ``service.hf_endpoint``, else ``$HF_ENDPOINT``, else the public hub; the
  files then travel through the same HTTP path as URLs (same progress, resume and
  checks), with the hub's own headers (its token, if one is configured).

Every file is written into ``<store>/.partial/<model>/`` and hashed as it is written.
Its SHA-256 is checked against, in this order: the caller's ``sha256``; the hub's LFS
digest; the response's ``X-Checksum-Sha256``, ``Repr-Digest``, ``Digest`` (or, on a
whole-file response, ``Content-Digest``) header, or an ETag/``X-Linked-Etag`` that is a
bare 64-hex SHA-256; a ``<url>.sha256`` file next to the source. A response shorter
than its ``Content-Length`` is a cut connection, never a success: the next attempt
asks for the rest with ``Range`` (and ``If-Range``, so a file that changed meanwhile
starts over). Only when every file is complete and verified are they fsynced and moved
into ``<store>/<model>/`` with ``os.replace``; the manifest is written last.

What a failed pull leaves: nothing in the visible store, ever. Its partial files are
deleted, except when the connection kept breaking after bytes had arrived (retries
exhausted) or the pool shut down mid-download: then they stay in ``.partial/`` with
the validator they came with, and the next pull of the same URL resumes them. A
cancelled pull always deletes its partial files.

A configured model whose pull succeeds serves the pulled file: its ``definition``
gets the new ``model_path`` at once. A model that is loaded at that moment keeps
serving the file it loaded (its ``active_definition``) and picks the new path up at
its next load. After a restart, a configured model whose store holds a complete pull
of its configured ``source`` points at that pull again.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import os
import re
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal, TypeVar

import httpx
import trio

from pool.actors._model import artifact_size_mib, size_mib
from pool.actors._model_store import (
    RESUME_FILE,
    ModelStore,
    default_store,
    safe_name,
    safe_relative,
)
from pool.config import resolve_model_path
from pool.errors import PoolError

if TYPE_CHECKING:
    from pool.actors._supervisor import Pool

log = logging.getLogger("pool.pulls")

T = TypeVar("T")

SourceKind = Literal["path", "url", "hf"]
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

_CHUNK = 256 * 1024
# Finished pulls remembered for status(); the oldest are forgotten past this.
_FINISHED_KEPT = 256
_CLEANUP_S = 30.0
_HUB = "https://huggingface.co"
_HEX64 = re.compile(r"[0-9a-f]{64}")
_HF_SOURCE = re.compile(
    r"(?P<repo>[A-Za-z0-9][\w.\-]{0,95}/[A-Za-z0-9][\w.\-]{0,95})"
    r"(?:@(?P<revision>[\w.\-/]{1,128}))?"
    r"(?::(?P<file>[\w.\-/]{1,512}))?",
    re.ASCII,
)


# -- sources ------------------------------------------------------------------------------
def classify_source(source: str) -> SourceKind:
    """What kind of source ``source`` is, after checking its shape.

    An HTTP route that accepts sources from clients should refuse ``"path"`` ones
    unless its operator allows clients to copy local files into the store.

    Raises:
        PoolError: ``invalid_request`` for anything that is not a local path, an
            http(s) URL naming a file, or a Hugging Face repo id.
    """
    if not isinstance(source, str) or not source or "\x00" in source:
        raise PoolError("invalid_request", f"source {source!r} is empty or holds a NUL byte")
    if source.lower().startswith(("http://", "https://")):
        url_file_name(source)
        return "url"
    if source.startswith(("pkg://", "/", "./", "../", "~")):
        return "path"
    match = _HF_SOURCE.fullmatch(source)
    if match is not None and ".." not in (match["repo"] + (match["revision"] or "")):
        if match["file"]:
            safe_relative(match["file"], "file in the repository")
        return "hf"
    raise PoolError(
        "invalid_request",
        f"source {source!r}: use an http(s) URL, a local path (/abs, ./rel, ~/..., pkg://)"
        " or a Hugging Face repo id (owner/name[@revision][:file])",
    )


def url_file_name(url: str) -> str:
    """The file name an http(s) URL names (its last path segment, decoded and checked).

    Raises:
        PoolError: ``invalid_request`` for a malformed URL or an unsafe name.
    """
    if "\\" in url or any(ord(c) <= 0x20 or ord(c) == 0x7F for c in url):
        raise PoolError("invalid_request", f"URL {url!r} holds a backslash or a control character")
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - raises for a malformed port
    except ValueError as exc:
        raise PoolError("invalid_request", f"URL {url!r} is malformed: {exc}") from None
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise PoolError("invalid_request", f"URL {url!r} must be http(s) with a host")
    name = urllib.parse.unquote(parts.path.rsplit("/", 1)[-1])
    if not name:
        raise PoolError("invalid_request", f"URL {url!r} does not end in a file name")
    return safe_name(name, "file name")


def _shown(url: str) -> str:
    # Query strings may carry signatures or tokens: keep them out of messages and logs.
    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))


@dataclass
class _File:
    """One file of a pull: where it comes from and what it must hash to."""

    name: str
    size: int | None = None
    url: str | None = None
    local: Path | None = None
    headers: dict[str, str] = field(default_factory=dict)
    expected: str | None = None
    expected_from: str | None = None
    sidecar: bool = False
    digest: str | None = None
    validator: str | None = None

    def expect(self, digest: str | None, origin: str) -> None:
        if self.expected is None and digest is not None:
            self.expected, self.expected_from = digest, origin


def _normal_sha256(value: str) -> str:
    digest = value.strip().lower().removeprefix("sha256:")
    if not _HEX64.fullmatch(digest):
        raise PoolError("invalid_request", f"sha256 {value!r} is not 64 hex digits")
    return digest


def _header_digest(headers: httpx.Headers, whole: bool) -> tuple[str, str] | None:
    """A SHA-256 of the whole file that the response headers state, and which header."""
    if (value := headers.get("x-checksum-sha256")) and _HEX64.fullmatch(value.strip().lower()):
        return value.strip().lower(), "X-Checksum-Sha256"
    names = ["repr-digest", "digest"] + (["content-digest"] if whole else [])
    for name in names:
        for item in headers.get(name, "").split(","):
            algorithm, _, encoded = item.strip().partition("=")
            if algorithm.strip().lower() != "sha-256" or not encoded:
                continue
            try:
                raw = base64.b64decode(encoded.strip().strip(":"), validate=True)
            except (binascii.Error, ValueError):
                continue
            if len(raw) == 32:
                return raw.hex(), name.title()
    for name in ("x-linked-etag", "etag"):
        value = headers.get(name, "")
        if value.startswith("W/"):
            continue  # a weak validator says nothing about the bytes
        candidate = value.strip('"').lower().removeprefix("sha256:")
        if _HEX64.fullmatch(candidate):
            return candidate, name.title()
    return None


def _validator(headers: httpx.Headers) -> str | None:
    """What ``If-Range`` should quote: a strong ETag, else Last-Modified."""
    etag: str | None = headers.get("etag")
    if etag and not etag.startswith("W/"):
        return etag
    modified: str | None = headers.get("last-modified")
    return modified


def _content_range(value: str | None) -> tuple[int, int | None] | None:
    """``(first byte, total or None)`` of a ``Content-Range: bytes a-b/n`` header."""
    match = re.fullmatch(r"\s*bytes\s+(\d+)-(\d+)/(\d+|\*)\s*", value or "")
    if match is None:
        return None
    return int(match[1]), None if match[3] == "*" else int(match[3])


def _range_total(value: str | None) -> int | None:
    """The total of a ``Content-Range: bytes */n`` header (a 416 answer)."""
    match = re.fullmatch(r"\s*bytes\s+\*/(\d+)\s*", value or "")
    return None if match is None else int(match[1])


class _Interrupted(Exception):
    """The connection kept breaking after bytes arrived: partial files stay for a resume."""


class _PartialWriter:
    """One partial file, appended to and hashed on worker threads (one call at a time)."""

    def __init__(self, store: ModelStore, model: str, name: str) -> None:
        self._store = store
        self._model = model
        self._name = name
        self._fd = -1
        self._hash = hashlib.sha256()
        self.size = 0

    def open(self, keep: bool) -> None:
        """Open the file, keeping (and hashing) earlier bytes if ``keep``."""
        self._fd, size = self._store.open_partial(self._model, self._name, keep=keep)
        offset = 0
        while offset < size:
            chunk = os.pread(self._fd, min(_CHUNK * 4, size - offset), offset)
            if not chunk:
                break
            self._hash.update(chunk)
            offset += len(chunk)
        self.size = offset

    def restart(self) -> None:
        os.ftruncate(self._fd, 0)
        os.lseek(self._fd, 0, os.SEEK_SET)
        self._hash = hashlib.sha256()
        self.size = 0

    def write(self, chunk: bytes) -> None:
        view = memoryview(chunk)
        while view:
            view = view[os.write(self._fd, view) :]
        self._hash.update(chunk)
        self.size += len(chunk)

    def copy_chunk(self, source: IO[bytes]) -> int:
        chunk = source.read(_CHUNK * 4)
        self.write(chunk)
        return len(chunk)

    def finish(self) -> str:
        """Flush to disk, close; the SHA-256 of everything written."""
        os.fsync(self._fd)
        self.close()
        return self._hash.hexdigest()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


# -- pulls and watchers ---------------------------------------------------------------------
class PullEvents:
    """One watcher's progress events, as an async iterator of status dicts.

    It holds at most ``service.pull_progress_buffer`` unread events; past that it skips
    new intermediate ones (counted in :attr:`skipped`). Iteration ends after the final
    event (``success``, ``error`` or ``cancelled``), which is never skipped.
    """

    def __init__(self, handle: PullHandle, buffer: int) -> None:
        self._handle = handle
        self._send, self._receive = trio.open_memory_channel[dict[str, Any]](buffer)
        self._ended = False
        self.skipped = 0

    def __aiter__(self) -> PullEvents:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if self._ended:
            raise StopAsyncIteration
        try:
            event = await self._receive.receive()
        except trio.EndOfChannel:
            # The pull ended while this watcher's buffer was full: hand it the final state.
            event = self._handle.status()
        except trio.ClosedResourceError:
            raise StopAsyncIteration from None  # read after its `watch` block ended
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
        self._scope = trio.CancelScope()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def status(self) -> dict[str, Any]:
        """The current state (fields that are not known yet are left out).

        Keys: ``model``, ``source``, ``status``, ``completed`` and ``total`` (bytes over
        all files), ``files_done``, ``files_total``, ``file`` (the current one),
        ``error``, ``path`` (the pulled file, or folder for several files),
        ``started_at`` and ``finished_at`` (Unix times).
        """
        return {key: value for key, value in self._state.items() if value is not None}

    async def wait(self) -> dict[str, Any]:
        """Wait for the pull to end; its final state."""
        await self._done.wait()
        return self.status()

    @asynccontextmanager
    async def watch(self) -> AsyncIterator[PullEvents]:
        """Follow this pull: the events start with its state at the time of subscribing."""
        events = PullEvents(self, self._buffer)
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

    def _update(self, **changes: Any) -> None:
        self._state.update(changes)
        event = self.status()
        for watcher in list(self._watchers):
            watcher._offer(event)

    def _finish(self, status: PullStatus, error: str | None = None, **changes: Any) -> None:
        self._update(status=status, error=error, finished_at=time.time(), **changes)
        for watcher in self._watchers:
            watcher._end()
        self._watchers.clear()
        self._done.set()


# -- the manager --------------------------------------------------------------------------------
class PullManager:
    """Owns every download into the model store; see the module docstring.

    Started by :func:`pool.open_pool` and reached as ``pool.pulls``.
    """

    def __init__(self, pool: Pool) -> None:
        service = pool.settings.service
        self._pool = pool
        root = Path(service.model_store).expanduser() if service.model_store else default_store()
        if not root.is_absolute():
            root = Path(pool.settings.base_dir or os.getcwd()) / root
        self.store = ModelStore(root)
        endpoint = service.hf_endpoint or os.environ.get("HF_ENDPOINT") or _HUB
        self._endpoint = endpoint.rstrip("/")
        self._buffer = service.pull_progress_buffer
        self._retries = service.pull_retries
        self._timeout = httpx.Timeout(
            service.pull_timeout_s, connect=min(10.0, service.pull_timeout_s)
        )
        self._slots = trio.Semaphore(service.pull_concurrency)
        self._threads = trio.CapacityLimiter(service.pull_concurrency)
        self._pulls: dict[str, PullHandle] = {}
        self._nursery: trio.Nursery | None = None

    async def run(
        self, *, task_status: trio.TaskStatus[PullManager] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """The actor: restores pulled model paths, then owns the download tasks."""
        for model, (path, size) in (await self._thread(self._completed_pulls)).items():
            self._point_model_at(model, path, size)
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
        expected = _normal_sha256(sha256) if sha256 is not None else None
        running = self._pulls.get(model)
        if running is not None and not running.done:
            if source is not None and source != running.source:
                raise PoolError(
                    "invalid_request",
                    f"a pull of {model!r} from {running.source!r} is running; cancel it first",
                )
            return running
        if source is None:
            actor = self._pool.models.get(model)
            if actor is None:
                raise PoolError(
                    "unknown_model", f"model {model!r} is not configured; name a source to pull"
                )
            source = actor.definition.source
            if not source:
                raise PoolError("invalid_request", f"model {model!r} has no `source` to pull from")
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

    @asynccontextmanager
    async def watch(self, model: str) -> AsyncIterator[PullEvents]:
        """Follow the current or last pull of ``model`` (see :class:`PullEvents`).

        Leaving the block unsubscribes; the pull itself goes on.

        Raises:
            PoolError: ``not_found`` (404) when no pull of ``model`` is known.
        """
        handle = self._pulls.get(model)
        if handle is None:
            raise PoolError("not_found", f"no pull of {model!r}")
        async with handle.watch() as events:
            yield events

    async def cancel(self, model: str) -> bool:
        """Stop the running pull of ``model`` and delete its partial files.

        Returns:
            True once it has stopped; False if no pull of ``model`` was running.
        """
        handle = self._pulls.get(model)
        if handle is None or handle.done:
            return False
        handle._scope.cancel()
        await handle._done.wait()
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
        actor = self._pool.models.get(model)
        configured = self._pool.settings.engine.models.get(model)
        if actor is not None and configured is not None:
            current = actor.definition.model_path
            if current and current != configured.model_path and self.store.contains(Path(current)):
                actor.definition = actor.definition.model_copy(
                    update={"model_path": configured.model_path}
                )
                actor.artifact_mib = await self._thread(
                    artifact_size_mib, configured.model_path, self._pool.settings.base_dir
                )
        return existed

    # -- one pull ---------------------------------------------------------------------------
    async def _run(self, handle: PullHandle, sha256: str | None) -> None:
        model = handle.model
        keep_partials = False
        outcome: tuple[PullStatus, str | None] = ("error", "the pull ended unexpectedly")
        pulled: Path | None = None
        try:
            with handle._scope:
                async with self._slots:
                    handle._update(status="pulling manifest")
                    files = await self._resolve(handle.source, sha256)
                    pulled, size = await self._download(handle, files)
                self._point_model_at(model, pulled, size)
                outcome = ("success", None)
            if handle._scope.cancelled_caught:
                outcome = ("cancelled", "the pull was cancelled")
        except _Interrupted as exc:
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
                _shown(handle.source) if "://" in handle.source else handle.source,
                status,
                f" error={error}" if error else "",
            )
            handle._finish(status, error, path=str(pulled) if status == "success" else None)

    async def _cleanup(self, model: str) -> None:
        try:
            await self._thread(self.store.remove_partials, model)
        except (OSError, PoolError) as exc:
            log.warning("pull model=%s could not remove partial files: %s", model, exc)

    async def _resolve(self, source: str, sha256: str | None) -> list[_File]:
        kind = classify_source(source)
        if kind == "url":
            files = [_File(url_file_name(source), url=source, sidecar=True)]
        elif kind == "path":
            files = await self._thread(self._local_files, source)
        else:
            files = await self._thread(self._hub_files, source)
        if sha256 is not None:
            if len(files) != 1:
                raise PoolError(
                    "invalid_request", f"sha256 fits a single file; {source!r} has {len(files)}"
                )
            files[0].expected, files[0].expected_from = sha256, "the caller"
        return files

    def _local_files(self, source: str) -> list[_File]:
        try:
            root = resolve_model_path(source, self._pool.settings.base_dir).resolve(strict=True)
        except (OSError, RuntimeError) as exc:
            raise PoolError("invalid_request", f"source {source!r} does not exist: {exc}") from None
        if self.store.contains(root):
            raise PoolError("invalid_request", f"source {source!r} is inside the model store")
        if root.is_file():
            file = _File(safe_name(root.name, "file name"), root.stat().st_size, local=root)
            sidecar = root.with_name(root.name + ".sha256")
            if sidecar.is_file():
                file.expect(_sidecar_digest(sidecar.read_text(errors="replace")), sidecar.name)
            return [file]
        if not root.is_dir():
            raise PoolError("invalid_request", f"source {source!r} is not a file or a folder")
        files = []
        for path in sorted(root.rglob("*")):
            relative = path.relative_to(root).as_posix()
            if path.is_file() and not _dotfile(relative):
                files.append(_File(safe_relative(relative), path.stat().st_size, local=path))
        if not files:
            raise PoolError("invalid_request", f"source {source!r} holds no files")
        return files

    def _hub_files(self, source: str) -> list[_File]:
        try:
            from huggingface_hub import HfApi, get_token, hf_hub_url
            from huggingface_hub.hf_api import RepoFile
        except ImportError:
            raise PoolError(
                "invalid_request",
                "Hugging Face sources need huggingface_hub: pip install 'llm-pool[pull]'",
            ) from None
        match = _HF_SOURCE.fullmatch(source)
        assert match is not None  # classify_source said "hf"
        repo, revision, wanted = match["repo"], match["revision"], match["file"]
        try:
            tree = HfApi(endpoint=self._endpoint).list_repo_tree(
                repo, recursive=True, revision=revision
            )
            entries = [e for e in tree if isinstance(e, RepoFile)]
            token = get_token()
            headers = {"Authorization": f"Bearer {token}"} if token else {}
        except Exception as exc:  # noqa: BLE001 - the hub client raises many kinds
            raise PoolError(
                "invalid_request", f"cannot list {repo} on {self._endpoint}: {exc}"
            ) from None
        if wanted:
            entries = [e for e in entries if e.path == wanted]
            if not entries:
                raise PoolError("invalid_request", f"{repo} has no file {wanted!r}")
        else:
            entries = [e for e in entries if not _dotfile(e.path)]
            ggufs = [e for e in entries if e.path.endswith(".gguf")]
            if len(ggufs) > 1:
                names = ", ".join(e.path for e in ggufs[:8])
                raise PoolError(
                    "invalid_request",
                    f"{repo} holds several GGUF files ({names}); pull one as {repo}:<file>",
                )
            entries = ggufs or entries
        if not entries:
            raise PoolError("invalid_request", f"{repo} holds no files to pull")
        return [
            _File(
                safe_relative(e.path, "file name from the hub"),
                e.size,
                url=hf_hub_url(repo, e.path, revision=revision, endpoint=self._endpoint),
                headers=headers,
                expected=e.lfs.sha256.lower() if e.lfs is not None else None,
                expected_from="the hub's LFS record" if e.lfs is not None else None,
            )
            for e in entries
        ]

    async def _download(self, handle: PullHandle, files: list[_File]) -> tuple[Path, int]:
        """Fetch and verify every file, then place them all; (pulled path, bytes)."""
        sizes = [f.size for f in files]
        total = sum(s for s in sizes if s is not None) if None not in sizes else None
        handle._update(files_total=len(files), total=total, status="downloading")
        await self._thread(self._prepare, handle.model, files)
        done = 0
        async with httpx.AsyncClient(
            timeout=self._timeout, follow_redirects=True, headers={"Accept-Encoding": "identity"}
        ) as client:
            for file in files:
                handle._update(file=file.name, status="downloading")
                if file.local is not None:
                    size = await self._copy(handle, file, done)
                else:
                    size = await self._fetch(client, handle, file, done)
                    if file.expected is None and file.sidecar and file.url is not None:
                        digest = await self._sidecar(client, file.url)
                        file.expect(digest, _shown(file.url) + ".sha256")
                done += size
                if file.expected is not None:
                    handle._update(status="verifying sha256 digest")
                    if file.digest != file.expected:
                        raise PoolError(
                            "invalid_request",
                            f"{file.name}: sha256 {file.digest} does not match {file.expected}"
                            f" (stated by {file.expected_from})",
                        )
                handle._update(files_done=handle._state["files_done"] + 1, completed=done)
        path = await self._thread(self._install, handle, files)
        return path, done

    def _prepare(self, model: str, files: list[_File]) -> None:
        """Create the store on first use; refuse a target outside it before downloading."""
        self.store.ensure()
        for file in files:
            self.store.file_path(model, file.name)

    async def _copy(self, handle: PullHandle, file: _File, done_before: int) -> int:
        assert file.local is not None
        writer = _PartialWriter(self.store, handle.model, file.name)
        local = file.local
        source = await self._thread(lambda: local.open("rb"))
        try:
            await self._thread(writer.open, False)
            while await self._thread(writer.copy_chunk, source):
                handle._update(completed=done_before + writer.size)
            file.digest = await self._thread(writer.finish)
            return writer.size
        finally:
            with trio.move_on_after(_CLEANUP_S, shield=True):
                await self._thread(source.close)
                await self._thread(writer.close)

    async def _fetch(
        self, client: httpx.AsyncClient, handle: PullHandle, file: _File, done_before: int
    ) -> int:
        """Download ``file`` into its partial file, resuming with ``Range``; its size."""
        assert file.url is not None
        note = (await self._thread(self._resume_notes, handle.model)).get(file.name)
        resumable = (
            isinstance(note, dict)
            and note.get("url") == file.url
            and isinstance(note.get("validator"), str)
        )
        file.validator = note["validator"] if resumable and isinstance(note, dict) else None
        writer = _PartialWriter(self.store, handle.model, file.name)
        try:
            await self._thread(writer.open, resumable)
            if writer.size:
                log.info(
                    "pull model=%s resuming %s at byte %d", handle.model, file.name, writer.size
                )
                handle._update(completed=done_before + writer.size)
            failures = 0
            while True:
                try:
                    if await self._attempt(client, handle, file, writer, done_before):
                        break
                except (httpx.TransportError, _ShortBody, _HttpStatus) as exc:
                    failures += 1
                    self._judge_failure(exc, file.url, writer.size, failures)
                    log.info(
                        "pull model=%s %s: %s; retrying (%d of %d)",
                        handle.model, file.name, exc, failures, self._retries,
                    )  # fmt: skip
                    await trio.sleep(min(5.0, 0.25 * 2 ** (failures - 1)))
                except httpx.HTTPError as exc:
                    raise PoolError("invalid_request", f"{_shown(file.url)}: {exc}") from None
            file.digest = await self._thread(writer.finish)
            return writer.size
        finally:
            with trio.move_on_after(_CLEANUP_S, shield=True):
                await self._thread(writer.close)

    async def _attempt(
        self,
        client: httpx.AsyncClient,
        handle: PullHandle,
        file: _File,
        writer: _PartialWriter,
        done_before: int,
    ) -> bool:
        """One GET of ``file``: True once its partial file is whole, False to ask anew."""
        assert file.url is not None
        have = writer.size
        headers = dict(file.headers)
        if have:
            headers["Range"] = f"bytes={have}-"
            if file.validator:
                headers["If-Range"] = file.validator
        async with client.stream("GET", file.url, headers=headers) as response:
            code = response.status_code
            if code == 416 and have:
                if _range_total(response.headers.get("content-range")) == have:
                    return True  # the partial file already holds all of it
                await self._thread(writer.restart)
                return False
            if code >= 400:
                raise _HttpStatus(code, response.reason_phrase)
            expected: int | None = None
            if code == 206:
                span = _content_range(response.headers.get("content-range"))
                if span is None or span[0] != have:
                    await self._thread(writer.restart)
                    return False
                expected = span[1]
            else:
                if have:
                    await self._thread(writer.restart)  # the range was ignored: start over
                length = response.headers.get("content-length", "")
                if length.isdigit() and response.headers.get("content-encoding") in (
                    None,
                    "identity",
                ):
                    expected = int(length)
            await self._learn(handle, file, response.headers, code, expected, done_before)
            pending = bytearray()
            try:
                async for chunk in response.aiter_bytes():
                    pending += chunk
                    if len(pending) >= _CHUNK:
                        await self._write(handle, writer, pending, done_before)
            except httpx.TransportError:
                # Keep every byte that arrived: the next attempt asks for the rest.
                await self._write(handle, writer, pending, done_before)
                raise
            await self._write(handle, writer, pending, done_before)
        if expected is not None and writer.size < expected:
            raise _ShortBody(writer.size, expected)
        return True

    async def _learn(
        self,
        handle: PullHandle,
        file: _File,
        headers: httpx.Headers,
        code: int,
        expected: int | None,
        done_before: int,
    ) -> None:
        """Take the validator, digest and size a response states about ``file``."""
        assert file.url is not None
        validator = _validator(headers)
        if validator != file.validator:
            file.validator = validator
            await self._thread(self._save_note, handle.model, file.name, file.url, validator)
        if stated := _header_digest(headers, whole=code == 200):
            file.expect(*stated)
        if expected is not None and file.size != expected:
            file.size = expected
            if handle._state["files_total"] == 1:
                handle._update(total=done_before + expected)

    async def _write(
        self, handle: PullHandle, writer: _PartialWriter, pending: bytearray, done_before: int
    ) -> None:
        if pending:
            await self._thread(writer.write, bytes(pending))
            pending.clear()
            handle._update(completed=done_before + writer.size)

    def _judge_failure(self, exc: Exception, url: str, have: int, failures: int) -> None:
        """Raise if ``exc`` ends the pull; return to retry it."""
        shown = _shown(url)
        if isinstance(exc, _HttpStatus) and not exc.transient:
            raise PoolError("invalid_request", f"{shown} answered {exc}")
        if isinstance(exc, httpx.UnsupportedProtocol):
            raise PoolError("invalid_request", f"{shown}: {exc}")
        if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout) and not have:
            host = urllib.parse.urlsplit(url).netloc
            raise PoolError("invalid_request", f"cannot connect to {host} for {shown}: {exc}")
        if failures <= self._retries:
            return
        if have:
            raise _Interrupted(
                f"download of {shown} kept breaking off ({failures} attempts, last: {exc});"
                f" {have} bytes are kept, pull again to resume"
            )
        raise PoolError("invalid_request", f"download of {shown} failed {failures} times: {exc}")

    async def _sidecar(self, client: httpx.AsyncClient, url: str) -> str | None:
        """The digest in ``<url>.sha256`` (first word of its text), if the source has one."""
        parts = urllib.parse.urlsplit(url)
        sidecar = urllib.parse.urlunsplit(parts._replace(path=parts.path + ".sha256"))
        try:
            response = await client.get(sidecar)
        except httpx.HTTPError:
            return None
        if response.status_code != 200 or len(response.content) > 4096:
            return None
        return _sidecar_digest(response.text)

    def _install(self, handle: PullHandle, files: list[_File]) -> Path:
        """Move verified partial files into the store; the manifest is written last."""
        model = handle.model
        self.store.manifest_path(model).unlink(missing_ok=True)
        for file in files:
            self.store.place(model, file.name)
        self.store.remove_stale(model, {f.name for f in files})
        path = (
            self.store.file_path(model, files[0].name)
            if len(files) == 1
            else self.store.model_dir(model)
        )
        manifest = {
            "model": model,
            "source": handle.source,
            "path": path.relative_to(self.store.root).as_posix(),
            "files": [{"name": f.name, "size": f.size, "sha256": f.digest} for f in files],
            "pulled_at": time.time(),
        }
        self.store.write_json(self.store.manifest_path(model), manifest)
        self.store.remove_partials(model)
        return path

    def _resume_notes(self, model: str) -> dict[str, Any]:
        path = self.store.partial_dir(model) / RESUME_FILE
        return self.store.read_json(path) or {}

    def _save_note(self, model: str, name: str, url: str, validator: str | None) -> None:
        path = self.store.partial_dir(model) / RESUME_FILE
        notes = self.store.read_json(path) or {}
        notes[name] = {"url": url, "validator": validator}
        self.store.write_json(path, notes)

    def _completed_pulls(self) -> dict[str, tuple[Path, int]]:
        """Configured models whose store holds a complete pull of their ``source``."""
        found: dict[str, tuple[Path, int]] = {}
        for name, actor in self._pool.models.items():
            source = actor.definition.source
            if not source:
                continue
            try:
                manifest = self.store.read_json(self.store.manifest_path(name))
                if manifest is None or manifest.get("source") != source:
                    continue
                path = self.store.root / str(manifest.get("path", ""))
                if self.store.contains(path) and path != self.store.root and path.exists():
                    files = manifest.get("files") or []
                    found[name] = (path, sum(int(f.get("size") or 0) for f in files))
            except (PoolError, OSError, ValueError, TypeError, AttributeError) as exc:
                log.warning("pull model=%s ignoring its manifest: %s", name, exc)
        return found

    def _point_model_at(self, model: str, path: Path, size: int) -> None:
        actor = self._pool.models.get(model)
        if actor is not None:
            actor.definition = actor.definition.model_copy(update={"model_path": str(path)})
            actor.artifact_mib = size_mib(size)
            log.info("model=%s model_path=%s (pulled)", model, path)

    def _refuse_in_use(self, model: str) -> None:
        actor = self._pool.models.get(model)
        if actor is not None and (
            actor.state in ("loaded", "loading", "unloading") or self._pool.load_pending(actor)
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


class _ShortBody(Exception):
    def __init__(self, received: int, expected: int) -> None:
        super().__init__(f"the response ended after {received} of {expected} bytes")


class _HttpStatus(Exception):
    def __init__(self, code: int, reason: str) -> None:
        super().__init__(f"HTTP {code} {reason}".rstrip())
        self.transient = code in (408, 429) or code >= 500


def _sidecar_digest(text: str) -> str | None:
    """The SHA-256 a ``.sha256`` file states: its first word (``sha256sum`` output)."""
    words = text.split()
    digest = words[0].lower() if words else ""
    return digest if _HEX64.fullmatch(digest) else None


def _dotfile(relative: str) -> bool:
    """Repository metadata (``.gitattributes``, ``.cache/``); ``..`` is no dotfile."""
    return any(p.startswith(".") and p not in (".", "..") for p in relative.split("/"))
