"""Prefix affinity: send a request to the replica that has most likely kept its prompt.

A runtime with a prefix cache (llama.cpp's saved states, vLLM's prefix caching,
llama-server's prompt cache) answers a conversation's next turn fast only on the
replica that served the turn before; the least-loaded choice scatters a conversation
over the replicas, and each of them evaluates the whole prompt again.

The pool keeps no copy of prompts for this. A prompt is cut into blocks of its canonical
text, and each block is named by a hash chained over the blocks before it and the
request's cache scope (as vLLM names its KV blocks), so one key stands for a whole
prefix and two scopes never share a key: one tenant's prompts never attract another's
requests. Each replica remembers the keys of the prompts it was given, newest last, up
to a bound; a request goes to the free replica that holds the longest run of its keys.

Across a cluster (pool/cluster/_routing.py) a node tells its peers what each model was
given in a few keys: the last key of each recent prompt (:class:`RecentPrompts`), which
stands for the whole prompt, so one key per conversation is enough for its next turn
to find the node.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Container, Sequence
from typing import Protocol, TypeVar

from pool.backends import CacheScope, GenerationRequest, ImagePart, TextPart, Turn, relayed_text

# Characters per block: a turn of chat is a few blocks; a 100k-character prompt is 200.
BLOCK_CHARS = 512
# The part of a prompt a replica (or node) must hold more than for affinity to choose
# it over balance (as SGLang's cache-aware router does); otherwise the least loaded.
AFFINITY_MIN_SHARE = 0.5
# Keys a replica remembers (8 bytes each, plus the dict's own): about a megabyte, or
# 4 million characters of distinct prompts.
SUMMARY_KEYS = 16_384


class Prompt(Protocol):
    """What the keys are made of: a :class:`GenerationRequest`, or the neutral request
    before it is built (the cluster's router hashes that, once, for the whole way)."""

    @property
    def instructions(self) -> str | None: ...

    @property
    def turns(self) -> tuple[Turn, ...]: ...


def _canonical(request: Prompt) -> str:
    """The prompt as text, in the order a prompt format renders it. Separators are
    control characters no API text field carries, so two requests share a prefix here
    only where the runtime's prompt does too."""
    pieces = [request.instructions or "", "\x1e"]
    for turn in request.turns:
        pieces.append(turn.role)
        pieces.append("\x1f")
        for part in turn.parts:
            if isinstance(part, TextPart):
                pieces.append(part.text)
            elif isinstance(part, ImagePart):
                pieces.append(f"\x1dimage:{part.url}\x1d")
        for call in turn.tool_calls:
            pieces.append(f"\x1dcall:{call.name}:{call.arguments}\x1d")
        pieces.append("\x1e")
    return "".join(pieces)


def prefix_keys(request: GenerationRequest, reply: str | None = None) -> tuple[bytes, ...]:
    """The chained block keys of ``request``'s prompt within its cache scope (with
    ``reply``: of the prompt followed by that answer, as the next turn will send it);
    none when the request may reuse no cached state (``X-Cache-Mode: none``)."""
    return prompt_keys(request, request.cache, reply)


def prompt_keys(prompt: Prompt, cache: CacheScope, reply: str | None = None) -> tuple[bytes, ...]:
    """:func:`prefix_keys` of a prompt whose cache scope comes apart from it."""
    if not cache.enabled:
        return ()
    text = _canonical(prompt)
    if reply:
        text += f"assistant\x1f{reply}\x1e"
    scope = f"{cache.tenant}\x00{cache.tag or ''}".encode()
    key = hashlib.blake2b(scope, digest_size=8).digest()
    keys = []
    # Whole blocks only: a key names a prefix that a later prompt can share entirely.
    for start in range(0, len(text) - BLOCK_CHARS + 1, BLOCK_CHARS):
        block = text[start : start + BLOCK_CHARS].encode("utf-8", "surrogatepass")
        key = hashlib.blake2b(key + block, digest_size=8).digest()
        keys.append(key)
    return tuple(keys)


class PendingKeys:
    """A request's prompt keys, hashed the first time someone asks (the cluster's router
    asks only where a peer names prompts; the scheduler then reuses them)."""

    __slots__ = ("_cache", "_prompt", "value")

    def __init__(self, prompt: Prompt, cache: CacheScope) -> None:
        self._prompt = prompt
        self._cache = cache
        self.value: tuple[bytes, ...] | None = None

    def __call__(self) -> tuple[bytes, ...]:
        if self.value is None:
            self.value = prompt_keys(self._prompt, self._cache)
        return self.value


Key = TypeVar("Key", bytes, str)


def longest_held(keys: Sequence[Key], held: Container[Key]) -> int:
    """How many leading blocks of ``keys`` a holder of the keys in ``held`` was given:
    the deepest of them it holds, since a chained key stands for its whole prefix (the
    keys as bytes, or as the registry's hex)."""
    for depth in range(len(keys), 0, -1):
        if keys[depth - 1] in held:
            return depth
    return 0


class RecentPrompts:
    """The last key of each prompt a model was given (and of each prompt with its
    answer), newest first out: what a node tells its peers about the model.

    A key a newer prompt extends is dropped, so a conversation takes one place however
    many turns it has: ``capacity`` keys name that many recent conversations.
    ``on_change`` is called when the list changed (the node then rewrites its record).
    """

    def __init__(self, capacity: int, on_change: Callable[[], None] | None = None) -> None:
        self.capacity = capacity
        self._on_change = on_change
        self._tips: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._tips)

    def record(self, keys: Sequence[bytes]) -> None:
        if not keys or self.capacity <= 0:
            return
        tip = keys[-1]
        if next(reversed(self._tips), None) == tip:
            return  # the newest already (the answer filled no new block)
        for key in keys[:-1]:
            self._tips.pop(key, None)
        self._tips[tip] = None
        self._tips.move_to_end(tip)
        while len(self._tips) > self.capacity:
            self._tips.popitem(last=False)
        if self._on_change is not None:
            self._on_change()

    def newest(self) -> list[bytes]:
        """The keys, newest first."""
        return list(reversed(self._tips))

    def clear(self) -> None:
        if self._tips:
            self._tips.clear()
            if self._on_change is not None:
                self._on_change()


