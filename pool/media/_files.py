"""``file://`` images: read only from the configured media folders, in a worker thread.

The path is resolved (``..`` and every symlink) before it is compared with the resolved
folders, so a link inside a folder that points outside it is refused like the target
itself. Whether a file outside the folders exists is never revealed.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import unquote, urlsplit

import trio

from pool.media._refusal import refused, shown, too_large

# O_NOFOLLOW: the resolved path has no links; one that appears after the check is not
# followed. O_NONBLOCK: a FIFO put in place does not hang the worker thread on open.
_OPEN_FLAGS = (
    os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
)


class MediaFiles:
    """Reads image files under ``folders``; none configured means no file is read.

    Args:
        folders: ``service.media_dirs``.
        max_bytes: ``service.media_max_bytes``.
        limiter: bounds the worker threads of file reads.
    """

    def __init__(
        self, folders: Sequence[str], *, max_bytes: int, limiter: trio.CapacityLimiter
    ) -> None:
        self._folders = tuple(folders)
        self._max_bytes = max_bytes
        self._limiter = limiter

    async def read(self, url: str) -> bytes:
        """The bytes of the file a ``file://`` URL names.

        Raises:
            PoolError: ``image_refused`` (``file_not_allowed``, ``file_unreadable``,
                ``invalid_url`` or ``too_large``).
        """
        if not self._folders:
            raise refused(
                "file_not_allowed", "file:// images are off (service.media_dirs lists no folder)"
            )
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise refused("invalid_url", f"{shown(url)} names a remote file host")
        path = unquote(parts.path)
        if not path.startswith("/") or "\x00" in path:
            raise refused("invalid_url", f"{shown(url)} does not name an absolute path")
        return await trio.to_thread.run_sync(self._read, url, path, limiter=self._limiter)

    def _read(self, url: str, path: str) -> bytes:
        try:
            folders = [Path(f).expanduser().resolve() for f in self._folders]
            resolved = Path(path).resolve()
        except (OSError, RuntimeError):  # RuntimeError: a symlink loop
            raise refused("file_not_allowed", f"{shown(url)} cannot be resolved") from None
        if not any(resolved.is_relative_to(folder) for folder in folders):
            raise refused("file_not_allowed", f"{shown(url)} is not under service.media_dirs")
        try:
            fd = os.open(resolved, _OPEN_FLAGS)
        except OSError as exc:
            raise refused("file_unreadable", f"{shown(url)}: {exc.strerror}") from None
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            raise refused("file_not_allowed", f"{shown(url)} is not a regular file")
        with os.fdopen(fd, "rb") as file:
            if info.st_size > self._max_bytes:
                raise too_large(url, self._max_bytes)
            data = file.read(self._max_bytes + 1)
        if len(data) > self._max_bytes:
            raise too_large(url, self._max_bytes)
        return data
