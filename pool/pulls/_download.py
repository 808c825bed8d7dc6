"""Downloading a pull's files into the store's partial folder, resumably, and checking them.

Every file is written into ``<store>/.partial/<model>/`` and hashed as it is written.
Its SHA-256 is checked against, in this order: the caller's ``sha256``; the hub's LFS
digest; the response's ``X-Checksum-Sha256``, ``Repr-Digest``, ``Digest`` (or, on a
whole-file response, ``Content-Digest``) header, or an ETag/``X-Linked-Etag`` that is a
bare 64-hex SHA-256; a ``<url>.sha256`` file next to the source. A response shorter
than its ``Content-Length`` is a cut connection, never a success: the next attempt
asks for the rest with ``Range`` (and ``If-Range``, so a file that changed meanwhile
starts over).

Failures are judged here, at the HTTP boundary: a refused connection before any byte,
an unsupported scheme or a non-transient HTTP status ends the pull at once
(``PoolError``); a cut connection, a timeout or a transient status is retried up to
``service.pull_retries`` times with backoff; when the retries run out after bytes had
arrived, :class:`DownloadInterrupted` says the partial files are worth keeping.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import os
import re
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import IO, Any, Protocol, TypeVar

import httpx
import trio

from pool.errors import PoolError
from pool.pulls._install import prepare, resume_notes, save_resume_note
from pool.pulls._sources import SHA256_HEX, PullFile, shown_url, sidecar_digest
from pool.pulls._store import ModelStore

log = logging.getLogger("pool.pulls")

T = TypeVar("T")

_CHUNK = 256 * 1024
_CLEANUP_S = 30.0


class Progress(Protocol):
    """Where a download reports how far it got (a :class:`PullHandle` is one)."""

    def downloading(self, files: int, total: int | None) -> None:
        """The download of ``files`` files (``total`` bytes, if known) begins."""

    def file_started(self, name: str) -> None:
        """The file ``name`` is next."""

    def progressed(self, completed: int) -> None:
        """``completed`` bytes over all files are written."""

    def file_size_known(self, through: int) -> None:
        """A response stated the current file's size: all files so far hold ``through``."""

    def verifying(self) -> None:
        """The current file's digest is being checked."""

    def file_finished(self, completed: int) -> None:
        """The current file is whole and verified; ``completed`` bytes over all files."""


class DownloadInterrupted(Exception):
    """The connection kept breaking after bytes arrived: partial files stay for a resume."""


class _ShortBody(Exception):
    def __init__(self, received: int, expected: int) -> None:
        super().__init__(f"the response ended after {received} of {expected} bytes")


class _HttpStatus(Exception):
    def __init__(self, code: int, reason: str) -> None:
        super().__init__(f"HTTP {code} {reason}".rstrip())
        self.transient = code in (408, 429) or code >= 500


class Downloader:
    """Fetches and verifies the files of pulls into the store's partial folder.

    Args:
        store: the model store.
        threads: the limiter of the worker threads that write and hash.
        retries: attempts after a cut connection before a file fails.
        timeout: connect and read timeout per request, in seconds.
    """

    def __init__(
        self, store: ModelStore, *, threads: trio.CapacityLimiter, retries: int, timeout: float
    ) -> None:
        self._store = store
        self._threads = threads
        self._retries = retries
        self._timeout = httpx.Timeout(timeout, connect=min(10.0, timeout))

    async def fetch(self, model: str, files: list[PullFile], progress: Progress) -> int:
        """Fetch every file of ``model``'s pull and check its digest; the bytes fetched.

        The files are left whole in the partial folder, each with its ``digest`` set,
        ready to install.

        Raises:
            PoolError: ``invalid_request`` for a source that fails for good or a file
                whose digest does not match.
            DownloadInterrupted: retries ran out after bytes had arrived.
        """
        sizes = [f.size for f in files]
        total = sum(s for s in sizes if s is not None) if None not in sizes else None
        progress.downloading(len(files), total)
        await self._thread(prepare, self._store, model, files)
        done = 0
        async with httpx.AsyncClient(
            timeout=self._timeout, follow_redirects=True, headers={"Accept-Encoding": "identity"}
        ) as client:
            for file in files:
                progress.file_started(file.name)
                task = _FileDownload(
                    self._store, self._thread, client, model, file, progress, done, self._retries
                )
                if file.local is not None:
                    size = await task.copy()
                else:
                    size = await task.fetch()
                    if file.expected is None and file.sidecar and file.url is not None:
                        digest = await self._sidecar(client, file.url)
                        file.expect(digest, shown_url(file.url) + ".sha256")
                done += size
                if file.expected is not None:
                    progress.verifying()
                    if file.digest != file.expected:
                        raise PoolError(
                            "invalid_request",
                            f"{file.name}: sha256 {file.digest} does not match {file.expected}"
                            f" (stated by {file.expected_from})",
                        )
                progress.file_finished(done)
        return done

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
        return sidecar_digest(response.text)

    async def _thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await trio.to_thread.run_sync(fn, *args, limiter=self._threads)


