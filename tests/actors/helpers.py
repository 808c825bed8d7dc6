"""Shared helpers for the actor tests: settings builders and request runners."""

from __future__ import annotations

import inspect
from typing import Any

import trio

from pool import InferenceRequest, Pool, PoolError, request_from_responses
from pool.backends import CacheFlushed
from pool.backends.stub import StubBackend, StubRuntime
from pool.config import Settings, build_settings
from tests.bounds import EVENT_BOUND_S, within


def stub_settings(models: dict[str, dict[str, Any]], **engine: Any) -> Settings:
    return build_settings(
        {"engine": {**engine, "models": {n: {"backend": "stub", **m} for n, m in models.items()}}}
    )


def ask(model: str, text: str = "hello world", **fields: Any) -> InferenceRequest:
    return request_from_responses({"model": model, "input": text, **fields})


class Outcome:
    """What one background request ended with."""

    def __init__(self) -> None:
        self.text: str | None = None
        self.error: PoolError | None = None
        self.done = trio.Event()
        self.finished_at: float | None = None


async def run_request(pool: Pool, request: InferenceRequest, outcome: Outcome, **kw: Any) -> None:
    try:
        reply = await pool.respond(request, **kw)
        outcome.text = reply.text
    except PoolError as exc:
        outcome.error = exc
    finally:
        outcome.finished_at = trio.current_time()
        outcome.done.set()


async def wait_until(predicate: Any, within_s: float = EVENT_BOUND_S) -> None:
    """Wait for a condition on counters that publish no event (tests only); the bound
    only turns a condition that never comes into a failure that shows it."""
    with within(f"the condition of {_source(predicate)}", within_s):
        while not predicate():
            await trio.sleep(0.001)


def _source(predicate: Any) -> str:
    try:
        return inspect.getsource(predicate).strip()
    except (OSError, TypeError):
        return repr(predicate)


class CachingRuntime(StubRuntime):
    """The stub with a prompt cache to flush: records each call, frees 3 entries."""

    flushes: list[tuple[str, str | None, str | None]] = []

    async def flush_cache(self, *, scope: str, tenant: str | None, tag: str | None) -> CacheFlushed:
        self.flushes.append((scope, tenant, tag))
        return CacheFlushed(3, 1.5)


_stub_load = StubBackend.load


class CachingBackend(StubBackend):
    async def load(self, definition: Any, context: Any) -> StubRuntime:
        return await self.load_caching(definition, context)

    async def load_caching(self, definition: Any, context: Any) -> StubRuntime:
        """The stub's load, then a runtime with a prompt cache (also patched onto the stub)."""
        await _stub_load(self, definition, context)
        return CachingRuntime(definition)
