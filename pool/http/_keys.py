"""Keys with identities: the settings' keys, those added at runtime, and revocations.

A key names its caller (:class:`~pool.actors.Caller`: tenant, role, priority, rate
limit). ``service.auth.keys`` lists keys in the clear or as their SHA-256; the admin
API adds keys and revokes any key, the settings' ones included. Only digests are kept:
in memory, and in ``keys.json`` in the state directory, which holds the runtime keys and
the revocations of settings keys and is replaced atomically on every change (written
by a worker thread, then swapped in here, so a change is in force once the admin call
answers). A revocation is by digest: a settings key revoked stays refused across
restarts until the settings give that name another key.

A presented key is hashed once and compared with every key's digest with
:func:`hmac.compare_digest`, without stopping at a match, so the time taken says
nothing about which key (or how much of one) was guessed.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import trio

from pool.actors import Caller
from pool.config import KeyFields, KeySettings
from pool.errors import ConfigError, PoolError

KeySource = Literal["settings", "runtime"]
FILE_NAME = "keys.json"
# Generated keys: a recognisable prefix (secret scanners, logs) and 256 random bits.
GENERATED_PREFIX = "sk-pool-"
_FILE_VERSION = 1


def key_digest(clear: str) -> bytes:
    """The SHA-256 of a key as presented (``Authorization: Bearer`` or ``x-api-key``)."""
    return hashlib.sha256(clear.encode()).digest()


def generate_key() -> str:
    return GENERATED_PREFIX + secrets.token_urlsafe(32)


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """One key in force: who it makes its caller, and its digest (never the key)."""

    caller: Caller
    digest: bytes
    source: KeySource
    created_at: float | None = None  # None: from the settings

    @property
    def name(self) -> str:
        return self.caller.key_name

    def row(self) -> dict[str, Any]:
        """What ``GET /v1/admin/keys`` shows of it: never the key nor its digest."""
        c = self.caller
        return {
            "name": c.key_name,
            "tenant": c.tenant,
            "role": c.role,
            "priority": c.priority,
            "rate_limit_rpm": c.rate_limit_rpm,
            "preemptible": c.preemptible,
            "created_at": self.created_at,
            "source": self.source,
        }


def _caller(fields: KeyFields) -> Caller:
    return Caller(
        key_name=fields.name,
        tenant=fields.tenant,
        role=fields.role,
        priority=fields.priority,
        rate_limit_rpm=fields.rate_limit_rpm,
        preemptible=fields.preemptible,
    )


def _settings_record(entry: KeySettings) -> KeyRecord:
    digest = (
        key_digest(entry.key) if entry.key is not None else bytes.fromhex(entry.key_sha256 or "")
    )
    return KeyRecord(_caller(entry), digest, "settings")


@dataclass(frozen=True, slots=True)
class _Revocation:
    name: str
    digest: bytes
    at: float


class KeyFile:
    """``keys.json``: the runtime keys and the revoked settings keys, by digest."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def read(self) -> tuple[list[KeyRecord], list[_Revocation]]:
        """What the file holds; nothing when there is no file yet.

        Raises:
            ConfigError: the file is there but unreadable. Starting without it would
                bring revoked keys back, so the pool refuses to start instead.
        """
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            runtime = [self._record(entry) for entry in data["keys"]]
            revoked = [
                _Revocation(str(entry["name"]), bytes.fromhex(entry["key_sha256"]), entry["at"])
                for entry in data["revoked"]
            ]
        except (FileNotFoundError, NotADirectoryError):
            # No file (or no state folder at all, a file in its place): nothing was added
            # or revoked at runtime; a change later fails with a logged error.
            return [], []
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(
                [
                    f"the key file {self.path} is unreadable ({exc!r}); it holds the keys"
                    " added and revoked at runtime: repair or remove it"
                ]
            ) from exc
        return runtime, revoked

    @staticmethod
    def _record(entry: dict[str, Any]) -> KeyRecord:
        fields = KeyFields.model_validate(
            {k: entry[k] for k in ("name", "tenant", "role", "priority", "rate_limit_rpm")}
            # Absent from files written before keys had it.
            | {"preemptible": entry.get("preemptible", False)}
        )
        digest = bytes.fromhex(entry["key_sha256"])
        if len(digest) != 32:
            raise ValueError(f"key {fields.name!r}: the digest is not 32 bytes")
        return KeyRecord(_caller(fields), digest, "runtime", float(entry["created_at"]))

    def write(self, runtime: list[KeyRecord], revoked: list[_Revocation]) -> None:
        """Replace the file (a temporary file in the same folder, fsync, rename)."""
        data = {
            "version": _FILE_VERSION,
            "keys": [{**r.row(), "key_sha256": r.digest.hex()} for r in runtime],
            "revoked": [
                {"name": r.name, "key_sha256": r.digest.hex(), "at": r.at} for r in revoked
            ],
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(prefix=".keys-", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                json.dump(data, out, indent=1)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temporary, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise


class KeyRing:
    """The keys in force; adds and revokes them, persisted in a :class:`KeyFile`.

    Args:
        configured: ``service.auth.keys``.
        file: where runtime changes are kept; None keeps them in memory only.

    Raises:
        ConfigError: two keys with one secret, a name both in the settings and among
            the runtime keys, or an unreadable key file.
    """

    def __init__(self, configured: list[KeySettings], file: KeyFile | None) -> None:
        self._file = file
        runtime, self._revoked = file.read() if file is not None else ([], [])
        revoked = {r.digest for r in self._revoked}
        settings = [_settings_record(k) for k in configured]
        active = [r for r in settings if r.digest not in revoked] + runtime
        problems = []
        # A revoked settings key's name may have been given to a runtime key since.
        names = {r.name for r in settings if r.digest not in revoked}
        for record in runtime:
            if record.name in names:
                problems.append(
                    f"key {record.name!r} is in service.auth.keys and was also added at"
                    f" runtime ({file.path if file else ''}): rename the one in the settings"
                )
        digests: dict[bytes, str] = {}
        for record in active:
            other = digests.setdefault(record.digest, record.name)
            if other != record.name:
                problems.append(f"keys {other!r} and {record.name!r} have the same secret")
        if problems:
            raise ConfigError(problems)
        self._active: tuple[KeyRecord, ...] = tuple(active)
        self._lock = trio.Lock()
        self._changed = trio.Event()

    def __bool__(self) -> bool:
        return bool(self._active)

    def grants(self, admin: bool) -> bool:
        """Whether any key grants admin access (``admin``), or any access at all."""
        return any(r.caller.role == "admin" for r in self._active) if admin else bool(self)

    def match(self, presented: list[str]) -> KeyRecord | None:
        """The key in force among ``presented`` (the first that is one), in constant time
        for a given number of keys."""
        found: KeyRecord | None = None
        for candidate in presented:
            digest = key_digest(candidate)
            for record in self._active:
                same = hmac.compare_digest(digest, record.digest)
                if same and found is None:
                    found = record
        return found

    def in_force(self, caller: Caller) -> bool:
        """Whether the key that made ``caller`` has not been revoked since."""
        return any(r.caller is caller for r in self._active)

    async def revoked(self, caller: Caller) -> None:
        """Return once the key that made ``caller`` is revoked (at once if it is)."""
        while self.in_force(caller):
            await self._changed.wait()

    def rows(self) -> list[dict[str, Any]]:
        return [r.row() for r in self._active]

    async def add(self, fields: KeyFields, key_sha256: str | None = None) -> tuple[KeyRecord, str]:
        """Add a runtime key; its clear key is generated unless ``key_sha256`` is given.

        Returns:
            The record and the clear key ("" when only the digest was given): shown
            once, never kept.

        Raises:
            PoolError: ``key_exists`` (409) for a name or a secret already in force.
        """
        clear = "" if key_sha256 is not None else generate_key()
        digest = bytes.fromhex(key_sha256) if key_sha256 is not None else key_digest(clear)
        async with self._lock:
            for record in self._active:
                if record.name == fields.name:
                    raise PoolError("key_exists", f"a key named {fields.name!r} exists")
                if hmac.compare_digest(record.digest, digest):
                    raise PoolError("key_exists", "a key with this secret exists")
            record = KeyRecord(_caller(fields), digest, "runtime", time.time())
            await self._commit((*self._active, record), self._revoked)
        return record, clear

    async def revoke(self, name: str) -> KeyRecord:
        """Revoke the key ``name``: refused from now on, on every route.

        Raises:
            PoolError: ``unknown_key`` (404) when no key of that name is in force.
        """
        async with self._lock:
            record = next((r for r in self._active if r.name == name), None)
            if record is None:
                raise PoolError("unknown_key", f"no key named {name[:100]!r} is in force")
            revoked = self._revoked
            if record.source == "settings":
                revoked = [*revoked, _Revocation(name, record.digest, time.time())]
            await self._commit(tuple(r for r in self._active if r is not record), revoked)
        return record

    async def _commit(self, active: tuple[KeyRecord, ...], revoked: list[_Revocation]) -> None:
        if self._file is not None:
            runtime = [r for r in active if r.source == "runtime"]
            try:
                await trio.to_thread.run_sync(self._file.write, runtime, revoked)
            except OSError as exc:
                raise PoolError(
                    "internal_error", f"the key file could not be written: {exc.strerror}"
                ) from exc
        self._active, self._revoked = active, revoked
        # Everyone waiting on a key's revocation looks again.
        self._changed.set()
        self._changed = trio.Event()
