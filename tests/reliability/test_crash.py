"""A backend that dies mid-stream: the client gets an error event, the watchdog
recycles the replica and the model serves again by itself (docs/faults.md); past
``engine.watchdog_recycles_per_hour`` it goes ``failed`` with the reason. Nothing of the
dead runtime is left running.

Two kinds of death: ``kill -9`` of a managed server process (the fake llama-server of
tests/backends), and an in-process engine thread that raises (the scripted backend).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from pool import ServerInfo
from tests.backends.test_process import FAKE

from .conftest import exists, live_in_group, sse_payloads, start_server, wait_for


@pytest.fixture
def fake_binary(tmp_path: Path) -> Path:
    script = tmp_path / "fake-llama-server"
    script.write_text(f'#!/bin/sh\nexec {sys.executable} {FAKE} "$@"\n')
    script.chmod(0o755)
    return script


async def _stream(
    client: httpx.AsyncClient, model: str, text: str, on_delta: Any = None, max_tokens: int = 30
) -> list[dict[str, Any]]:
    """One SSE request; ``on_delta(n)`` runs after the n-th delta."""
    lines: list[str] = []
    deltas = 0
    body = {"model": model, "input": text, "stream": True, "decoding": {"max_tokens": max_tokens}}
    async with client.stream("POST", "/v1/responses", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            lines.append(line)
            if line == "event: response.output_text.delta":
                deltas += 1
                if on_delta is not None:
                    on_delta(deltas)
    return sse_payloads(lines)


async def _failed_with(info: ServerInfo, model: str, within_s: float = 5.0) -> str:
    await wait_for(lambda: info.pool.snapshot(model).state == "failed", within_s)
    return info.pool.snapshot(model).last_error or ""


def _server_pid(info: ServerInfo, model: str) -> int:
    replicas = info.pool.model(model).replicas
    runtime = replicas[0].runtime if replicas else None
    return runtime.process.pid if runtime is not None else -1  # type: ignore[attr-defined]


def _recycles(info: ServerInfo, model: str) -> list[Any]:
    return [d for d in info.pool.decisions() if d.action == "reload" and d.model == model]


def _managed(tmp_path: Path, fake_binary: Path) -> dict[str, Any]:
    model_file = tmp_path / "model.gguf"
    model_file.write_bytes(b"GGUF")
    return {
        "backend": "llama_server",
        "enabled": True,
        "model_path": str(model_file),
        "llama_server_binary": str(fake_binary),
        "llama_server_start_timeout_s": 20,
        "llama_server_extra_args": ["--mode", "slow", "--spawn-child"],
    }


async def test_kill_9_of_a_managed_server_mid_stream(
    nursery: trio.Nursery, fake_binary: Path, tmp_path: Path
) -> None:
    """The stream ends with an error event; the watchdog recycles the replica (one
    decision), a fresh server serves, the dead one's group is gone; the other model
    served all along."""
    other = {"backend": "stub", "enabled": True}
    info = await start_server(nursery, {"srv": _managed(tmp_path, fake_binary), "other": other})
    assert info.pool.snapshot("srv").state == "loaded"
    pid = _server_pid(info, "srv")
    assert len(live_in_group(pid)) == 2  # the server and the grandchild it started

    def kill_at_second_delta(n: int) -> None:
        if n == 2:
            os.kill(pid, signal.SIGKILL)

    async with httpx.AsyncClient(base_url=info.url, timeout=15) as client:
        events = await _stream(client, "srv", "hi", kill_at_second_delta)
        assert events[-1]["type"] == "error", events[-1]
        assert events[-1]["error"]["code"] == "backend_error"
        assert "exited (status -9)" in events[-1]["error"]["message"]
        assert "Traceback" not in str(events)
        await wait_for(lambda: _server_pid(info, "srv") not in (-1, pid), 20.0)
        (recycle,) = _recycles(info, "srv")
        assert recycle.details["fault"] == "exit" and "exited with status -9" in recycle.reason
        row = (await client.get("/v1/admin/models/srv")).json()
        assert row["runtime_state"] == "loaded"
        # Reaped by the pool (no zombie), and the whole group went with it (no orphan).
        await wait_for(lambda: not exists(pid) and not live_in_group(pid), 5.0)
        events = await _stream(client, "srv", "hi again", max_tokens=3)
        assert events[-1]["type"] == "response.completed"
        assert info.pool.snapshot("other").state == "loaded"
        assert info.pool.model("other").load_count == 1
        new_pid = _server_pid(info, "srv")
        unloaded = await client.post("/v1/admin/models/srv/unload", json={})
        assert unloaded.json()["runtime_state"] == "unloaded"
        await wait_for(lambda: not exists(new_pid) and not live_in_group(new_pid), 5.0)
        metrics = (await client.get("/metrics")).text
        assert 'llm_pool_watchdog_recycles_total{fault="exit",model="srv"} 1.0' in metrics


async def test_a_server_that_keeps_dying_is_marked_failed(
    nursery: trio.Nursery, fake_binary: Path, tmp_path: Path
) -> None:
    """Past engine.watchdog_recycles_per_hour (0 here) the model goes ``failed`` with the
    reason, nothing is left running, and an operator's load brings it back."""
    info = await start_server(
        nursery, {"srv": _managed(tmp_path, fake_binary)}, engine={"watchdog_recycles_per_hour": 0}
    )
    pid = _server_pid(info, "srv")
    os.kill(pid, signal.SIGKILL)
    reason = await _failed_with(info, "srv")
    assert "exited with status -9" in reason
    (fail,) = [d for d in info.pool.decisions() if d.action == "fail"]
    assert "engine.watchdog_recycles_per_hour" in fail.reason
    await wait_for(lambda: not exists(pid) and not live_in_group(pid), 5.0)
    async with httpx.AsyncClient(base_url=info.url, timeout=15) as client:
        row = (await client.get("/v1/admin/models/srv")).json()
        assert row["runtime_state"] == "failed" and row["last_error"] == reason
        loaded = await client.post("/v1/admin/models/srv/load", json={})
        assert loaded.status_code == 200 and loaded.json()["runtime_state"] == "loaded"
        events = await _stream(client, "srv", "hi again", max_tokens=3)
        assert events[-1]["type"] == "response.completed"


