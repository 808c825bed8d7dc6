"""What a model's artifact is on disk: size, modification time and SHA-256.

Hashing a multi-GB file takes seconds, so it runs once per file version on a worker
thread (one at a time, so listing many models cannot start many hashes) and is kept
by path, mtime and size: a file replaced by a pull is hashed again, an unchanged one
never.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import trio

_CHUNK = 1 << 20


@dataclass(frozen=True, slots=True)
class FileFacts:
    """Size in bytes, mtime (seconds since the epoch) and SHA-256 hex (None for a folder)."""

    size: int
    mtime: float
    sha256: str | None


def _stat_key(path: Path) -> tuple[str, float, int]:
    stat = path.stat()
    return str(path), stat.st_mtime, stat.st_size


def _folder_size(path: Path) -> int:
    total = 0
    for root, _, names in os.walk(path):
        for name in names:
            try:
                total += (Path(root) / name).stat().st_size
            except OSError:
                continue
    return total


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class FileDigests:
    """A cache of :class:`FileFacts` keyed by (path, mtime, size)."""

    def __init__(self) -> None:
        self._known: dict[tuple[str, float, int], FileFacts] = {}
        self._limiter = trio.CapacityLimiter(1)

    async def facts(self, path: Path) -> FileFacts | None:
        """The facts of ``path`` (a file or a folder); None when it does not exist."""

        def read() -> FileFacts | None:
            try:
                key = _stat_key(path)
            except OSError:
                return None
            known = self._known.get(key)
            if known is not None:
                return known
            if path.is_dir():
                facts = FileFacts(_folder_size(path), key[1], None)
            else:
                facts = FileFacts(key[2], key[1], _sha256(path))
            # Older versions of the same file are dropped: they cannot come back.
            for old in [k for k in self._known if k[0] == key[0]]:
                del self._known[old]
            self._known[key] = facts
            return facts

        return await trio.to_thread.run_sync(read, limiter=self._limiter)

    async def mtime(self, path: Path) -> float | None:
        """The mtime of ``path`` (a config file), read off the event loop."""

        def read() -> float | None:
            try:
                return path.stat().st_mtime
            except OSError:
                return None

        return await trio.to_thread.run_sync(read)