class _FileDownload:
    """One file of one pull, from its source into its partial file."""

    def __init__(
        self,
        store: ModelStore,
        thread: Callable[..., Awaitable[Any]],
        client: httpx.AsyncClient,
        model: str,
        file: PullFile,
        progress: Progress,
        done_before: int,
        retries: int,
    ) -> None:
        self._store = store
        self._thread = thread
        self._client = client
        self._model = model
        self._file = file
        self._progress = progress
        self._done_before = done_before
        self._retries = retries
        self._writer = _PartialWriter(store, model, file.name)

    async def copy(self) -> int:
        """Copy a local file; its size."""
        file, writer = self._file, self._writer
        assert file.local is not None
        local = file.local
        source = await self._thread(lambda: local.open("rb"))
        try:
            await self._thread(writer.open, False)
            while await self._thread(writer.copy_chunk, source):
                self._progress.progressed(self._done_before + writer.size)
            file.digest = await self._thread(writer.finish)
            return writer.size
        finally:
            with trio.move_on_after(_CLEANUP_S, shield=True):
                await self._thread(source.close)
                await self._thread(writer.close)

    async def fetch(self) -> int:
        """Download the file, resuming with ``Range``; its size."""
        file, writer = self._file, self._writer
        assert file.url is not None
        note = (await self._thread(resume_notes, self._store, self._model)).get(file.name)
        resumable = (
            isinstance(note, dict)
            and note.get("url") == file.url
            and isinstance(note.get("validator"), str)
        )
        file.validator = note["validator"] if resumable and isinstance(note, dict) else None
        try:
            await self._thread(writer.open, resumable)
            if writer.size:
                log.info(
                    "pull model=%s resuming %s at byte %d", self._model, file.name, writer.size
                )
                self._progress.progressed(self._done_before + writer.size)
            failures = 0
            while True:
                try:
                    if await self._attempt():
                        break
                except (httpx.TransportError, _ShortBody, _HttpStatus) as exc:
                    failures += 1
                    _judge_failure(exc, file.url, writer.size, failures, self._retries)
                    log.info(
                        "pull model=%s %s: %s; retrying (%d of %d)",
                        self._model, file.name, exc, failures, self._retries,
                    )  # fmt: skip
                    await trio.sleep(min(5.0, 0.25 * 2 ** (failures - 1)))
                except httpx.HTTPError as exc:
                    raise PoolError("invalid_request", f"{shown_url(file.url)}: {exc}") from None
            file.digest = await self._thread(writer.finish)
            return writer.size
        finally:
            with trio.move_on_after(_CLEANUP_S, shield=True):
                await self._thread(writer.close)

    async def _attempt(self) -> bool:
        """One GET of the file: True once its partial file is whole, False to ask anew."""
        file, writer = self._file, self._writer
        assert file.url is not None
        have = writer.size
        headers = dict(file.headers)
        if have:
            headers["Range"] = f"bytes={have}-"
            if file.validator:
                headers["If-Range"] = file.validator
        async with self._client.stream("GET", file.url, headers=headers) as response:
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
            await self._learn(response.headers, code, expected)
            pending = bytearray()
            try:
                async for chunk in response.aiter_bytes():
                    pending += chunk
                    if len(pending) >= _CHUNK:
                        await self._write(pending)
            except httpx.TransportError:
                # Keep every byte that arrived: the next attempt asks for the rest.
                await self._write(pending)
                raise
            await self._write(pending)
        if expected is not None and writer.size < expected:
            raise _ShortBody(writer.size, expected)
        return True

    async def _learn(self, headers: httpx.Headers, code: int, expected: int | None) -> None:
        """Take the validator, digest and size a response states about the file."""
        file = self._file
        assert file.url is not None
        validator = _validator(headers)
        if validator != file.validator:
            file.validator = validator
            await self._thread(
                save_resume_note, self._store, self._model, file.name, file.url, validator
            )
        if stated := _header_digest(headers, whole=code == 200):
            file.expect(*stated)
        if expected is not None and file.size != expected:
            file.size = expected
            self._progress.file_size_known(self._done_before + expected)

    async def _write(self, pending: bytearray) -> None:
        if pending:
            await self._thread(self._writer.write, bytes(pending))
            pending.clear()
            self._progress.progressed(self._done_before + self._writer.size)


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


def _judge_failure(exc: Exception, url: str, have: int, failures: int, retries: int) -> None:
    """Raise if ``exc`` ends the pull; return to retry it."""
    shown = shown_url(url)
    if isinstance(exc, _HttpStatus) and not exc.transient:
        raise PoolError("invalid_request", f"{shown} answered {exc}")
    if isinstance(exc, httpx.UnsupportedProtocol):
        raise PoolError("invalid_request", f"{shown}: {exc}")
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout) and not have:
        host = urllib.parse.urlsplit(url).netloc
        raise PoolError("invalid_request", f"cannot connect to {host} for {shown}: {exc}")
    if failures <= retries:
        return
    if have:
        raise DownloadInterrupted(
            f"download of {shown} kept breaking off ({failures} attempts, last: {exc});"
            f" {have} bytes are kept, pull again to resume"
        )
    raise PoolError("invalid_request", f"download of {shown} failed {failures} times: {exc}")


def _header_digest(headers: httpx.Headers, whole: bool) -> tuple[str, str] | None:
    """A SHA-256 of the whole file that the response headers state, and which header."""
    if (value := headers.get("x-checksum-sha256")) and SHA256_HEX.fullmatch(value.strip().lower()):
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
        if SHA256_HEX.fullmatch(candidate):
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