def _engine_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("scripted-engine-")]


async def test_an_in_process_engine_thread_that_raises(
    nursery: trio.Nursery, scripted: None
) -> None:
    info = await start_server(nursery, {"eng": {"backend": "scripted", "scripted_mode": "thread"}})
    async with httpx.AsyncClient(base_url=info.url, timeout=15) as client:
        assert (await client.post("/v1/admin/models/eng/load", json={})).status_code == 200
        assert len(_engine_threads()) == 1
        first = _engine_threads()[0]
        events = await _stream(client, "eng", "this prompt will crash the engine now")
        deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
        assert deltas == ["this", " prompt"]  # scripted_crash_after = 2
        assert events[-1]["type"] == "error" and events[-1]["error"]["code"] == "backend_error"
        assert "simulated device fault" in events[-1]["error"]["message"]
        # The watchdog recycles the replica: a fresh engine thread, the dead one joined.
        await wait_for(lambda: _engine_threads() not in ([], [first]), 5.0)
        (recycle,) = _recycles(info, "eng")
        assert recycle.reason.startswith("watchdog: replica 0 exited on its own: engine thread")
        assert not first.is_alive()
        assert info.pool.snapshot("eng").state == "loaded"
        events = await _stream(client, "eng", "a healthy prompt")
        assert events[-1]["type"] == "response.completed"
        assert events[-1]["response"]["output_text"] == "a healthy prompt"
        assert len(_engine_threads()) == 1
