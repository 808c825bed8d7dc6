"""Shared pieces of the reliability tests: servers on loopback, the scripted backend,
process checks that read /proc, and small readers of the stream formats."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from pool import ServerInfo, serve
from pool.backends import register_backend, unregister_backend
from pool.config import build_settings

from . import scripted_backend


@pytest.fixture
def scripted() -> Iterator[None]:
    """The ``scripted`` backend (tests/reliability/scripted_backend.py), registered."""
    register_backend("scripted", scripted_backend.__name__)
    try:
        yield
    finally:
        unregister_backend("scripted")


async def start_server(
    nursery: trio.Nursery,
    models: dict[str, dict[str, Any]],
    *,
    engine: dict[str, Any] | None = None,
    **service: Any,
) -> ServerInfo:
    """A pool with HTTP on 127.0.0.1, port 0, in ``nursery``."""
    settings = build_settings(
        {
            "service": {"shutdown_grace_s": 2, **service},
            "engine": {**(engine or {}), "models": models},
        }
    )
    info: ServerInfo = await nursery.start(
        lambda task_status: serve(settings, host="127.0.0.1", port=0, task_status=task_status)
    )
    return info


def words(count: int, prefix: str = "w") -> str:
    return " ".join(f"{prefix}{i}" for i in range(count))


async def wait_for(predicate: Callable[[], bool], within_s: float, step_s: float = 0.01) -> float:
    """Poll a counter that publishes no event until ``predicate()``; the seconds it took."""
    started = trio.current_time()
    with trio.fail_after(within_s):
        while not predicate():
            await trio.sleep(step_s)
    return trio.current_time() - started


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name may hold spaces and parentheses: split after the last ')'.
    return text[text.rindex(")") + 2 :].split()


def live_in_group(pgid: int) -> list[int]:
    """Processes of group ``pgid`` that still run (not zombies).

    A grandchild killed with its group is reparented to the machine's init, which reaps
    it when it gets to it; a zombie there is not the pool's. The pool's own child must
    not be a zombie: see :func:`exists`.
    """
    found = []
    for entry in os.listdir("/proc"):
        fields = _stat(int(entry)) if entry.isdigit() else None
        if fields is not None and int(fields[2]) == pgid and fields[0] != "Z":
            found.append(int(entry))
    return found


def exists(pid: int) -> bool:
    """The process is alive or a zombie (not yet reaped by its parent)."""
    return _stat(pid) is not None


def sse_payloads(lines: list[str]) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
