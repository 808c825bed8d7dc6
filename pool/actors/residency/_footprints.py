"""Measured VRAM footprints, kept across restarts.

A load measured on a GPU source records what it took, keyed by the model, by what the
load is (:func:`load_key`: its effective definition, less the fields that never change
memory, and the identity of its model files) and by the replica count. A footprint is
only reused for the same load: a model whose file, context, cache types, GPU layers, or
a stub's ``stub_vram_mib``, changed since is estimated anew, never charged its old size.
The store is one small JSON file in the state dir (``$LLM_POOL_STATE_DIR``, else the
cache dir), read at boot and rewritten atomically (a temporary file, then
``os.replace``) after each new measurement, so the next boot's estimates start from
what was measured.

Beside the models, it keeps what the pool process itself holds on each GPU once an
in-process runtime has used it (the CUDA context and the allocator's cache), apart
from every model's own footprint: only the first in-process load on a GPU pays it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from pool.config import CommonModelFields, state_dir

log = logging.getLogger("pool.vram")

FILE_NAME = "vram-footprints.json"
# 2: model entries keyed by load_key. Version 1 keyed them by the memory settings
# alone; its entries are dropped at boot (they cannot tell which load they measured),
# its CUDA contexts (keyed by GPU) kept.
_VERSION = 2
_CONTEXT_PREFIX = "cuda-context|"

# Fields of a model definition that never change what its load takes: how it is listed,
# scheduled, kept and evicted, and where it is pulled from (a changed file shows in the
# files' identity). The replica count is kept apart in the key: a footprint of another
# count of the same load is scaled.
_NOT_MEMORY = frozenset(
    {
        "description",
        "enabled",
        "replicas",
        "replica_max",
        "max_queue",
        "queue_timeout_s",
        "on_demand",
        "keep_alive",
        "keep_alive_pinned",
        "source",
        "pinned",
        "priority",
        "stay_warm_s",
        "vram_mb",
    }
)
_SAVE_TIMEOUT_S = 5.0


def default_path() -> Path:
    """``vram-footprints.json`` in the state dir (``$LLM_POOL_STATE_DIR``, else the cache dir)."""
    return state_dir() / FILE_NAME


def load_key(definition: CommonModelFields, files: str | None) -> str:
    """What a load of ``definition`` is, as far as its memory goes: a digest of the
    definition (its backend's fields and the load's overrides included) less the fields
    that never change memory, and of ``files``, the identity of its model files
    (:func:`~pool.backends.file_identity`; None without any)."""
    fields = definition.model_dump(mode="json", exclude=set(_NOT_MEMORY))
    text = json.dumps({"definition": fields, "files": files}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class FootprintStore:
    """Footprints by (model, :func:`load_key`, replicas); ``path=None`` keeps them in memory."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._entries: dict[str, dict[str, Any]] = {}
        self._limiter = trio.CapacityLimiter(1)

    @staticmethod
    def _key(model: str, load: str, replicas: int) -> str:
        return f"{model}|{load}|replicas={replicas}"

    def read(self) -> None:
        """Load the file (blocking; at boot, in a worker thread). A bad file is ignored."""
        if self.path is None:
            return
        try:
            data = json.loads(self.path.read_text())
            version = data.get("version")
            entries = data["footprints"] if version in (1, _VERSION) else {}
            if version == 1:
                entries = {k: v for k, v in entries.items() if k.startswith(_CONTEXT_PREFIX)}
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, AttributeError) as exc:
            log.warning("vram footprints %s unreadable, starting empty: %s", self.path, exc)
            return
        self._entries = {
            k: v
            for k, v in entries.items()
            if isinstance(v, dict) and ("mib" in v or "seconds" in v)
        }

    def lookup(self, model: str, load: str, replicas: int) -> int | None:
        """MiB that ``replicas`` replicas of this load took; scaled from another replica
        count of the same load when only that one was measured."""
        exact = self._entries.get(self._key(model, load, replicas))
        if exact is not None:
            return int(exact["mib"])
        prefix = f"{model}|{load}|"
        for key, entry in self._entries.items():
            if key.startswith(prefix) and int(entry.get("replicas", 0)) > 0:
                return -(-int(entry["mib"]) * replicas // int(entry["replicas"]))
        return None

    def record(self, model: str, load: str, replicas: int, mib: int) -> None:
        self._entries[self._key(model, load, replicas)] = {
            "model": model,
            "load": load,
            "replicas": replicas,
            "mib": mib,
            "measured_at": time.time(),
        }

    # -- how long a load took (the cost of bringing a model back, docs/vram.md) ------
    @staticmethod
    def _load_time_key(model: str, load: str) -> str:
        return f"load-time|{model}|{load}"

    def load_time(self, model: str, load: str) -> float | None:
        """Seconds the latest load of ``model`` that was this load took."""
        entry = self._entries.get(self._load_time_key(model, load))
        return None if entry is None else float(entry["seconds"])

    def record_load_time(self, model: str, load: str, seconds: float) -> None:
        self._entries[self._load_time_key(model, load)] = {
            "model": model,
            "load": load,
            "seconds": round(seconds, 3),
            "measured_at": time.time(),
        }

    # -- the CUDA context of the pool process, per GPU -------------------------------
    @staticmethod
    def _context_key(gpu: int) -> str:
        return f"{_CONTEXT_PREFIX}gpu={gpu}"

    def context_mib(self, gpu: int) -> int | None:
        """What the pool process keeps on ``gpu`` once an in-process runtime used it (the
        CUDA context and the allocator's cache), as last measured; None if never."""
        entry = self._entries.get(self._context_key(gpu))
        return None if entry is None else int(entry["mib"])

    def record_context(self, gpu: int, mib: int) -> None:
        self._entries[self._context_key(gpu)] = {"gpu": gpu, "mib": mib, "measured_at": time.time()}

    async def save(self) -> None:
        """Write the file atomically in a worker thread; a failure is logged, not raised."""
        if self.path is None:
            return
        snapshot = {"version": _VERSION, "footprints": dict(self._entries)}
        try:
            # Shielded but bounded: a measurement taken just before shutdown still lands.
            with trio.move_on_after(_SAVE_TIMEOUT_S, shield=True):
                await trio.to_thread.run_sync(
                    _write_atomically, self.path, snapshot, limiter=self._limiter
                )
        except OSError as exc:
            log.warning("vram footprints not saved to %s: %s", self.path, exc)


def _write_atomically(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=".footprints-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
