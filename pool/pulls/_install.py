"""Installing a pull into the model store, and the notes a download keeps on the way.

Only when every file of a pull is complete and verified (its writer fsynced it) are
the files moved from ``<store>/.partial/<model>/`` into ``<store>/<model>/`` with
``os.replace``; the manifest is written last, so a manifest means a complete pull.
What a crash leaves before that is invisible: partial files, and the resume notes
that say which URL and validator each of them came from.

Everything here does blocking file work: callers run it in a worker thread.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from pool.errors import PoolError
from pool.pulls._sources import PullFile
from pool.pulls._store import RESUME_FILE, ModelStore

log = logging.getLogger("pool.pulls")


def prepare(store: ModelStore, model: str, files: list[PullFile]) -> None:
    """Create the store on first use; refuse a target outside it before downloading."""
    store.ensure()
    for file in files:
        store.file_path(model, file.name)


def install(store: ModelStore, model: str, source: str, files: list[PullFile]) -> Path:
    """Move verified partial files into the store, the manifest last; the pulled path.

    The path is the file for a single-file pull, else the model's folder.
    """
    store.manifest_path(model).unlink(missing_ok=True)
    for file in files:
        store.place(model, file.name)
    store.remove_stale(model, {f.name for f in files})
    path = store.file_path(model, files[0].name) if len(files) == 1 else store.model_dir(model)
    manifest = {
        "model": model,
        "source": source,
        "path": path.relative_to(store.root).as_posix(),
        "files": [{"name": f.name, "size": f.size, "sha256": f.digest} for f in files],
        "pulled_at": time.time(),
    }
    store.write_json(store.manifest_path(model), manifest)
    store.remove_partials(model)
    return path


def completed_pull(
    store: ModelStore, model: str, source: str, sha256: str | None = None
) -> Path | None:
    """The path of a complete pull of ``model`` from ``source`` in the store, if any.

    A manifest that cannot be read, names another source or points outside the store
    or at nothing counts as no pull (the unreadable kinds are logged); with ``sha256``
    (normalized hex), so does one that is not of a single file with that digest.
    """
    try:
        manifest = store.read_json(store.manifest_path(model))
        if manifest is None or manifest.get("source") != source:
            return None
        digests = [f.get("sha256") for f in manifest.get("files", [])]
        if sha256 is not None and digests != [sha256]:
            return None
        path = store.root / str(manifest.get("path", ""))
        if store.contains(path) and path != store.root and path.exists():
            return path
    except (PoolError, OSError, ValueError, TypeError, AttributeError) as exc:
        log.warning("pull model=%s ignoring its manifest: %s", model, exc)
    return None


def resume_notes(store: ModelStore, model: str) -> dict[str, Any]:
    """Per partial file of ``model``: the ``url`` and ``validator`` it came with."""
    return store.read_json(store.partial_dir(model) / RESUME_FILE) or {}


def save_resume_note(
    store: ModelStore, model: str, name: str, url: str, validator: str | None
) -> None:
    """Remember where the partial file ``name`` came from, so a later pull may resume it."""
    path = store.partial_dir(model) / RESUME_FILE
    notes = store.read_json(path) or {}
    notes[name] = {"url": url, "validator": validator}
    store.write_json(path, notes)
