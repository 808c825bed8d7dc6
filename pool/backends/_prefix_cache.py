"""Prompt prefix reuse for an in-process llama.cpp context, scoped by tenant and tag.

A llama context holds the state of the last prompt it evaluated; llama-cpp-python's
``Llama.generate`` already reuses the longest common token prefix of that live state
(it trims the KV cache past it and evaluates only the rest). What it does not do is
know whose state that is, or keep more than one. :class:`LlamaPromptCache` adds both:

- the live state belongs to one scope ``(tenant, tag)``; a request of another scope
  (or with caching off) never reuses it: the context is reset first, so one tenant
  can neither read nor time another's prompt;
- before the live state is reset or overwritten, it is saved (``Llama.save_state``)
  into a :class:`StateStore`: an LRU of saved states filed by scope and bounded in
  bytes; a later request of that scope whose prompt shares more tokens with a saved
  state than with the live one gets it back (``Llama.load_state``) first.

So one conversation going on in turns reuses the live context at no cost, and
interleaved conversations or tenants each find their prefix in the store. When the
replica closes (an unload, an eviction), its states go to disk
(pool/backends/_saved_states.py) and come back the same way after the model reloads. Measured
here on SmolLM2-135M (CPU): saving 1,300 tokens of state costs a few milliseconds
against seconds of prompt evaluation.
"""

from __future__ import annotations

import ctypes
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pool.backends._protocol import CacheFlushed, CacheUsage

ScopeKey = tuple[str, str | None]
_MIB = 1024 * 1024
# A live state shorter than this is not worth a save (the copy costs more than a
# re-evaluation would).
MIN_SAVED_TOKENS = 32
# The live state is saved before a request of its own scope overwrites it only when
# that request would drop at least this many of its tokens: a conversation's next turn
# shares all but the last few tokens, a new conversation shares little.
DIVERGENCE_TOKENS = 64


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass(eq=False, slots=True)
class SavedState:
    """One saved prompt state: whose it is, its tokens, and what it weighs."""

    key: ScopeKey
    tokens: tuple[int, ...]
    state: Any
    nbytes: int


def scope_matches(key: ScopeKey, scope: str, tenant: str | None, tag: str | None) -> bool:
    """Whether a flush of ``scope`` removes an entry of ``key``.

    ``all`` and ``model`` take everything (the pool picks the model's replicas);
    ``tenant`` and ``tag`` take their own, narrowed by the other value when given.
    """
    if scope in ("all", "model"):
        return True
    if scope == "tenant":
        return key[0] == tenant and (tag is None or key[1] == tag)
    if scope == "tag":
        return key[1] == tag and (tenant is None or key[0] == tenant)
    return False


