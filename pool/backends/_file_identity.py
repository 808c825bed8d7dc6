"""A cheap identity of a model's files: what changes when the files are replaced.

A model file is often several GB: hashing it whole at every load would take seconds of
disk reads. Its size, modification time and first MiB change whenever a download, a
pull or an edit replaces it, so they stand for its content here. A folder (safetensors
weights, a Hugging Face snapshot) is known by the relative path, size and modification
time of each file in it; its contents are not read.

Both are blocking file I/O: callers run them in a worker thread.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Protocol

_MIB = 1024 * 1024


class _Digest(Protocol):
    def update(self, data: bytes, /) -> None: ...


def feed_file_identity(digest: _Digest, path: Path) -> None:
    """Feed the identity of the file at ``path`` into ``digest`` (a hashlib object)."""
    stat = path.stat()
    digest.update(f"{stat.st_size}:{stat.st_mtime_ns}".encode())
    with path.open("rb") as file:
        digest.update(file.read(_MIB))


def file_identity(path: Path) -> str:
    """A hex digest of the model file or folder at ``path`` (raises OSError)."""
    digest = hashlib.sha256()
    if path.is_dir():
        for member in sorted(p for p in path.rglob("*") if p.is_file()):
            stat = member.stat()
            relative = member.relative_to(path).as_posix()
            digest.update(f"{relative}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
    else:
        feed_file_identity(digest, path)
    return digest.hexdigest()[:32]
