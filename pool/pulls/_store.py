"""The model store: the one folder pulls write into, and the rules that keep them there.

Layout under the store's root::

    <model>/<file>                     pulled files; a model's ``model_path`` points here
    .partial/<model>/<file>            downloads in progress, or kept to resume later
    .partial/<model>/.resume.json      the URL and validator each partial file came from
    .manifests/<model>.json            written last: the pull of <model> is complete

Every name that becomes a path (a model name, each component of a file name a source
reports) must match a strict pattern: letters, digits, ``.``, ``_``, ``:`` and ``-``,
starting with a letter or digit, no ``..``. So ``..``, absolute paths, separators,
backslashes, NUL bytes and anything a URL decoded into them cannot pass, and no
source-given name can collide with the store's own dot-folders. Each path is then
resolved and checked to still be inside the store, and no component of it below the
root may be a symlink; files are opened with ``O_NOFOLLOW`` as a last line.

The functions here do blocking file work: callers run them in a worker thread.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from pool.config import cache_dir
from pool.errors import PoolError

_COMPONENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:\-]{0,127}$")
_MAX_DEPTH = 8
PARTIAL_DIR = ".partial"
MANIFEST_DIR = ".manifests"
RESUME_FILE = ".resume.json"


def default_store() -> Path:
    """``$LLM_POOL_CACHE_DIR/model-store``, else ``~/.cache/llm-pool/model-store``."""
    return cache_dir() / "model-store"


def safe_name(name: str, what: str = "model name") -> str:
    """``name`` if it may be one path component inside the store.

    Raises:
        PoolError: ``invalid_request`` (400) for anything else.
    """
    if not isinstance(name, str) or not _COMPONENT.match(name) or ".." in name:
        raise PoolError(
            "invalid_request",
            f"{what} {name!r} must be 1-128 letters, digits, '.', '_', ':' or '-',"
            " start with a letter or digit and contain no '..'",
        )
    return name


def safe_relative(name: str, what: str = "file name") -> str:
    """``name`` if it is a relative path of safe components joined by ``/``.

    Raises:
        PoolError: ``invalid_request`` (400) for an empty, absolute or deep path, or
            any component that :func:`safe_name` refuses.
    """
    parts = name.split("/")
    if len(parts) > _MAX_DEPTH:
        raise PoolError("invalid_request", f"{what} {name!r} is nested too deeply")
    for part in parts:
        safe_name(part, what)
    return name


class ModelStore:
    """Paths inside one store root, each checked; see the module docstring."""

    def __init__(self, root: Path) -> None:
        self.root = root

    # -- paths ------------------------------------------------------------------------
    def model_dir(self, model: str) -> Path:
        return self._inside(safe_name(model))

    def file_path(self, model: str, name: str) -> Path:
        return self._inside(safe_name(model), *safe_relative(name).split("/"))

    def partial_dir(self, model: str) -> Path:
        return self._inside(PARTIAL_DIR, safe_name(model))

    def partial_path(self, model: str, name: str) -> Path:
        return self._inside(PARTIAL_DIR, safe_name(model), *safe_relative(name).split("/"))

    def manifest_path(self, model: str) -> Path:
        return self._inside(MANIFEST_DIR, safe_name(model) + ".json")

    def contains(self, path: Path) -> bool:
        """Whether ``path`` (resolved) lies inside the store."""
        return path.resolve().is_relative_to(self.root.resolve())

    def _inside(self, *parts: str) -> Path:
        path = self.root.joinpath(*parts)
        if not self.contains(path):
            raise PoolError("invalid_request", f"{path} is outside the model store")
        # Walk down from the root: a symlink anywhere below it could redirect a write.
        current = self.root
        for part in parts:
            current = current / part
            if current.is_symlink():
                raise PoolError(
                    "invalid_request", f"{current} is a symlink; the model store refuses them"
                )
        return path

    # -- writing ------------------------------------------------------------------------
    def ensure(self) -> None:
        """Create the store's folders (on first use, not at pool start)."""
        for sub in (PARTIAL_DIR, MANIFEST_DIR):
            path = self.root / sub
            path.mkdir(parents=True, exist_ok=True)
            if path.is_symlink():
                raise PoolError("invalid_request", f"{path} is a symlink; the store refuses them")

    def open_partial(self, model: str, name: str, *, keep: bool) -> tuple[int, int]:
        """Open the partial file of ``name`` for writing: ``(fd, bytes kept)``.

        ``keep`` keeps what an earlier attempt wrote (to resume); otherwise the file
        starts empty. The file is opened without following a symlink.
        """
        path = self.partial_path(model, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.partial_path(model, name)  # the folders just made are still no symlinks
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(path, flags, 0o644)
        try:
            if not keep:
                os.ftruncate(fd, 0)
            size = os.fstat(fd).st_size
            os.lseek(fd, size, os.SEEK_SET)
        except BaseException:
            os.close(fd)
            raise
        return fd, size

    def place(self, model: str, name: str) -> Path:
        """Move a finished partial file (its writer fsynced it) into the visible store."""
        partial = self.partial_path(model, name)
        target = self.file_path(model, name)
        target.parent.mkdir(parents=True, exist_ok=True)
        self.file_path(model, name)
        os.replace(partial, target)
        _fsync_dir(target.parent)
        return target

    def remove_stale(self, model: str, keep: set[str]) -> None:
        """Delete files of ``model`` that are not in ``keep`` (left by an earlier pull)."""
        directory = self.model_dir(model)
        if not directory.is_dir():
            return
        for path in sorted(directory.rglob("*"), reverse=True):
            relative = path.relative_to(directory).as_posix()
            if path.is_symlink() or (path.is_file() and relative not in keep):
                path.unlink()
            elif path.is_dir() and not any(path.iterdir()):
                path.rmdir()

    def write_json(self, path: Path, data: dict[str, Any]) -> None:
        """Write ``data`` to ``path`` atomically (temporary file, fsync, replace)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(path.name + ".tmp")
        fd = os.open(
            temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644
        )
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(data, handle, indent=1, sort_keys=True)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
        _fsync_dir(path.parent)

    def read_json(self, path: Path) -> dict[str, Any] | None:
        """The JSON object at ``path``; None if it is missing, unreadable or not an object."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            with os.fdopen(fd, encoding="utf-8") as handle:
                data = json.load(handle)
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def pulled_models(self) -> list[str]:
        """The names with a manifest: the models whose pull completed, sorted."""
        manifests = self.root / MANIFEST_DIR
        if not manifests.is_dir():
            return []
        return sorted(p.stem for p in manifests.glob("*.json") if _COMPONENT.match(p.stem))

    # -- removing -----------------------------------------------------------------------
    def remove_partials(self, model: str) -> None:
        """Delete every partial file of ``model`` (and its resume notes)."""
        _remove_tree(self.partial_dir(model))

    def remove_model(self, model: str) -> bool:
        """Delete ``model``'s pulled files, partials and manifest; whether any existed."""
        directory = self.model_dir(model)
        manifest = self.manifest_path(model)
        existed = directory.exists() or manifest.exists()
        manifest.unlink(missing_ok=True)
        _remove_tree(directory)
        self.remove_partials(model)
        return existed


def _remove_tree(path: Path) -> None:
    # rmtree refuses a symlink at the top and unlinks (never follows) those inside.
    if path.is_symlink():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def _fsync_dir(path: Path) -> None:
    # Make the rename itself durable; some filesystems cannot fsync a folder.
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
