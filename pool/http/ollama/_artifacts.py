"""What ``/api/tags``, ``/api/ps`` and ``/api/show`` say about a model's files.

The facts come from the disk: the model file's size, mtime and SHA-256, hashed once per
file version on a worker thread (:class:`FileDigests`), so a listing stays cheap after
the first. A model without a file (stub, remote) shows the settings file's mtime and the
digest of its definition.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import trio

from pool.actors import ModelSnapshot
from pool.config import Settings, resolve_model_path
from pool.http.admin._render import definition_body
from pool.pulls import FileDigests


@dataclass(frozen=True, slots=True)
class Artifact:
    """A model's files as Ollama describes them."""

    mtime: float | None  # None: nothing on disk to date it by
    size: int
    digest: str


class Artifacts:
    """Reads each model's :class:`Artifact`; keeps the digests of the files it hashed."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._digests = FileDigests()

    async def of(self, snapshot: ModelSnapshot) -> Artifact:
        """The model file's mtime, size and SHA-256; the settings file's mtime without one."""
        # An adapter's artifact is its own file, not its base's.
        value = (
            snapshot.adapter.path
            if snapshot.adapter is not None
            else snapshot.active_definition.model_path
        )
        base_dir = self._settings.base_dir
        facts = None
        if value:

            def resolve() -> Path | None:
                try:
                    return resolve_model_path(value, base_dir)
                except (FileNotFoundError, OSError):
                    return None

            path = await trio.to_thread.run_sync(resolve)
            facts = await self._digests.facts(path) if path is not None else None
        if facts is not None:
            return Artifact(facts.mtime, facts.size, facts.sha256 or definition_digest(snapshot))
        sources = self._settings.source_files
        return Artifact(
            await self._digests.mtime(Path(sources[0])) if sources else None,
            (snapshot.artifact_mib or 0) * 1024 * 1024,
            definition_digest(snapshot),
        )


def definition_digest(snapshot: ModelSnapshot) -> str:
    """Not a file digest: the identity of the configured definition."""
    definition = definition_body(snapshot)
    return hashlib.sha256(json.dumps(definition, sort_keys=True).encode()).hexdigest()
