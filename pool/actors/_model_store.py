"""The model store: the one folder pulls write into, and the path rules that keep them there.

Every name that becomes a path (a model name, a file name from a source) is checked
against a strict pattern, joined under the store, resolved, and checked to still be
inside it; symlinks inside the store are refused. ``..``, absolute paths, encoded
separators or NUL bytes cannot pass.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from pool.errors import PoolError

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:\-]{0,127}$")
PARTIAL_DIR = ".partial"


def default_store() -> Path:
    cache = os.environ.get("LLM_POOL_CACHE_DIR") or os.path.join(Path.home(), ".cache", "llm-pool")
    return Path(cache) / "model-store"


def safe_name(name: str, what: str = "model name") -> str:
    """``name`` if it may become one path component; 400 otherwise."""
    if not _NAME.match(name) or ".." in name:
        raise PoolError(
            "invalid_request",
            f"{what} {name!r} must be 1-128 letters, digits, '.', '_', ':' or '-',"
            " start with a letter or digit and contain no '..'",
        )
    return name


class ModelStore:
    def __init__(self, root: Path) -> None:
        self.root = root

    def _inside(self, *parts: str) -> Path:
        path = self.root.joinpath(*parts)
        resolved = path.resolve()
        if not resolved.is_relative_to(self.root.resolve()):
            raise PoolError("invalid_request", f"{path} is outside the model store")
        for parent in [path, *path.parents]:
            if parent == self.root:
                break
            if parent.is_symlink():
                raise PoolError("invalid_request", f"{parent} is a symlink; the store refuses them")
        return path

    def model_dir(self, model: str) -> Path:
        return self._inside(safe_name(model))

    def file_path(self, model: str, filename: str) -> Path:
        return self._inside(safe_name(model), safe_name(filename, "file name"))

    def partial_path(self, model: str, filename: str) -> Path:
        return self._inside(PARTIAL_DIR, safe_name(model), safe_name(filename, "file name"))

    def ensure(self) -> None:
        (self.root / PARTIAL_DIR).mkdir(parents=True, exist_ok=True)
