"""Saved prompt states on disk, so a conversation's prefix outlives an unload or a swap.

When a ``llama_cpp`` replica closes, its saved states (pool/backends/_prefix_cache.py)
and its live one are written here; after the model loads again they come back lazily:
a request whose prompt shares more with a state on disk than with any in memory gets it
read back (and the file removed: the state lives in memory again).

A state only fits the model and context that made it. Each file names its **model key**:
a digest of the model file's identity (size, modification time and first MiB, so a
multi-GB file is not hashed whole at every load) and of the settings that shape the KV
cells (context size, KV cache types, flash attention). A state of another key is never
read. Each file carries a SHA-256 of its contents: a corrupted or truncated file is
removed with a log line, never loaded. The directory is kept within a bound in bytes,
least recently written first out, across models.

Replicas of a model (and pools sharing a state dir) write into one folder at once. Each
file is written under a temporary name of its own, then renamed: a reader never sees
half a file, and a writer's clean-up removes only temporary files no writer has touched
for an hour (left by a crash), never one that another writer is still filling.

File layout: ``MAGIC``, a 4-byte header length, a JSON header (model key, scope,
token count, state size, digest), the tokens as little-endian int32, the state bytes.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import struct
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pool.backends._file_identity import feed_file_identity
from pool.backends._prefix_cache import SavedState, ScopeKey, common_prefix

log = logging.getLogger("pool.backends")

MAGIC = b"llm-pool prompt state 1\n"
SUFFIX = ".pstate"
PARTIAL = ".partial"
_HEAD = struct.Struct("<I")
# A temporary file not written to for this long is a leftover of a writer that died
# mid-write: a live writer writes its file in one go, within seconds.
STALE_PARTIAL_S = 3600.0


def model_key(path: Path, **settings: Any) -> str:
    """The key of states made by the model file at ``path`` under ``settings``."""
    digest = hashlib.sha256()
    feed_file_identity(digest, path)
    digest.update(json.dumps(settings, sort_keys=True, default=str).encode())
    return digest.hexdigest()[:32]


@dataclass(eq=False, slots=True)
class DiskEntry:
    """A state on disk: its scope and tokens are known, its bytes read when taken."""

    path: Path
    key: ScopeKey
    tokens: tuple[int, ...]
    nbytes: int


def _body_digest(tokens: bytes, state: bytes | memoryview) -> str:
    digest = hashlib.sha256(tokens)
    digest.update(state)
    return digest.hexdigest()


class DiskStates:
    """One replica's view of the saved states of its model key in ``directory``.

    Every method does file I/O: the runtime calls them on its worker thread.
    """

    def __init__(self, directory: Path, key: str, capacity_bytes: int) -> None:
        self.directory = directory
        self.key = key
        self.capacity_bytes = capacity_bytes
        self.entries: list[DiskEntry] = []

    def index(self) -> None:
        """Learn the states of this model key on disk (headers and tokens only)."""
        self.entries = []
        if self.capacity_bytes <= 0 or not self.directory.is_dir():
            return
        for path in self.directory.glob(f"{self.key}-*{SUFFIX}"):
            entry = self._read_head(path)
            if entry is not None:
                self.entries.append(entry)

    def best(self, key: ScopeKey, tokens: Sequence[int]) -> tuple[DiskEntry | None, int]:
        """The entry of scope ``key`` sharing the longest prefix with ``tokens``."""
        found: DiskEntry | None = None
        longest = 0
        for entry in self.entries:
            if entry.key == key:
                n = common_prefix(entry.tokens, tokens)
                if n > longest:
                    found, longest = entry, n
        return found, longest

    def take(self, entry: DiskEntry) -> SavedState | None:
        """Read ``entry`` back as a saved state and remove its file (None: unreadable,
        or another replica took it first)."""
        self.entries.remove(entry)
        try:
            data = entry.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("saved prompt state %s unreadable, ignored: %s", entry.path.name, exc)
            return None
        finally:
            entry.path.unlink(missing_ok=True)
        parsed = _parse(data)
        if parsed is None:
            log.warning("saved prompt state %s is damaged (digest), ignored", entry.path.name)
            return None
        _, tokens, state = parsed
        buffer = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
        return SavedState(entry.key, tokens, buffer, len(state))

    def write(self, states: Sequence[SavedState]) -> int:
        """Write ``states`` (largest prefix first wins room), then keep the directory
        within the bound; returns how many were written."""
        if self.capacity_bytes <= 0 or not states:
            return 0
        self.directory.mkdir(parents=True, exist_ok=True)
        written = 0
        for saved in states:
            if saved.nbytes > self.capacity_bytes:
                continue
            tokens = struct.pack(f"<{len(saved.tokens)}i", *saved.tokens)
            state = memoryview(saved.state).cast("B")
            head = json.dumps(
                {
                    "model_key": self.key,
                    "tenant": saved.key[0],
                    "tag": saved.key[1],
                    "tokens": len(saved.tokens),
                    "state_bytes": len(state),
                    "sha256": _body_digest(tokens, state),
                }
            ).encode()
            name = f"{self.key}-{uuid.uuid4().hex}"
            path = self.directory / f"{name}{SUFFIX}"
            # Its own temporary name (replicas of a model share the folder): another
            # writer's clean-up never takes a file this one is still writing.
            partial = self.directory / f"{name}.{os.getpid()}{PARTIAL}"
            try:
                with partial.open("wb") as file:
                    file.write(MAGIC + _HEAD.pack(len(head)) + head + tokens)
                    file.write(state)
                os.replace(partial, path)  # whole files only: a crash leaves a partial
            except BaseException:
                partial.unlink(missing_ok=True)
                raise
            written += 1
        self.trim()
        return written

    def trim(self) -> None:
        """Remove the least recently written files (any model) beyond the bound, and
        the temporary files that writers which died mid-write left behind."""
        files = []
        for path in self.directory.glob(f"*{SUFFIX}"):
            try:
                stat = path.stat()
            except FileNotFoundError:
                continue
            files.append((stat.st_mtime_ns, stat.st_size, path))
        self._remove_stale_partials()
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if total <= self.capacity_bytes:
                break
            path.unlink(missing_ok=True)
            total -= size
        self.entries = [e for e in self.entries if e.path.exists()]

    def _remove_stale_partials(self) -> None:
        """Only those no writer has touched for ``STALE_PARTIAL_S``: a fresh one may be
        another replica's (or another pool's) write under way, whose rename would fail."""
        cutoff = time.time() - STALE_PARTIAL_S
        for leftover in self.directory.glob(f"*{PARTIAL}"):
            try:
                if leftover.stat().st_mtime < cutoff:
                    leftover.unlink(missing_ok=True)
            except FileNotFoundError:
                continue  # its writer renamed it meanwhile

    def remove(self, match: Callable[[ScopeKey], bool]) -> tuple[int, int]:
        """Remove this model's files whose scope matches (a flush); (entries, bytes)."""
        gone = [e for e in self.entries if match(e.key)]
        for entry in gone:
            entry.path.unlink(missing_ok=True)
            self.entries.remove(entry)
        return len(gone), sum(e.nbytes for e in gone)

    def _read_head(self, path: Path) -> DiskEntry | None:
        try:
            with path.open("rb") as file:
                if file.read(len(MAGIC)) != MAGIC:
                    raise ValueError("not a saved prompt state")
                (length,) = _HEAD.unpack(file.read(_HEAD.size))
                head = json.loads(file.read(length))
                count = int(head["tokens"])
                raw = file.read(4 * count)
                if len(raw) != 4 * count or head["model_key"] != self.key:
                    raise ValueError("truncated, or of another model")
                tokens = struct.unpack(f"<{count}i", raw)
                return DiskEntry(path, (head["tenant"], head["tag"]), tokens, head["state_bytes"])
        except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
            log.warning("saved prompt state %s ignored and removed: %s", path.name, exc)
            path.unlink(missing_ok=True)
            return None


def _parse(data: bytes) -> tuple[dict[str, Any], tuple[int, ...], bytes] | None:
    try:
        if not data.startswith(MAGIC):
            return None
        offset = len(MAGIC)
        (length,) = _HEAD.unpack_from(data, offset)
        offset += _HEAD.size
        head = json.loads(data[offset : offset + length])
        offset += length
        count, size = int(head["tokens"]), int(head["state_bytes"])
        tokens = data[offset : offset + 4 * count]
        state = data[offset + 4 * count :]
        if len(tokens) != 4 * count or len(state) != size:
            return None
        if _body_digest(tokens, state) != head["sha256"]:
            return None
        return head, struct.unpack(f"<{count}i", tokens), state
    except (ValueError, KeyError, TypeError, struct.error):
        return None
