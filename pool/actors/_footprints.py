"""Measured VRAM footprints, kept across restarts.

A load measured on a GPU source records what it took, keyed by the model and the
settings that change memory (context, cache types, parallel slots, GPU layers, batch:
:class:`~pool.backends.MemoryProfile`) and the replica count. The store is one small
JSON file in the state dir (``$LLM_POOL_STATE_DIR``, else the cache dir), read at
boot and rewritten atomically (a temporary file, then ``os.replace``) after each new
measurement, so the next boot's estimates start from what was measured.

Beside the models, it keeps what the pool process itself holds on each GPU once an
in-process runtime has used it (the CUDA context and the allocator's cache), apart
from every model's own footprint: only the first in-process load on a GPU pays it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from pool.config import state_dir

log = logging.getLogger("pool.vram")

FILE_NAME = "vram-footprints.json"
_VERSION = 1
_SAVE_TIMEOUT_S = 5.0


def default_path() -> Path:
    """``vram-footprints.json`` in the state dir (``$LLM_POOL_STATE_DIR``, else the cache dir)."""
    return state_dir() / FILE_NAME


class FootprintStore:
    """Footprints by (model, memory settings, replicas); ``path=None`` keeps them in memory."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._entries: dict[str, dict[str, Any]] = {}
        self._limiter = trio.CapacityLimiter(1)

    @staticmethod
    def _key(model: str, profile: str, replicas: int) -> str:
        return f"{model}|{profile}|replicas={replicas}"

    def read(self) -> None:
        """Load the file (blocking; at boot, in a worker thread). A bad file is ignored."""
        if self.path is None:
            return
        try:
            data = json.loads(self.path.read_text())
            entries = data["footprints"] if data.get("version") == _VERSION else {}
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

    def lookup(self, model: str, profile: str, replicas: int) -> int | None:
        """MiB that ``replicas`` replicas took; scaled from another replica count of the
        same settings when only that one was measured."""
        exact = self._entries.get(self._key(model, profile, replicas))
        if exact is not None:
            return int(exact["mib"])
        prefix = f"{model}|{profile}|"
        for key, entry in self._entries.items():
            if key.startswith(prefix) and int(entry.get("replicas", 0)) > 0:
                return -(-int(entry["mib"]) * replicas // int(entry["replicas"]))
        return None

    def record(self, model: str, profile: str, replicas: int, mib: int) -> None:
        self._entries[self._key(model, profile, replicas)] = {
            "model": model,
            "profile": profile,
            "replicas": replicas,
            "mib": mib,
            "measured_at": time.time(),
        }

    # -- how long a load took (the cost of bringing a model back, docs/vram.md) ------
    @staticmethod
    def _load_time_key(model: str, profile: str) -> str:
        return f"load-time|{model}|{profile}"

    def load_time(self, model: str, profile: str) -> float | None:
        """Seconds the latest load of ``model`` with these memory settings took."""
        entry = self._entries.get(self._load_time_key(model, profile))
        return None if entry is None else float(entry["seconds"])

    def record_load_time(self, model: str, profile: str, seconds: float) -> None:
        self._entries[self._load_time_key(model, profile)] = {
            "model": model,
            "profile": profile,
            "seconds": round(seconds, 3),
            "measured_at": time.time(),
        }

    # -- the CUDA context of the pool process, per GPU -------------------------------
    @staticmethod
    def _context_key(gpu: int) -> str:
        return f"cuda-context|gpu={gpu}"

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
