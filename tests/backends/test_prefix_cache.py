"""The prefix-cache bookkeeping without a model: the state store, slot routing, salts.

The real runtimes are tested in tests/http/test_prefix_cache.py (SmolLM2 through
llama_cpp and llama-server).
"""

from __future__ import annotations

from typing import Any

from pool.backends import CacheScope, Decoding, GenerationRequest, TextPart, Turn
from pool.backends._prefix_cache import (
    LlamaPromptCache,
    SavedState,
    StateStore,
    common_prefix,
    scope_matches,
)
from pool.backends._server_cache import SaltCache, SlotCache


def _entry(key: tuple[str, str | None], tokens: list[int], nbytes: int = 10) -> SavedState:
    return SavedState(key, tuple(tokens), object(), nbytes)


def _request(tenant: str = "a", tag: str | None = None, enabled: bool = True) -> GenerationRequest:
    return GenerationRequest(
        "r",
        "m",
        (Turn("user", (TextPart("hi"),)),),
        Decoding(),
        cache=CacheScope(tenant, tag, enabled),
    )


def test_common_prefix() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0


def test_store_finds_the_longest_prefix_of_the_same_scope_only() -> None:
    store = StateStore(1000)
    a1 = _entry(("a", None), [1, 2, 3, 4])
    a2 = _entry(("a", None), [1, 2, 9])
    b = _entry(("b", None), [1, 2, 3, 4, 5])
    for entry in (a1, a2, b):
        assert store.put(entry)
    assert store.best(("a", None), [1, 2, 3, 4, 5]) == (a1, 4)
    assert store.best(("a", "tag"), [1, 2, 3]) == (None, 0)
    assert store.best(("c", None), [1, 2, 3]) == (None, 0)
    store.take(a1)
    assert store.best(("a", None), [1, 2, 3, 4, 5]) == (a2, 2)
    assert store.used_bytes == 20 and len(store) == 2


def test_store_evicts_least_recently_stored_within_its_bytes() -> None:
    store = StateStore(25)
    first, second, third = (_entry(("a", None), [i] * 3) for i in range(3))
    store.put(first)
    store.put(second)
    store.put(third)  # 30 bytes > 25: the oldest goes
    assert len(store) == 2 and store.used_bytes == 20
    assert store.best(("a", None), [0, 0, 0]) == (None, 0)
    assert not store.put(_entry(("a", None), [7], nbytes=26))  # larger than the store


def test_a_longer_state_of_the_scope_replaces_the_one_it_extends() -> None:
    store = StateStore(1000)
    store.put(_entry(("a", None), [1, 2]))
    store.put(_entry(("b", None), [1, 2]))
    store.put(_entry(("a", None), [1, 2, 3]))
    assert len(store) == 2


def test_flush_scopes() -> None:
    assert scope_matches(("a", "x"), "all", None, None)
    assert scope_matches(("a", "x"), "model", None, None)
    assert scope_matches(("a", "x"), "tenant", "a", None)
    assert not scope_matches(("a", "x"), "tenant", "b", None)
    assert not scope_matches(("a", "x"), "tenant", "a", "y")
    assert scope_matches(("a", "x"), "tag", None, "x")
    assert not scope_matches(("a", None), "tag", None, "x")
    assert not scope_matches(("b", "x"), "tag", "a", "x")
    store = StateStore(1000)
    for key in (("a", "x"), ("a", None), ("b", "x")):
        store.put(_entry(key, [1]))
    assert store.remove(lambda k: scope_matches(k, "tag", None, "x")) == (2, 20)
    assert len(store) == 1


def test_slots_go_back_to_their_scope_and_never_reuse_another() -> None:
    cache = SlotCache(2)
    first = cache.lease(_request("a"), "conversation one")
    assert first.fields == {"id_slot": 0, "cache_prompt": False}
    cache.release(first)
    again = cache.lease(_request("a"), "conversation one, turn two")
    assert again.fields == {"id_slot": 0, "cache_prompt": True}
    # Slot 0 is busy: tenant b gets the other one, without reuse.
    other = cache.lease(_request("b"), "conversation one")
    assert other.fields == {"id_slot": 1, "cache_prompt": False}
    cache.release(again)
    cache.release(other)
    # A tag is a scope of its own; the least recently used slot (0) is taken over.
    tagged = cache.lease(_request("a", "t"), "conversation one")
    assert tagged.fields == {"id_slot": 0, "cache_prompt": False}
    cache.release(tagged)
    off = cache.lease(_request("b", enabled=False), "conversation one")
    assert off.fields == {"id_slot": 1, "cache_prompt": False}
    cache.release(off)
    # Slot 1 ran with caching off: nobody reuses it, tenant b included.
    assert cache.lease(_request("b"), "conversation one").fields["cache_prompt"] is False


def test_slot_flush_erases_idle_slots_of_the_scope() -> None:
    cache = SlotCache(3)
    leases = [
        cache.lease(_request(t, tag), "x") for t, tag in (("a", "t"), ("b", "t"), ("a", None))
    ]
    for lease in leases[:2]:
        cache.release(lease)
    plan = cache.flush("tag", None, "t")
    assert plan.entries == 2 and plan.posts == ["/slots/0?action=erase", "/slots/1?action=erase"]
    # Slot 2 is busy: dropped from the scope, but not erased under its request.
    busy = cache.flush("tenant", "a", None)
    assert busy.entries == 1 and busy.posts == []
    cache.release(leases[2])
    assert cache.lease(_request("a"), "x").fields["cache_prompt"] is False
    assert cache.flush("all", None, None).entries == 1


def test_salts_are_per_scope_and_change_on_flush() -> None:
    cache = SaltCache()

    def salt(request: GenerationRequest) -> str:
        value: str = cache.lease(request, "").fields["cache_salt"]
        return value

    a, b, tagged = salt(_request("a")), salt(_request("b")), salt(_request("a", "t"))
    assert len({a, b, tagged}) == 3 and a == salt(_request("a"))
    assert salt(_request("a", enabled=False)) != salt(_request("a", enabled=False))
    plan = cache.flush("tenant", "a", None)
    assert plan.entries == 2 and plan.posts == []
    assert salt(_request("a")) != a and salt(_request("b")) == b
    assert cache.flush("all", None, None).posts == ["/reset_prefix_cache"]


class _Context:
    """What LlamaPromptCache reads of a ``Llama`` when it keeps no saved states."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.resets = 0

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def _input_ids(self) -> Any:
        tokens = self.tokens

        class _Ids:
            def tolist(self) -> list[int]:
                return list(tokens)

        return _Ids()

    def reset(self) -> None:
        self.tokens = []
        self.resets += 1


def test_the_live_context_is_reused_only_by_its_own_scope() -> None:
    cache = LlamaPromptCache(0)
    llama = _Context()
    prompt = list(range(100))
    assert cache.prepare(llama, ("a", None), prompt) == 0
    llama.tokens = [*prompt, 7, 7]  # evaluated and generated
    assert cache.prepare(llama, ("a", None), [*prompt, 5]) == 100
    assert llama.resets == 1
    assert cache.prepare(llama, ("b", None), [*prompt, 5]) == 0 and llama.resets == 2
    llama.tokens = list(prompt)
    # Caching off resets every time, even after another request with caching off.
    assert cache.prepare(llama, None, prompt) == 0 and llama.resets == 3
    llama.tokens = list(prompt)
    assert cache.prepare(llama, None, prompt) == 0 and llama.resets == 4
    llama.tokens = list(prompt)
    assert cache.prepare(llama, ("b", None), prompt) == 0 and llama.resets == 5