class StateStore:
    """Saved states by scope, least recently used first out, within ``capacity_bytes``."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._entries: OrderedDict[int, SavedState] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[SavedState]:
        """Every entry, most recently used first."""
        return list(reversed(self._entries.values()))

    def best(self, key: ScopeKey, tokens: Sequence[int]) -> tuple[SavedState | None, int]:
        """The entry of ``key`` sharing the longest prefix with ``tokens``, and its length."""
        found: SavedState | None = None
        longest = 0
        for entry in self._entries.values():
            if entry.key == key:
                n = common_prefix(entry.tokens, tokens)
                if n > longest:
                    found, longest = entry, n
        return found, longest

    def take(self, entry: SavedState) -> SavedState:
        """Remove ``entry`` (its state goes back into the live context)."""
        del self._entries[id(entry)]
        self.used_bytes -= entry.nbytes
        return entry

    def put(self, entry: SavedState) -> bool:
        """Keep ``entry``, evicting the least recently used to make room.

        Entries of the same scope whose tokens ``entry`` extends are dropped: it holds
        all they hold. False when ``entry`` alone is larger than the whole store.
        """
        if entry.nbytes > self.capacity_bytes:
            return False
        for old in list(self._entries.values()):
            if old.key == entry.key and common_prefix(old.tokens, entry.tokens) == len(old.tokens):
                self.take(old)
        while self._entries and self.used_bytes + entry.nbytes > self.capacity_bytes:
            _, oldest = self._entries.popitem(last=False)
            self.used_bytes -= oldest.nbytes
        self._entries[id(entry)] = entry
        self.used_bytes += entry.nbytes
        return True

    def remove(self, match: Callable[[ScopeKey], bool]) -> tuple[int, int]:
        """Drop every entry whose scope matches; (entries, bytes) removed."""
        gone = [e for e in self._entries.values() if match(e.key)]
        for entry in gone:
            self.take(entry)
        return len(gone), sum(e.nbytes for e in gone)


class StateArchive(Protocol):
    """Where a closing replica's states go, and come back from after a reload (on disk:
    pool/backends/_saved_states.py)."""

    def best(self, key: ScopeKey, tokens: Sequence[int]) -> tuple[Any, int]: ...

    def take(self, entry: Any) -> SavedState | None: ...

    def remove(self, match: Callable[[ScopeKey], bool]) -> tuple[int, int]: ...

    def write(self, states: Sequence[SavedState]) -> int: ...


class LlamaPromptCache:
    """The prefix cache of one replica's ``llama_cpp.Llama``.

    Every method runs on the replica's worker thread (the one that may touch the
    context): the runtime calls them under its limiter.
    """

    def __init__(self, capacity_mib: int, disk: StateArchive | None = None) -> None:
        self.store = StateStore(capacity_mib * _MIB)
        # States an earlier load of this model left on disk (indexed at load).
        self.disk = disk
        # Whose prompt the live context holds; None: nobody may reuse it.
        self.live_key: ScopeKey | None = None

    def prepare(self, llama: Any, key: ScopeKey | None, tokens: Sequence[int]) -> int:
        """Make the context hold the best state ``key`` may reuse for ``tokens``.

        Returns how many prompt tokens ``Llama.generate`` will then reuse (it keeps
        at least one token to evaluate, to get fresh logits).
        """
        live = 0
        if key is not None and self.live_key == key:
            live = common_prefix(_live_tokens(llama), tokens)
        saved, longest = self.store.best(key, tokens) if key is not None else (None, 0)
        if saved is not None and longest > live:
            # Taken out first: saving the live state may evict to make room.
            self.store.take(saved)
        else:
            saved = None
        if key is not None and self.disk is not None:
            on_disk, n = self.disk.best(key, tokens)
            if on_disk is not None and n > max(live, longest if saved else 0):
                restored = self.disk.take(on_disk)
                if restored is not None:
                    if saved is not None:
                        self.store.put(saved)  # not needed now after all
                    saved, longest = restored, n
        if saved is not None:
            self._save_live(llama)
            live = longest if _restore(llama, saved) else 0
        elif key is None or self.live_key != key:
            # Caching off, or another scope's state: evaluate from nothing. (Without
            # the reset, Llama.generate would reuse the live prefix on its own.)
            self._save_live(llama)
            llama.reset()
            live = 0
        elif llama.n_tokens - live >= DIVERGENCE_TOKENS:
            # The same scope, another conversation: keep this one's state for later.
            self._save_live(llama)
        self.live_key = key
        return max(0, min(live, len(tokens) - 1))

    def _save_live(self, llama: Any) -> None:
        if self.live_key is None or llama.n_tokens < MIN_SAVED_TOKENS:
            return
        if self.store.capacity_bytes <= 0:
            return
        state = _save(llama)
        if state is not None:
            tokens = tuple(_live_tokens(llama))
            self.store.put(SavedState(self.live_key, tokens, state, len(state)))

    def flush(self, llama: Any, scope: str, tenant: str | None, tag: str | None) -> CacheFlushed:
        """Drop the saved states of ``scope``, and the live one if it is in scope."""

        def match(key: ScopeKey) -> bool:
            return scope_matches(key, scope, tenant, tag)

        entries, nbytes = self.store.remove(match)
        if self.disk is not None:
            on_disk, disk_bytes = self.disk.remove(match)
            entries, nbytes = entries + on_disk, nbytes + disk_bytes
        if self.live_key is not None and match(self.live_key):
            # The live state's memory is the context's own KV buffer: it stays allocated,
            # but nothing in it will be reused.
            llama.reset()
            self.live_key = None
            entries += 1
        return CacheFlushed(entries, nbytes / _MIB)

    def persist(self, llama: Any) -> int:
        """Write the saved states and the live one to disk (the replica is closing);
        returns how many were written."""
        if self.disk is None:
            return 0
        self._save_live(llama)
        return self.disk.write(self.store.entries())

    def usage(self) -> CacheUsage:
        return CacheUsage(self.store.capacity_bytes / _MIB, self.store.used_bytes / _MIB)


def _save(llama: Any) -> Any:
    """The KV cells of the context's one sequence, as a ctypes byte array (None: empty).

    Not ``Llama.save_state``: that also copies its score buffer (n_batch x n_vocab
    floats, about 100 MB for SmolLM2), which nothing here needs, since a restored state
    always evaluates at least one token before sampling.
    """
    import llama_cpp

    ctx = llama._ctx.ctx
    size = llama_cpp.llama_state_seq_get_size(ctx, 0)
    if size <= 0:
        return None
    buffer = (ctypes.c_uint8 * size)()
    written = llama_cpp.llama_state_seq_get_data(ctx, buffer, size, 0)
    if written <= 0:
        return None
    return buffer


def _restore(llama: Any, saved: SavedState) -> bool:
    """Put ``saved`` back as the live state; False (the context reset) if llama refused."""
    import llama_cpp

    llama.reset()
    llama._ctx.kv_cache_seq_rm(-1, 0, -1)
    read = llama_cpp.llama_state_seq_set_data(llama._ctx.ctx, saved.state, len(saved.state), 0)
    if read <= 0:
        llama._ctx.kv_cache_seq_rm(-1, 0, -1)
        return False
    n = len(saved.tokens)
    llama.input_ids[:n] = saved.tokens
    llama.n_tokens = n
    # The logits in the context are not those of the restored tokens.
    llama._requires_eval = True
    return True


def _live_tokens(llama: Any) -> Sequence[int]:
    # ``Llama._input_ids`` is the evaluated part of its token buffer (a numpy view).
    return llama._input_ids.tolist()  # type: ignore[no-any-return]
