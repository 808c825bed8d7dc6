"""Prefix caching in a managed server (llama-server, vLLM), scoped by tenant and tag.

Both servers cache prompt prefixes on their own; what they cannot know is whose prompt
a request is. These strategies add that to each request's body and flush what a scope
left behind:

- :class:`SlotCache` (llama-server): each parallel slot keeps the KV state of the last
  prompt it ran, reused with ``cache_prompt: true``. A request goes to a free slot
  that its own scope last used, the one whose last conversation shares the longest
  text prefix with it (``id_slot``); a slot last used by another scope (or a request
  with caching off) is sent ``cache_prompt: false``, so llama-server evaluates the
  whole prompt and reuses nothing of the other tenant. The server runs with
  ``--cache-ram 0``: its RAM prompt cache would match prompts across all slots, and so
  across tenants. A flush erases the slots (``POST /slots/{id}?action=erase``, which
  needs ``--slot-save-path``).
- :class:`SaltCache` (vLLM): automatic prefix caching with a ``cache_salt`` per scope
  (a hash of tenant, tag and a flush generation): vLLM only shares blocks between
  requests of one salt. ``X-Cache-Mode: none`` gets a salt of its own. vLLM cannot
  drop one salt's blocks, so a tenant or tag flush moves the scope to a new salt (the
  old blocks are never matched again and age out); ``all``/``model`` also call
  ``/reset_prefix_cache`` (served when ``VLLM_SERVER_DEV_MODE=1``). The in-process
  ``vllm`` backend uses the same salts (:meth:`SaltCache.salt`, :meth:`SaltCache.rotate`)
  in its engine prompts and resets the engine's prefix cache itself.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from pool.backends._prefix_cache import ScopeKey, scope_matches
from pool.backends._protocol import CacheScope, GenerationRequest

# Conversations are compared on this many leading characters at most.
_COMPARED_CHARS = 65_536


@dataclass(slots=True)
class Lease:
    """What one request adds to its body, and what to give back when it ends."""

    fields: dict[str, Any]
    slot: int | None = None


@dataclass(slots=True)
class FlushPlan:
    """What a flush found: entries dropped, and the server calls that drop them."""

    entries: int = 0
    posts: list[str] = field(default_factory=list)


class ServerCache:
    """A managed server's prefix-cache strategy (see the module's description)."""

    def lease(self, request: GenerationRequest, text: str) -> Lease:
        """The cache fields of ``request`` (``text``: its messages, serialized)."""
        raise NotImplementedError

    def release(self, lease: Lease) -> None:
        """The request of ``lease`` ended (successfully or not)."""

    def flush(self, scope: str, tenant: str | None, tag: str | None) -> FlushPlan:
        """Forget the entries of ``scope``; the server calls that drop them."""
        raise NotImplementedError


def conversation_text(body: dict[str, Any]) -> str:
    """A request body's messages as text, for prefix comparison between requests."""
    return json.dumps(body.get("messages", ()), ensure_ascii=False)[:_COMPARED_CHARS]


def _shared_chars(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass(slots=True)
class _Slot:
    index: int
    owner: ScopeKey | None = None
    text: str = ""
    busy: bool = False
    used: int = 0


class SlotCache(ServerCache):
    """Routes each request to a llama-server slot; see the module's description."""

    def __init__(self, slots: int) -> None:
        self._slots = [_Slot(i) for i in range(slots)]
        self._clock = itertools.count(1)

    def lease(self, request: GenerationRequest, text: str) -> Lease:
        key = request.cache.key
        free = [s for s in self._slots if not s.busy]
        if not free:
            # More requests than slots (the scheduler never sends them): let the server
            # pick, and reuse nothing, since the slot's owner is unknown.
            return Lease({"cache_prompt": False})

        def preference(slot: _Slot) -> tuple[int, int, int]:
            shared = _shared_chars(slot.text, text) if key is not None and slot.owner == key else -1
            # Then a slot nobody may reuse (empty, flushed, or run with caching off),
            # then the least recently used one.
            return (shared, 1 if slot.owner is None else 0, -slot.used)

        slot = max(free, key=preference)
        reuse = key is not None and slot.owner == key
        slot.owner, slot.text, slot.busy = key, text, True
        return Lease({"id_slot": slot.index, "cache_prompt": reuse}, slot.index)

    def release(self, lease: Lease) -> None:
        if lease.slot is not None:
            slot = self._slots[lease.slot]
            slot.busy = False
            slot.used = next(self._clock)

    def flush(self, scope: str, tenant: str | None, tag: str | None) -> FlushPlan:
        plan = FlushPlan()
        for slot in self._slots:
            if slot.owner is None or not scope_matches(slot.owner, scope, tenant, tag):
                continue
            # A busy slot is not erased under its request; with no owner, the next
            # request it serves is sent cache_prompt false all the same.
            slot.owner, slot.text = None, ""
            plan.entries += 1
            if not slot.busy:
                plan.posts.append(f"/slots/{slot.index}?action=erase")
        return plan


class SaltCache(ServerCache):
    """A ``cache_salt`` per scope for vLLM; see the module's description.

    Used by ``vllm_serve`` (the salt goes in the request body) and by the in-process
    ``vllm`` backend (it goes in the engine prompt) alike.
    """

    def __init__(self) -> None:
        # Each scope seen, with its flush generation.
        self._generation: dict[ScopeKey, int] = {}
        self._secret = uuid.uuid4().hex

    def salt(self, cache: CacheScope) -> str:
        """The ``cache_salt`` of a request of scope ``cache`` (a fresh one when it is off)."""
        key = cache.key
        if key is None:
            return uuid.uuid4().hex
        generation = self._generation.setdefault(key, 0)
        # Hashed with a per-process secret: tenant names never reach vLLM's logs, and a
        # client cannot forge another scope's salt.
        raw = f"{self._secret}\0{key[0]}\0{key[1] or ''}\0{generation}".encode()
        return hashlib.sha256(raw).hexdigest()

    def rotate(self, scope: str, tenant: str | None, tag: str | None) -> int:
        """Move every scope a flush of ``scope`` takes to a new salt; how many moved."""
        moved = 0
        for key in list(self._generation):
            if scope_matches(key, scope, tenant, tag):
                self._generation[key] += 1
                moved += 1
        return moved

    def lease(self, request: GenerationRequest, text: str) -> Lease:
        return Lease({"cache_salt": self.salt(request.cache)})

    def flush(self, scope: str, tenant: str | None, tag: str | None) -> FlushPlan:
        plan = FlushPlan(self.rotate(scope, tenant, tag))
        if scope in ("all", "model"):
            plan.posts.append("/reset_prefix_cache")
        return plan