class PrefixSummary:
    """The prompt-block keys one replica was given, least recently used first out.

    ``recent``, where given, is told of every prompt too (the model's
    :class:`RecentPrompts`, shared by its replicas)."""

    def __init__(self, capacity: int = SUMMARY_KEYS, recent: RecentPrompts | None = None) -> None:
        self.capacity = capacity
        self.recent = recent
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def record(self, keys: Sequence[bytes]) -> None:
        # Last block first: a prompt's first keys are the newest, so eviction (oldest
        # first) takes a prompt's tail before its head and what stays is a prefix.
        for key in reversed(keys):
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)
        if self.recent is not None:
            self.recent.record(keys)

    def match(self, keys: tuple[bytes, ...]) -> int:
        """How many leading blocks of ``keys`` this replica was given. A chained key
        stands for its whole prefix and eviction keeps prefixes (see :meth:`record`),
        so the held keys of a prompt are its first ones: found by bisection."""
        low, high = 0, len(keys)
        while low < high:
            middle = (low + high + 1) // 2
            if keys[middle - 1] in self._keys:
                low = middle
            else:
                high = middle - 1
        return low

    def clear(self) -> None:
        self._keys.clear()


class ReplyRecorder:
    """Collects a routed request's answer as it is generated; at the end the replica's
    summary learns the prompt with the answer, which is what its cache then holds and
    what a conversation's next turn starts with."""

    __slots__ = ("_parts", "_raw", "_request", "_summary")

    def __init__(self, request: GenerationRequest, summary: PrefixSummary) -> None:
        self._request = request
        self._summary = summary
        self._parts: list[str] = []
        self._raw: list[bytes] = []

    def add(self, text: str) -> None:
        self._parts.append(text)

    def add_raw(self, events: bytes) -> None:
        """An upstream's forwarded events (the pass-through relay): their text is read
        once, at the end, rather than parsed per token."""
        self._raw.append(events)

    def finish(self) -> None:
        if self._raw:
            self._parts.append(relayed_text(b"".join(self._raw)))
        if self._parts:
            self._summary.record(prefix_keys(self._request, "".join(self._parts)))
